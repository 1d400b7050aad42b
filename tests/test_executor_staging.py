"""The executor's staging: arenas kept between steps and runs, messages sent and received in
place, peak staging memory with scratch buffers.

The multi-rank cases run every rank in a thread of this process over the NCCL transport on
``NcclMock`` (a fabric that really moves bytes between its communicators: tests/test_nccl_mock.py),
so the buffers the executor posts can be recorded and compared with the storages' memory.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import workers

import layoutlang
from layoutlang.core import _core
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder
from layoutlang.runtime.agreement import AGREEMENT_TAG
from layoutlang.runtime.schedule import schedule
from layoutlang.transport.nccl import NcclTransport

pytestmark = pytest.mark.timeout(120)

N = _core.nccl
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KiB = 1024


class RecordingTransport(NcclTransport):
    """The NCCL transport, recording ("send" or "recv", peer, data_ptr, bytes) of every buffer
    the executor's steps post (not the agreement's messages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.posted: list[tuple[str, int, int, int]] = []

    def exchange(self, sends, recvs, tag):
        for way, buffers in (("send", sends), ("recv", recvs)) if tag != AGREEMENT_TAG else ():
            for peer, buf in buffers:
                self.posted.append((way, peer, buf.data_ptr(), buf.numel()))
        return super().exchange(sends, recvs, tag)


def _participants(program):
    statement = program.reshard()
    ranks = set(program.layout(statement.source).mesh.ranks) | set(program.layout(statement.destination).mesh.ranks)
    return sorted(ranks)


def _on_every_rank(program, job, **resharder_kwargs):
    """Run ``job(rank, resharder, transport)`` on every rank of the program's reshard, each in a
    thread with its own Resharder over the mocked NCCL fabric; returns the results by rank."""
    nccl = N.NcclMock()
    cuda = N.CudaMock(nccl)
    participants = _participants(program)
    store = dist.HashStore()
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    def one(r):
        try:
            transport = RecordingTransport.from_store(r, participants, store, api=nccl, cuda=cuda, timeout=20)
            resharder = Resharder(program, rank=r, transport=transport, timeout=20, **resharder_kwargs)
            results[r] = job(r, resharder, transport)
            transport.communicator.destroy()
        except BaseException as err:  # reported below, with its rank
            errors[r] = err

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in participants]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(results) == len(participants)
    return results


def _inside(ptr: int, nbytes: int, tensors) -> bool:
    """Whether [ptr, ptr + nbytes) lies in the memory of one of ``tensors``."""
    for t in tensors:
        start = t.data_ptr()
        if start <= ptr and ptr + nbytes <= start + t.numel() * t.element_size():
            return True
    return False


# ----------------------------------------------------------------------- reuse


def test_repeated_runs_with_new_weights_are_bit_exact_and_allocate_no_staging_again():
    # refit.layout has fused storages (several regions per message: staged) and small buckets
    program = layoutlang.load(EXAMPLES / "refit.layout")

    def job(r, resharder, transport):
        plan = resharder.plan
        sources = resharder.allocate("source")
        destinations = resharder.allocate("destination")
        arenas = []
        checks = []
        for version in range(3):  # each run's weights differ: a stale byte from a reused buffer shows
            if r in plan.source.mesh:
                fill_synthetic(plan.source, r, sources, version=version)
            for t in destinations.values():
                t.fill_(-7)
            resharder.run(sources, destinations)
            arenas.append(tuple(a.buffer.data_ptr() if a.buffer is not None else 0
                                for a in resharder.executor._arenas))
            if r in plan.destination.mesh:
                checks.append(verify(plan.destination, r, destinations, version=version))
        return arenas, checks, resharder.last_report

    results = _on_every_rank(program, job, memory_budget=64 * KiB)
    staged_somewhere = False
    for r, (arenas, checks, report) in results.items():
        assert all(c.ok for c in checks), (r, [c.mismatches for c in checks])
        # the same arenas in every run: allocated in the first, reused after
        assert arenas[0] == arenas[1] == arenas[2], r
        staged_somewhere |= any(arenas[0])
        assert report.peak_staging_bytes <= 64 * KiB, r
    assert staged_somewhere  # the case does exercise the arenas


# ----------------------------------------------------------------------- in place


def test_single_region_messages_are_sent_from_and_received_into_the_storages():
    # tp_to_dp: each message is one contiguous block of rows: a source shard, or the rows of
    # the destination's whole tensor (also when relayed from a destination to a domain peer)
    program = layoutlang.load(EXAMPLES / "tp_to_dp.layout")

    def job(r, resharder, transport):
        plan = resharder.plan
        sources = resharder.allocate("source")
        if r in plan.source.mesh:
            fill_synthetic(plan.source, r, sources)
        destinations = resharder.run(sources)
        check = verify(plan.destination, r, destinations) if r in plan.destination.mesh else None
        return transport.posted, sources, destinations, check, resharder.last_report

    results = _on_every_rank(program, job)
    moved = 0
    for r, (posted, sources, destinations, check, report) in results.items():
        assert check is None or check.ok, check.mismatches
        for way, peer, ptr, nbytes in posted:
            storages = list(sources.values()) + list(destinations.values()) if way == "send" else destinations.values()
            assert _inside(ptr, nbytes, storages), (r, way, peer)
            moved += nbytes
        assert report.peak_staging_bytes == 0, r  # no arena: nothing was staged
    assert moved == 2 * sum(rep.sent["domain"] + rep.sent["network"] for *_, rep in results.values())


def test_cast_destinations_are_staged_and_converted():
    # a destination in another dtype cannot take the wire's bytes in place
    program = layoutlang.load(EXAMPLES / "tp_to_dp.layout")

    def job(r, resharder, transport):
        plan = resharder.plan
        sources = resharder.allocate("source")
        if r in plan.source.mesh:
            fill_synthetic(plan.source, r, sources)
        destinations = resharder.allocate("destination", dtype=torch.float32)
        resharder.run(sources, destinations, cast=True)
        check = verify(plan.destination, r, destinations) if r in plan.destination.mesh else None
        recvs = [p for p in transport.posted if p[0] == "recv"]
        return recvs, destinations, check

    for r, (recvs, destinations, check) in _on_every_rank(program, job).items():
        assert check is None or check.ok, check.mismatches
        assert not any(_inside(ptr, n, destinations.values()) for _, _, ptr, n in recvs), r


def test_a_destination_that_is_its_own_source_is_staged():
    # two ranks swap their halves of "w", each holding ONE buffer handed as both source and
    # destination: a receive in place would overwrite rows the send of the same step reads
    program = layoutlang.loads(
        'mesh m1 [tp = 2] on ranks 0..1\nmesh m2 [tp = 2] on ranks [1, 0]\ntensor "w" [64, 256] fp32\n'
        'layout a on m1 { "w": tp = shard(0) }\nlayout b on m2 { "w": tp = shard(0) }\nreshard a -> b\n'
    )

    def job(r, resharder, transport):
        plan = resharder.plan
        buffer = resharder.allocate("source")["w"]
        fill_synthetic(plan.source, r, {"w": buffer})
        resharder.run({"w": buffer}, {"w": buffer})
        return verify(plan.destination, r, {"w": buffer})

    for r, check in _on_every_rank(program, job).items():
        assert check.ok, (r, check.mismatches)


def test_a_region_whose_size_one_dim_has_any_stride_is_sent_from_its_own_memory():
    # the local tensor of distribute_tensor(...).t(): (6, 1) with strides (1, 6), which torch
    # calls contiguous; a row of it, (1, 1) with strides (1, 6), is one element
    from layoutlang.runtime.executor import _wire

    full = torch.arange(54, dtype=torch.float32).view(9, 6)
    region = full[8:9].t()[1:2, 0:1]
    wire = _wire(region)
    assert wire.data_ptr() == region.data_ptr() and wire.numel() == 4
    assert wire.view(torch.float32).item() == full[8, 1].item()
    assert _wire(torch.tensor(3.0)).view(torch.float32).item() == 3.0


def test_overlap_of_storages_is_found_among_thousands_of_them():
    # the check that turns in-place transfers off runs at every run: a sweep, not all pairs
    from layoutlang.runtime.executor import _overlapping

    flat = torch.empty(4096 * 16)
    sources = {f"s{i}": flat[i * 16 : (i + 1) * 16] for i in range(0, 4096, 2)}  # every other slab
    apart = {f"d{i}": flat[i * 16 : (i + 1) * 16] for i in range(1, 4096, 2)}  # the slabs between
    assert not _overlapping([sources], apart)
    assert _overlapping([sources], {**apart, "x": flat[100:101]})  # inside slab 6
    assert _overlapping([sources], {"y": flat[20:44]})  # across slabs 1 and 2
    assert not _overlapping([sources], {"z": torch.empty(16)})


# ----------------------------------------------------------------------- over gloo

# Large regions (>= OWN_TRANSFER_BYTES) travel as transfers of their own, several to one peer
# in one step, each end posting from or into its storage where it can ("a" is cut on another
# dim at the destination: staged at the sender, in place at the receiver), small ones packed.
MIXED = """
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 2] on ranks 2..3
tensor "a" [1024, 1024] fp32
tensor "b" [1024, 1024] fp32
tensor "c" [64] fp32
tensor "d" [8, 16] bf16
layout megatron on train { "a": tp = shard(0)  "b": tp = shard(0)  default: replicate }
layout vllm on infer { "a": tp = shard(1)  "b": tp = shard(0)  "d": tp = shard(1)  default: replicate }
reshard megatron -> vllm
"""


@pytest.mark.workers(4)
@pytest.mark.parametrize("policy", [None, "broadcast"])
def test_several_transfers_to_one_peer_over_gloo_are_bit_exact_run_after_run(pool, tmp_path, policy):
    path = tmp_path / "mixed.layout"
    path.write_text(MIXED)
    plan = layoutlang.compile_plan(layoutlang.load(path), policy=policy)
    steps = [schedule(plan, r) for r in range(4)]
    assert any(len(m.transfers()) > 1 for per_rank in steps for step in per_rank for m in step.sends.values())
    results = [r for r in pool.run(workers.refit, str(path), [0, 1, 2, 3], policy, 3) if r]
    assert len(results) == 4
    for per_step in results:
        for step in per_step:
            assert step["verified"] in (True, None), step["mismatches"]


# ----------------------------------------------------------------------- accounting


def test_peak_staging_counts_the_scratch_buffers_of_the_broadcast_policy():
    # broadcast: "w" is gathered on a training rank and sent whole to every inference rank;
    # what a rank receives into scratch is live at least during the step it arrives in
    program = layoutlang.load(EXAMPLES / "tp_to_dp.layout")
    budget = 1024 * KiB  # buckets of 512 KiB: "w" (2 MiB) travels in several

    def job(r, resharder, transport):
        plan = resharder.plan
        sources = resharder.allocate("source")
        if r in plan.source.mesh:
            fill_synthetic(plan.source, r, sources)
        destinations = resharder.run(sources)
        check = verify(plan.destination, r, destinations) if r in plan.destination.mesh else None
        arenas = sum(a.nbytes for a in resharder.executor._arenas)
        into_scratch = max(
            (sum(p.nbytes for m in step.recvs.values() for p in m.pieces if p.space == 2)
             for step in resharder.executor.steps),
            default=0,
        )
        return check, resharder.last_report.peak_staging_bytes, arenas, into_scratch

    results = _on_every_rank(program, job, policy="broadcast", memory_budget=budget)
    assert any(into_scratch for *_, into_scratch in results.values())
    for r, (check, peak, arenas, into_scratch) in results.items():
        assert check is None or check.ok, check.mismatches
        assert arenas + into_scratch <= peak <= budget, (r, peak, arenas, into_scratch)
