"""Jobs the multi-process tests run on every worker of a LocalWorkers pool.

Each job takes the program ranks played by the pool's workers (``participants[i]`` is the
program rank of worker i); workers beyond them return None. Jobs return plain data.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.errors import ExecutionError, LayoutError, RuntimeFailure
from layoutlang.io.weights import fill_synthetic, synthetic_box, verify
from layoutlang.runtime import Resharder
from layoutlang.runtime.agreement import AGREEMENT_TAG
from layoutlang.transport import TorchTransport, Transport


def program_rank(participants):
    index = dist.get_rank()
    return participants[index] if index < len(participants) else None


def rank_map(participants):
    return {p: i for i, p in enumerate(participants)}


def refit(path, participants, policy=None, steps=1, cast=None, memory_budget=None, timeout=30.0):
    """Reshard the program's only reshard statement ``steps`` times; verify every byte each time."""
    rank = program_rank(participants)
    if rank is None:
        return None
    program = layoutlang.load(path)
    kwargs = {"memory_budget": memory_budget} if memory_budget else {}
    resharder = Resharder(program, rank=rank, rank_map=rank_map(participants), policy=policy, timeout=timeout, **kwargs)
    sources = resharder.allocate("source")
    fill_synthetic(resharder.plan.source, rank, sources)
    dtype = getattr(torch, cast) if cast else None
    results = []
    for step in range(steps):
        # A new step's weights differ: scale the sources, and expect the scaled truth.
        for tensor in sources.values():
            tensor.mul_(-1)
        completed = []
        destinations = resharder.allocate("destination", dtype=dtype)
        resharder.run(
            sources, destinations, cast=cast is not None,
            on_complete=lambda name, _, completed=completed: completed.append(name),
        )
        sign = -1 if step % 2 == 0 else 1
        truth = _signed_truth(resharder.plan.destination, sign)
        check = None
        if rank in resharder.plan.destination.mesh:
            check = verify(resharder.plan.destination, rank, destinations, truth=truth)
        report = resharder.last_report
        results.append(
            {
                "rank": rank,
                "verified": None if check is None else check.ok,
                "mismatches": [] if check is None else list(check.mismatches),
                "verified_bytes": 0 if check is None else check.bytes,
                "completed": sorted(completed),
                "destinations": sorted(resharder.destination_storages),
                "sent": report.sent,
                "received": report.received,
                "peak_staging": report.peak_staging_bytes,
                "fingerprint": resharder.plan.fingerprint,
            }
        )
    return results


def _signed_truth(layout, sign):
    def truth(name, index, box):
        tensor = layout.tensors[name]
        values = synthetic_box(index, tensor.shape, tensor.dtype, box.offsets, box.sizes)
        return values if sign == 1 or values.dtype == torch.bool else values * sign

    return truth


def build_resharder_error(text_by_rank, participants, timeout=20.0):
    """Build a Resharder from a per-rank program file; return the error message (or None)."""
    import tempfile

    rank = program_rank(participants)
    if rank is None:
        return None
    text = text_by_rank.get(rank, text_by_rank["default"])
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"rank{rank}.layout")
        with open(path, "w") as f:
            f.write(text)
        try:
            Resharder(path, rank=rank, rank_map=rank_map(participants), timeout=timeout)
        except (LayoutError, RuntimeFailure) as err:
            return type(err).__name__ + ": " + err.message
    return None


def run_with_storages(text, participants, mutate, timeout=20.0):
    """Run with storages changed by ``mutate(kind)`` on the first destination (or source) rank."""
    rank = program_rank(participants)
    if rank is None:
        return None
    program = layoutlang.loads(text, path="t.layout")
    resharder = Resharder(program, rank=rank, rank_map=rank_map(participants), timeout=timeout)
    sources = resharder.allocate("source")
    destinations = resharder.allocate("destination")
    side_layout = resharder.plan.destination if mutate.startswith("destination") else resharder.plan.source
    target = min(side_layout.mesh.ranks)
    if rank == target:
        side = destinations if mutate.startswith("destination") else sources
        name = sorted(side)[0]
        if mutate.endswith("misspelled"):
            side[name + "_"] = side.pop(name)
        elif mutate.endswith("missing"):
            del side[name]
        elif mutate.endswith("shape"):
            side[name] = torch.zeros(tuple(s + 1 for s in side[name].shape), dtype=side[name].dtype)
        elif mutate.endswith("dtype"):
            side[name] = side[name].to(torch.float64)
    try:
        resharder.run(sources, destinations)
    except (LayoutError, RuntimeFailure) as err:
        return type(err).__name__ + ": " + err.message
    return None


class _DyingTransport(Transport):
    """Wraps a transport; the chosen rank's process exits at its first exchange."""

    def __init__(self, inner: Transport, die: bool):
        self.inner, self.die = inner, die
        self.rank, self.device = inner.rank, inner.device

    def configure(self, group, rank_map=None):
        self.inner.configure(group, rank_map)

    def exchange(self, sends, recvs, tag):
        if self.die and tag != AGREEMENT_TAG:  # after agreement: in the middle of the transfer
            os._exit(7)
        return self.inner.exchange(sends, recvs, tag)

    def abort(self):
        self.inner.abort()

    def errored(self):
        return self.inner.errored()


def refit_with_a_dying_peer(path, participants, victim, timeout):
    rank = program_rank(participants)
    if rank is None:
        return None
    program = layoutlang.load(path)
    transport = _DyingTransport(TorchTransport(rank, rank_map(participants)), rank == victim)
    resharder = Resharder(program, rank=rank, transport=transport, timeout=timeout)
    sources = resharder.allocate("source")
    start = time.monotonic()
    try:
        resharder.run(sources)
    except (LayoutError, RuntimeFailure) as err:
        return {"error": err.message, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def transport_lifecycle(timeout=0.5):
    """TorchTransport's lifecycle on ranks 0 and 1: a failed wait names the rank and the peer
    and is remembered (errored), abort refuses later exchanges, configure starts afresh."""
    rank = dist.get_rank()
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    transport = TorchTransport(rank, group=first)
    out = {"rank": rank, "errored_at_start": transport.errored()}
    if rank == 0:
        try:
            transport.exchange([], [(1, torch.empty(8, dtype=torch.uint8))], tag=5).wait(timeout)
        except ExecutionError as err:
            out["failure"] = {"rank": err.rank, "peers": err.peers, "remembered": transport.errored() is err}
    dist.barrier()  # gloo closed the first group's connection when rank 0's wait timed out
    transport.abort()
    try:
        transport.exchange([], [], tag=6)
    except ExecutionError as err:
        out["after_abort"] = err.message
    out["errored_after_abort"] = transport.errored() is not None
    transport.configure(second)
    out["errored_after_configure"] = transport.errored()
    peer = 1 - rank
    got = torch.empty(4, dtype=torch.uint8)
    transport.exchange([(peer, torch.full((4,), rank, dtype=torch.uint8))], [(peer, got)], tag=7).wait(10)
    out["received"] = got.tolist()
    return out
