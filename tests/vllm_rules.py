"""vLLM's loading rules that several tests re-derive, written once (from vLLM's source, not
from layoutlang).

``expert_map`` is ``determine_expert_map`` of vllm/model_executor/layers/fused_moe/layer.py:
linear placement gives each EP rank a contiguous range, the first ``experts % ep_size`` ranks
one expert more; ``round_robin`` gives rank r the experts r, r + ep_size, ...
"""

from __future__ import annotations


def expert_map(ep_rank: int, ep_size: int, experts: int, strategy: str = "linear") -> list[int]:
    """The global experts of an EP rank, in local order."""
    if strategy == "round_robin":
        return list(range(ep_rank, experts, ep_size))
    base, remainder = divmod(experts, ep_size)
    count = base + (1 if ep_rank < remainder else 0)
    start = ep_rank * base + min(ep_rank, remainder)
    return list(range(start, start + count))
