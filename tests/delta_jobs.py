"""Jobs of the delta-refit tests (tests/test_delta_refits.py), run on every worker of a pool."""

from __future__ import annotations

import torch
from workers import program_rank, rank_map

import layoutlang
from layoutlang.io.weights import _in_storage, fill_synthetic
from layoutlang.runtime import Resharder, executor

_PRIME = 1_000_003


def change_sources(layout, rank, storages, density: float, step: int) -> None:
    """Change about ``density`` of every tensor's elements, the same ones on every replica (by
    their place in the logical tensor): a third by +1, a third into NaN, a third by a flipped
    sign bit (so +0.0 becomes -0.0 and a NaN another NaN: bits, not values)."""
    threshold = round(density * _PRIME)
    for name in layout.resolved.names:
        shape = layout.tensors[name].shape
        for box in layout.boxes(name, rank):
            held = _in_storage(layout, rank, storages, box)
            index = torch.zeros((), dtype=torch.int64)
            stride = 1
            for d in reversed(range(len(shape))):
                axis = torch.arange(box.offsets[d], box.offsets[d] + box.sizes[d], dtype=torch.int64) * stride
                index = index + axis.view([-1] + [1] * (len(shape) - 1 - d))
                stride *= shape[d]
            hashed = (index * 2654435761 + step * 97531 + 12345) % _PRIME
            chosen = hashed < threshold
            kind = hashed % 3
            new = held.clone()
            if held.is_floating_point():
                new[chosen & (kind == 0)] += 1
                new[chosen & (kind == 1)] = float("nan")
                new[chosen & (kind == 2)] *= -1
            else:
                new[chosen] += 1
            held.copy_(new)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def delta_refits(path, participants, densities, timeout=60.0, keep="copies"):
    """Refit once dense, then once per density with the sources changed that much, as deltas
    into the same destination storages; after each, a dense refit of the same weights into
    fresh storages is the oracle. Returns per step: whether every destination storage is
    bit-identical to the oracle's, and the run's delta report."""
    rank = program_rank(participants)
    if rank is None:
        return None
    program = layoutlang.load(path)
    group = rank_map(participants)
    delta = Resharder(program, rank=rank, rank_map=group, timeout=timeout)
    dense = Resharder(program, rank=rank, rank_map=group, timeout=timeout)
    sources = delta.allocate("source")
    fill_synthetic(delta.plan.source, rank, sources)
    held = delta.allocate("destination")
    out = []
    read_in_place = []  # bytes of the staged messages the encoder read where they lie, not packed

    def counting(spaces, transfer):
        rows = region_rows(spaces, transfer)
        if rows is not None:
            read_in_place.append(rows.numel())
        return rows

    region_rows = executor._region_rows
    for step, density in enumerate((None, *densities)):
        if density is not None:
            change_sources(delta.plan.source, rank, sources, density, step)
        read_in_place.clear()
        executor._region_rows = counting
        try:
            delta.run(sources, held, delta=keep)
        finally:
            executor._region_rows = region_rows
        report = delta.last_report.delta
        oracle = dense.run(sources)
        out.append(
            {
                "rank": rank,
                "density": density,
                "identical": all(torch.equal(_bits(held[n]), _bits(oracle[n])) for n in held),
                "storages": len(held),
                "dense_bytes": report.dense_bytes,
                "wire_bytes": report.wire_bytes,
                "messages": report.messages,
                "kept_bytes": report.kept_bytes,
                "stale": report.stale,
                "read_in_place": sum(read_in_place),
            }
        )
    return out


def delta_after_tampering(path, participants, victim, timeout=60.0):
    """Three delta refits of unchanged weights; between the second and the third, program rank
    ``victim`` overwrites part of its destination storages (as an engine or a bug might) and
    another rank's storages are handed as fresh tensors. Every refit is bit-identical to the
    truth; the third reports the tampered and the fresh storages stale and receives them
    dense."""
    rank = program_rank(participants)
    if rank is None:
        return None
    program = layoutlang.load(path)
    resharder = Resharder(program, rank=rank, rank_map=rank_map(participants), timeout=timeout)
    dense = Resharder(program, rank=rank, rank_map=rank_map(participants), timeout=timeout)
    sources = resharder.allocate("source")
    fill_synthetic(resharder.plan.source, rank, sources)
    held = resharder.allocate("destination")
    destination_ranks = sorted(resharder.plan.destination.mesh.ranks)
    fresh_rank = next(r for r in destination_ranks if r != victim)
    out = []
    for step in range(3):
        if step == 2 and rank == victim:
            for tensor in held.values():
                tensor.view(-1)[: max(1, tensor.numel() // 3)] = 7
        if step == 2 and rank == fresh_rank:
            held = resharder.allocate("destination")
        resharder.run(sources, held, delta=True)
        oracle = dense.run(sources)
        report = resharder.last_report.delta
        out.append(
            {
                "rank": rank,
                "identical": all(torch.equal(_bits(held[n]), _bits(oracle[n])) for n in held),
                "stale": report.stale,
                "wire_bytes": report.wire_bytes,
                "dense_bytes": report.dense_bytes,
                "destination": rank in destination_ranks,
                "fresh": rank == fresh_rank,
            }
        )
    return out


def delta_on_some_ranks(path, participants, asking, timeout=30.0):
    """A refit where only the program ranks in ``asking`` ask for deltas: every rank must stop
    at the agreement, before a byte moves."""
    rank = program_rank(participants)
    if rank is None:
        return None
    resharder = Resharder(layoutlang.load(path), rank=rank, rank_map=rank_map(participants), timeout=timeout)
    sources = resharder.allocate("source")
    resharder.run(sources, delta=rank in asking)
    return rank
