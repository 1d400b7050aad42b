"""Jobs of tests/test_padding.py: refits into padded destinations that the test fills with garbage."""

from __future__ import annotations

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.runtime import Resharder

VOCAB, HIDDEN, TRAIN, INFER, PAD = 1000, 16, 2, 4, 64

TEXT = f"""
mesh train [tp = {TRAIN}] on ranks 0..{TRAIN - 1}
mesh infer [tp = {INFER}] on ranks {TRAIN}..{TRAIN + INFER - 1}
tensor "embed_tokens.weight" [{VOCAB}, {HIDDEN}] bf16
tensor "lm_head.weight" [{VOCAB}, {HIDDEN}] bf16
tensor "small.weight" [10, 2] bf16
layout megatron on train {{ default: tp = shard(0) }}
layout vllm on infer {{ default: tp = shard(0, pad = {PAD}) }}
reshard refit: megatron -> vllm
"""


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16),
        "small.weight": torch.randn(10, 2, generator=g).to(torch.bfloat16),
    }


def vocab_rows(n: int) -> int:
    """Rows per rank of vLLM's VocabParallelEmbedding: padded to a multiple of 64, split evenly."""
    return -(-n // PAD) * PAD // INFER


def garbage(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """An engine buffer as it may be before a refit: NaN everywhere, or random bytes."""
    if kind == "nan":
        return torch.full(shape, float("nan"), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


def padded_refit_job(kind: str, runs: int):
    """Refit ``runs`` times into destinations filled with garbage; each rank's storages after."""
    rank = dist.get_rank()
    resharder = Resharder(layoutlang.loads(TEXT), rank=rank, timeout=30.0)
    full = full_tensors()
    sources = {}
    if rank < TRAIN:  # Megatron's row cut of the vocabulary: torch.chunk
        sources = {name: torch.chunk(t, TRAIN)[rank].contiguous() for name, t in full.items()}
    destinations = {}
    if rank >= TRAIN:
        destinations = {
            name: garbage((vocab_rows(t.shape[0]), t.shape[1]), kind, rank * 10 + i)
            for i, (name, t) in enumerate(full.items())
        }
    for _ in range(runs):
        resharder.run(sources, destinations)
        for t in destinations.values():  # the engine scribbles into its buffers between refits
            if t.shape[0] > 0:
                t[-1].fill_(float("nan"))
    resharder.run(sources, destinations)
    return {name: t.clone() for name, t in destinations.items()}
