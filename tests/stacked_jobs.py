"""Jobs of tests/test_stacked_storages.py, run on every worker of a pool (importable by workers).

A torchtitan-style training side holds stacked experts, ``[E, ...]`` sharded on dim 0 by
``ep``; its storages are cut here from the full stacked tensors, without layoutlang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.errors import RuntimeFailure
from layoutlang.runtime import Resharder

#: torchtitan's GroupedExperts: w1 (gate) and w3 (up) are [E, ffn, dim], w2 (down) [E, dim, ffn]
TITAN = ("moe.experts.w1", "moe.experts.w3", "moe.experts.w2")


def titan_full(experts: int, hidden: int, ffn: int) -> dict[str, torch.Tensor]:
    """The full stacked training weights, the same on every process (seeded)."""
    gen = torch.Generator().manual_seed(12)
    return {
        "moe.experts.w1": torch.randn(experts, ffn, hidden, generator=gen),
        "moe.experts.w3": torch.randn(experts, ffn, hidden, generator=gen),
        "moe.experts.w2": torch.randn(experts, hidden, ffn, generator=gen),
    }


def _resharder(text: str, participants: list[int]) -> tuple[int, Resharder] | None:
    """This worker's program rank and its Resharder for ``text`` (None beyond the participants)."""
    index = dist.get_rank()
    if index >= len(participants):
        return None
    rank = participants[index]
    program = layoutlang.loads(text, path="refit.layout")
    return rank, Resharder(program, rank=rank, rank_map={p: i for i, p in enumerate(participants)}, timeout=30.0)


def refit_stacked(text: str, participants: list[int], train_ranks: list[int], shape: tuple[int, int, int]):
    """Refit from torchtitan's stacked EP shards; return this rank's destination storages
    and the names ``on_complete`` announced (None on a worker beyond the participants)."""
    built = _resharder(text, participants)
    if built is None:
        return None
    rank, resharder = built
    sources = {}
    if rank in train_ranks:
        experts = shape[0]
        per_rank = experts // len(train_ranks)
        ep_rank = train_ranks.index(rank)
        full = titan_full(*shape)
        # the rank's shard of each stacked parameter, as the trainer holds it: a 3-D tensor
        sources = {n: full[n][ep_rank * per_rank : (ep_rank + 1) * per_rank].clone() for n in TITAN}
    completed: list[str] = []
    destinations = resharder.run(sources, on_complete=lambda name, tensor: completed.append(name))
    return {"rank": rank, "destinations": destinations, "completed": sorted(completed)}


def refit_given(text: str, participants: list[int], sources_by_rank: dict[int, dict[str, torch.Tensor]]):
    """Refit from the source storages the test computed for each rank (the engine's own
    parameters, in their own shapes); return this rank's destination storages."""
    built = _resharder(text, participants)
    if built is None:
        return None
    rank, resharder = built
    completed: list[str] = []
    destinations = resharder.run(
        sources_by_rank.get(rank, {}), on_complete=lambda name, tensor: completed.append(name)
    )
    return {"rank": rank, "destinations": destinations, "completed": sorted(completed)}


def refit_into_flattened(text: str, participants: list[int], sources_by_rank, flattened: str, on_rank: int):
    """Refit with one destination rank passing ``flattened`` as a 2-D ``view(-1, H)`` instead
    of the engine's own 3-D parameter; return the error every rank stops with."""
    built = _resharder(text, participants)
    if built is None:
        return None
    rank, resharder = built
    destinations = resharder.allocate("destination")
    if rank == on_rank:
        destinations[flattened] = destinations[flattened].view(-1, destinations[flattened].shape[-1])
    try:
        resharder.run(sources_by_rank.get(rank, {}), destinations)
    except RuntimeFailure as err:
        return type(err).__name__ + ": " + err.message
    return None
