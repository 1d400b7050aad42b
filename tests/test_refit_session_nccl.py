"""The refit session of live engines over NCCL: the call sequences, through the NCCL mock.

Where the trainer and the engines hold CUDA devices, :func:`layoutlang.integrations.refit_session.fleet_session`
runs the session over :class:`elastic.NcclGenerations`: one communicator, shrunk when an
engine is lost and grown when one joins, instead of a gloo group per generation. Here one
thread per rank stands in for a process (trainer ranks 0..1, FSDP; engines of tensor parallel
2 on ranks 2..3 and 4..5; a joining engine on ranks 6..7), over the in-process NCCL mock that
really moves bytes. Rank 4 dies after step 0 (its heartbeat stops, the launcher reports its
exit): its engine is dropped whole (rank 5 is left out), the communicator is shrunk, and the
engine of ranks 6..7 joins at a later step boundary by a grow, filled from the other engine.
Every committed step is verified byte for byte on every engine.
"""

from __future__ import annotations

import threading
import time
from itertools import count

import pytest

import layoutlang
from elastic import ElasticSession, ExitWatcher, JobSecret, NcclGenerations
from elastic.membership import ExcludedError
from layoutlang.cli.elastic_job import synthetic_sources
from layoutlang.core import _core
from layoutlang.integrations.refit_session import SessionAddress, fleet_session
from layoutlang.io.weights import verify
from tests.test_elastic_session_nccl import FakeProcess, client

pytestmark = pytest.mark.timeout(120)

N = _core.nccl
STEPS = 4
PROGRAM = """
mesh train [dp = 2] on ranks 0..1
mesh infer [dp = 2, tp = 2] on ranks 2..5
tensor "embed" [32, 16] fp32
tensor "q" [16, 16] fp32
tensor "norm" [16] fp32
layout fsdp on train { default: dp = shard(0) }
layout serve on infer {
    "embed": tp = shard(0)
    "q": tp = shard(0)
    default: replicate
}
reshard refit: fsdp -> serve
"""
DEAD, LEFT_OUT, JOINERS = 4, 5, (6, 7)
_namespaces = count()


class _Died(Exception):
    """Raised out of the dying rank's step hook: its thread stops taking part."""


@pytest.fixture(scope="module")
def server():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


def calls(nccl, name: str) -> list[str]:
    return [c for c in nccl.calls if c.startswith(name + "(")]


def test_an_engine_lost_shrinks_the_communicator_and_one_joining_grows_it(server):
    nccl = N.NcclMock()
    cuda = N.CudaMock(nccl)
    address = SessionAddress("127.0.0.1", server, f"fleet-nccl{next(_namespaces)}")
    secret = JobSecret.generate()
    program = layoutlang.loads(PROGRAM)
    ranks = [*range(6), *JOINERS]
    processes = {r: FakeProcess() for r in ranks}
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}
    admitted = threading.Event()

    def main(rank: int) -> dict:
        seen: dict = {"rank": rank, "checked": [], "hows": []}
        session: ElasticSession = fleet_session(
            program, None, rank=rank, store=client(server), address=address, secret=secret,
            join=rank in JOINERS, timeout=30.0, deadline=1.0, memory_budget=8192,
            backend=NcclGenerations(api=nccl, cuda=cuda, timeout=30.0),
        )
        seen["session"] = session
        if rank in JOINERS:
            admitted.set()
            v = verify(session.destination, rank, session.destinations, version=session.committed_step)
            seen["joined"] = {"step": session.committed_step, "ok": v.ok, "bytes": v.bytes}
        try:
            while session.next_step < STEPS:
                step = session.next_step
                if step == 2 and rank not in JOINERS:  # the joining engine asks before step 2 commits
                    while not set(JOINERS) <= {*session.asking, *session.members}:
                        time.sleep(0.01)
                session.refit(step, synthetic_sources)
                seen["hows"].append(session.group.how)
                if rank in session.destination.mesh:
                    v = verify(session.destination, rank, session.destinations, version=step)
                    seen["checked"].append({"step": step, "ok": v.ok, "bytes": v.bytes})
                else:
                    seen["checked"].append({"step": step})
                if rank == DEAD and step == 0:
                    session.heartbeat.stop()
                    processes[rank].exitcode = -9  # SIGKILL, as the launcher reports it
                    raise _Died(f"rank {rank} died after step 0")
        except _Died:
            seen["died"] = True
            return seen
        except ExcludedError as err:
            seen["excluded"] = str(err)
            session.close()
            return seen
        seen["destination_ranks"] = list(session.destination.mesh.ranks)
        session.close()
        return seen

    def target(rank: int) -> None:
        if rank in JOINERS:  # started once the engine of ranks 4..5 is gone
            processes[rank].exitcode = None
            while processes[DEAD].exitcode is None:
                time.sleep(0.01)
        try:
            results[rank] = main(rank)
        except BaseException as err:  # reported to the test
            errors[rank] = err
            processes[rank].exitcode = 1

    with ExitWatcher(client(server), processes, namespace=address.namespace, period=0.02, secret=secret):
        threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    for rank, err in sorted(errors.items()):
        raise AssertionError(f"rank {rank} failed: {type(err).__name__}: {err}") from err
    assert admitted.is_set()

    survivors = [0, 1, 2, 3]
    for rank in [*survivors, *JOINERS]:
        seen = results[rank]
        assert seen["destination_ranks"] == [2, 3, 6, 7], rank  # the joiner took the lost engine's place
        assert all(c.get("ok", True) for c in seen["checked"]), (rank, seen["checked"])
    for rank in survivors:
        assert [c["step"] for c in results[rank]["checked"]] == list(range(STEPS))
    for rank in JOINERS:
        joined = results[rank]["joined"]
        assert joined["ok"] and joined["bytes"] > 0  # filled from the other engine
        assert [c["step"] for c in results[rank]["checked"]] == list(range(joined["step"] + 1, STEPS))
    assert "excluded" in results[LEFT_OUT]  # its engine lost rank 4: it goes with it
    grows = [r for rank in survivors for r in results[rank]["session"].recoveries if r.joined]
    assert grows and all(r.recovered_from["destination"] > 0 and r.recovered_from["source"] == 0 for r in grows)
    # one communicator: created once, shrunk without the lost engine, grown by the joiner
    assert calls(nccl, "ncclGetUniqueId") == ["ncclGetUniqueId()"]
    assert len(calls(nccl, "ncclCommInitRankConfig")) == 6
    # the four survivors shrink the lost engine's two ranks away (after a failure NCCL need
    # not be quiescent: abort mode), all at once
    assert sorted(calls(nccl, "ncclCommShrink")) == [
        f"ncclCommShrink(rank={r}, exclude=[4, 5], flags=NCCL_SHRINK_ABORT)" for r in range(4)
    ]
    # then the survivors grow by two and the joining engine's ranks take communicator ranks
    # 4 and 5 (the coordinator, communicator rank 0, publishes the single-use id)
    grows = sorted(calls(nccl, "ncclCommGrow"))
    assert grows == sorted([
        "ncclCommGrow(rank=0, nranks=6, id=set, newrank=-1)",
        *[f"ncclCommGrow(rank={r}, nranks=6, id=null, newrank=-1)" for r in (1, 2, 3)],
        *[f"ncclCommGrow(rank=new, nranks=6, id=set, newrank={r})" for r in (4, 5)],
    ])
    assert "grow" in {h for rank in survivors for h in results[rank]["hows"]}
