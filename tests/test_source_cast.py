"""Sources in another dtype than the layout's: refused by default, cast while packing when asked.

fp32 master weights (training) into a bf16 wire and bf16 inference weights: with
``Resharder.run(..., cast_sources=True)`` every destination value must be bit-exact equal to
torch's own ``full.to(torch.bfloat16)`` of the same fp32 values, cut in the test with
``torch.chunk`` (not by layoutlang). Runs on gloo, 4 workers.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import layoutlang
from layoutlang.errors import ExecutionError
from layoutlang.runtime import Resharder

pytestmark = [pytest.mark.workers(4), pytest.mark.timeout(180)]

TEXT = """
mesh train [tp = 2] on ranks 0..1
mesh infer [dp = 2] on ranks 2..3
tensor "w" [6, 5] bf16
tensor "v" [7] bf16
layout megatron on train { "w": tp = shard(1) "v": tp = shard(0) }
layout vllm on infer { "w": replicate "v": replicate }
reshard refit: megatron -> vllm
"""


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # Values with more mantissa bits than bf16 keeps, so the cast has to round.
    return {"w": torch.randn(6, 5, generator=g) / 3, "v": torch.randn(7, generator=g) * 1e3 + 1 / 7}


def cast_job(cast_sources: bool):
    rank = dist.get_rank()
    resharder = Resharder(layoutlang.loads(TEXT), rank=rank, timeout=30.0)
    full = _full()
    sources = {}
    if rank < 2:  # fp32 master weights, cut as Megatron's column parallel cut (torch.chunk)
        sources = {"w": torch.chunk(full["w"], 2, dim=1)[rank].contiguous(), "v": torch.chunk(full["v"], 2)[rank]}
    try:
        out = resharder.run(sources, cast_sources=cast_sources)
    except ExecutionError as err:
        return "refused: " + err.message
    return {name: (t.dtype, t.clone()) for name, t in out.items()}


def test_fp32_sources_are_refused_with_the_way_to_ask(pool):
    results = pool.run(cast_job, False)
    for r in results:
        assert isinstance(r, str) and r.startswith("refused: "), r
        assert "is torch.float32" in r and "holds torch.bfloat16" in r
        assert "cast_sources=True" in r


def test_fp32_sources_cast_while_packing_equal_torch_to_bf16(pool):
    results = pool.run(cast_job, True)
    expected = {name: t.to(torch.bfloat16) for name, t in _full().items()}
    assert results[0] == {} and results[1] == {}
    for rank in (2, 3):
        got = results[rank]
        assert set(got) == {"w", "v"}
        for name, (dtype, tensor) in got.items():
            assert dtype == torch.bfloat16
            # bit-exact: the same 16-bit patterns as torch's own cast
            assert torch.equal(tensor.view(torch.int16), expected[name].view(torch.int16)), (rank, name)
