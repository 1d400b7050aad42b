"""Elastic sessions end to end over the NCCL generation backend and the mock fabric.

One thread per rank stands in for a process: each runs an :class:`elastic.ElasticSession`
with :class:`elastic.NcclGenerations` over the in-process NCCL mock (communicators created
from one id, one per thread, really move bytes; the transport's device is the CPU), and a
TCPStore client of its own against a store the test hosts. An :class:`elastic.ExitWatcher`
watches fake process objects, so a rank that "dies" is reported exactly as the launcher
reports a dead worker process.

The program: training on ranks 0..1 (two replicas), inference on ranks 2..5 (``dp = 2``
replicas of ``tp = 2``, a fused ``qk`` storage), domains of 2 ranks. In the inference
side's plan, rank 4 relays a replicated tensor to rank 5 in the second executor step: a
rank 4 that dies halfway through the refit leaves rank 5 waiting on a receive from it,
which the mock fails with NCCL's asynchronous ncclRemoteError. Every committed step is
verified byte for byte on every destination rank.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from itertools import count

import pytest
import torch.distributed as dist

import layoutlang
from elastic import ElasticSession, ExitWatcher, NcclGenerations
from layoutlang.cli.elastic_job import synthetic_sources
from layoutlang.core import _core
from layoutlang.errors import NcclError
from layoutlang.io.weights import verify

pytestmark = pytest.mark.timeout(120)

N = _core.nccl
REMOTE = 6  # ncclRemoteError
STEPS = 4
DEAD, STARVED, JOINER = 4, 5, 6  # the rank that dies, the rank left waiting on it, a replacement

PROGRAM = """
topology { domain_size = 2 }
mesh train [dp = 2]
mesh infer [dp = 2, tp = 2] on ranks 2..5
tensor "embed" [32, 16] fp32
tensor "q" [16, 16] fp32
tensor "k" [8, 16] fp32
tensor "norm" [16] fp32
layout rep on train { default: replicate }
layout serve on infer {
    "embed": tp = shard(0)
    "q": tp = shard(0)
    "k": tp = shard(0)
    default: replicate
    storage "qk" = "q" | "k"
}
reshard refit: rep -> serve
"""

_namespaces = count()


class _Died(Exception):
    """Raised out of a dying rank's progress callback: its thread stops taking part."""


class FakeProcess:
    """What ExitWatcher asks of a worker process."""

    def __init__(self) -> None:
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


@pytest.fixture(scope="module")
def server():
    """The store every rank reaches (its port): the test hosts it, as a launcher does."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store.port
    del store


@pytest.fixture
def failed_waits(monkeypatch):
    """Every NCCL exchange wait that failed: (job rank, the error), in order."""
    from layoutlang.transport.nccl import transport as nccl_module

    failed: list[tuple[int, BaseException]] = []
    lock = threading.Lock()
    wait = nccl_module._NcclPending.wait

    def recording(self, timeout):
        try:
            return wait(self, timeout)
        except BaseException as err:
            with lock:
                failed.append((self.transport.rank, err))
            raise

    monkeypatch.setattr(nccl_module._NcclPending, "wait", recording)
    return failed


@pytest.fixture
def fabric():
    nccl = N.NcclMock()
    return nccl, N.CudaMock(nccl)


def client(port: int) -> dist.TCPStore:
    """A store client of its own (one is never shared between threads)."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


class _DiesInBuild(NcclGenerations):
    """A rank's backend that makes it die when it is about to build ``generation`` (before it
    writes its rendezvous record)."""

    def __init__(self, generation: int, die, **kwargs):
        super().__init__(**kwargs)
        self.generation, self.die = generation, die

    def build(self, store, membership, previous, *, timeout=None):
        if membership.generation == self.generation:
            self.die()
        return super().build(store, membership, previous, timeout=timeout)


def run_job(
    server, fabric, *, die=None, die_in_build=None, joiners=(), session_timeout=30.0, timeout=90.0
):
    """Run STEPS refits on ranks 0..5 (and ``joiners``), one thread each; returns rank -> what
    it saw. ``die`` = (rank, step): that rank dies halfway through the executor steps of that
    step's refit, while rank STARVED waits on a receive from it. ``die_in_build`` =
    (rank, generation): that rank dies as it starts building that generation's communicator."""
    port = server
    nccl, cuda = fabric
    namespace = f"nccl-session{next(_namespaces)}"
    program = layoutlang.loads(PROGRAM)
    ranks = list(range(6)) + list(joiners)
    processes = {r: FakeProcess() for r in ranks}
    progressed: dict[int, list[tuple[int, int, int]]] = {r: [] for r in ranks}
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}

    def die_now(rank: int, session: ElasticSession) -> None:
        """This rank's process dies: NCCL fails the survivors' operations pending on it,
        its heartbeat stops, and the launcher sees its exit."""
        end = time.monotonic() + 10
        # rank STARVED has finished its first executor step and posted its receive from us
        while (die[1], 1, 2) not in progressed[STARVED] or nccl.pending_recvs() < 1:
            assert time.monotonic() < end, "rank 5 never waited on the dying rank"
            time.sleep(0.01)
        time.sleep(0.05)
        nccl.fail_async(REMOTE, after_polls=0, rank=session.group.rank_map()[STARVED])
        session.heartbeat.stop()
        processes[rank].exitcode = -9  # SIGKILL, as ExitWatcher reports it
        raise _Died(f"rank {rank} died at step {die[1]}")

    def main(rank: int) -> dict:
        seen: dict = {"rank": rank, "checked": [], "shrinks": [], "grows": [], "died": False}
        join = rank in joiners

        def on_step(step: int, session: ElasticSession) -> None:
            report = session.last_report  # the generation the step committed in
            entry = {
                "step": step,
                "generation": report.generation,
                "attempts": report.attempts,
                "destination": report.destination,
            }
            if rank in session.destination.mesh:
                v = verify(session.destination, rank, session.destinations, version=step)
                entry.update(ok=v.ok, bytes=v.bytes, mismatches=list(v.mismatches))
            seen["checked"].append(entry)

        def progress(step: int, done: int, total: int) -> None:
            progressed[rank].append((step, done, total))
            if die is not None and rank == die[0] and step == die[1] and done == max(1, total // 2):
                die_now(rank, session)

        def die_building() -> None:
            session.heartbeat.stop()
            seen["died_at"] = time.time()
            processes[rank].exitcode = -9
            raise _Died(f"rank {rank} died building generation {die_in_build[1]}")

        if die_in_build is not None and rank == die_in_build[0]:
            backend = _DiesInBuild(
                die_in_build[1], die_building, api=nccl, cuda=cuda, timeout=session_timeout
            )
        else:
            backend = NcclGenerations(api=nccl, cuda=cuda, timeout=session_timeout)
        session = ElasticSession(
            program,
            rank=rank,
            store=client(port),
            port=port,
            namespace=namespace,
            backend=backend,
            join=join,
            deadline=1.0,
            timeout=session_timeout,
            memory_budget=8192,
            on_shrink=lambda change: seen["shrinks"].append(change),
            on_grow=lambda change: seen["grows"].append(change),
        )
        seen["session"] = session
        if join and rank in session.destination.mesh:
            # what the recovery plan gave the joiner: the weights of the last committed step
            v = verify(
                session.destination, rank, session.destinations, version=session.committed_step
            )
            seen["joined"] = {
                "step": session.committed_step,
                "generation": session.generation,
                "ok": v.ok,
                "bytes": v.bytes,
                "mismatches": list(v.mismatches),
            }
        try:
            seen["reports"] = session.run(
                synthetic_sources, STEPS, on_step=on_step, progress=progress
            )
        except _Died:
            seen["died"] = True  # no close: a dead process releases nothing
            return seen
        except BaseException:
            session.close()  # a process that fails exits: the others notice and go on
            raise
        seen["generation"] = session.generation
        seen["members"] = session.members
        session.close()
        return seen

    def target(rank: int) -> None:
        try:
            results[rank] = main(rank)
        except BaseException as err:  # reported to the test
            errors[rank] = err
            processes[rank].exitcode = 1

    with ExitWatcher(client(port), processes, namespace=namespace, period=0.02):
        threads = {
            r: threading.Thread(target=target, args=(r,), name=f"rank-{r}", daemon=True)
            for r in ranks
        }
        for t in threads.values():
            t.start()
        end = time.monotonic() + timeout
        for t in threads.values():
            t.join(max(0.0, end - time.monotonic()))
        hung = [r for r, t in threads.items() if t.is_alive()]
    for rank, err in sorted(errors.items()):
        raise AssertionError(f"rank {rank} failed: {type(err).__name__}: {err}") from err
    assert not hung, f"ranks {hung} did not finish within {timeout:g} s"
    return results


def calls(nccl, name: str) -> list[str]:
    return [c for c in nccl.calls if c.startswith(name + "(")]


def check_verified(seen: dict, steps, destination: str) -> list[int]:
    """Every step in ``steps`` committed, once each and in order, with every destination byte
    right, on the layout ``destination`` (``{g}``: the generation the step committed in, which
    names the layouts it made); returns those generations. Which generation a recovery ends
    in is the machine's timing: the tests compare generations, they do not count them."""
    checked = [c for c in seen["checked"] if c["step"] in steps]
    assert [c["step"] for c in checked] == list(steps), (seen["rank"], seen["checked"])
    for c in checked:
        assert c["destination"] == destination.format(g=c["generation"]), (seen["rank"], c)
        assert c["ok"] and c["bytes"] > 0 and not c["mismatches"], (seen["rank"], c)
    return [c["generation"] for c in checked]


def lost_and_joined(recoveries) -> tuple[list[int], list[int]]:
    """The ranks every recovery of a session lost, and those that joined."""
    return sorted(r for rec in recoveries for r in rec.lost), sorted(r for rec in recoveries for r in rec.joined)


# ------------------------------------------------------------------------- tests


def test_refits_without_failures_commit_on_one_communicator(server, fabric):
    nccl, _ = fabric
    results = run_job(server, fabric)
    assert sorted(results) == list(range(6))
    for rank, seen in results.items():
        assert not seen["died"] and seen["generation"] == 0 and seen["members"] == list(range(6))
        assert [c["step"] for c in seen["checked"]] == list(range(STEPS))
        assert all(c["generation"] == 0 and c["attempts"] == 1 for c in seen["checked"])
        assert [r.generation for r in seen["reports"]] == [0] * STEPS
        assert seen["session"].recoveries == [] and not seen["shrinks"] and not seen["grows"]
        group = seen["session"].group
        assert group.how == "create" and group.order == list(range(6))
        assert group.communicator.rank == rank
    for rank in range(2, 6):
        assert check_verified(results[rank], range(STEPS), "serve") == [0] * STEPS
    assert sum(r.received_bytes for rank in range(2, 6) for r in results[rank]["reports"]) > 0
    # one communicator: one id, one init per rank, never a shrink or a grow
    assert calls(nccl, "ncclGetUniqueId") == ["ncclGetUniqueId()"]
    inits = calls(nccl, "ncclCommInitRankConfig")
    assert sorted(inits) == [
        f"ncclCommInitRankConfig(nranks=6, rank={r}, blocking=0)" for r in range(6)
    ]
    assert not calls(nccl, "ncclCommShrink") and not calls(nccl, "ncclCommGrow")
    assert not calls(nccl, "ncclCommRevoke")
    assert nccl.live_comms() == 0  # every session released its communicator on close


def test_a_rank_that_dies_mid_refit_is_shrunk_away_and_the_step_retried(
    server, fabric, failed_waits
):
    nccl, _ = fabric
    results = run_job(server, fabric, die=(DEAD, 1))
    survivors = [0, 1, 2, 3, 5]
    dead = results[DEAD]
    assert dead["died"] and [c["step"] for c in dead["checked"]] == [0]

    generations = {results[rank]["generation"] for rank in survivors}
    assert len(generations) == 1 and generations.pop() >= 1  # every survivor ends in the same one
    for rank in survivors:
        seen = results[rank]
        assert not seen["died"] and seen["members"] == survivors
        assert [c["step"] for c in seen["checked"]] == list(range(STEPS))
        reports = seen["reports"]
        assert [r.step for r in reports] == list(range(STEPS))
        # step 0 committed before the death; step 1, aborted by it, was retried in a later
        # generation; the steps after it committed in the survivors' final generation
        assert (reports[0].generation, reports[0].attempts) == (0, 1)
        assert reports[1].generation >= 1 and reports[1].attempts >= 2
        assert [r.generation for r in reports] == sorted(r.generation for r in reports)
        assert reports[-1].generation == seen["generation"]
        assert all(r.members == tuple(survivors) for r in reports[1:])
        assert lost_and_joined(seen["session"].recoveries) == ([DEAD], [])
        (recovery,) = [rec for rec in seen["session"].recoveries if DEAD in rec.lost]
        # its own reasons: none when another survivor agreed the generation before it noticed
        assert set(recovery.reasons) <= {DEAD}, recovery.reasons
        assert recovery.agreed_at - recovery.noticed_at < 5
        # the shrink hook saw the generation that lost it
        assert any(
            c.generation == recovery.generation and c.lost == (DEAD,) and c.members == tuple(survivors)
            for c in seen["shrinks"]
        ), seen["shrinks"]
        group = seen["session"].group
        assert group.generation == seen["generation"] and group.how == "shrink" and group.order == survivors
        assert group.communicator.rank == survivors.index(rank)  # relative order kept
    reasons = [rec.reasons for r in survivors for rec in results[r]["session"].recoveries if DEAD in rec.lost]
    assert any(DEAD in why for why in reasons)
    assert all("exited" in why[DEAD] or "heartbeat" in why[DEAD] for why in reasons if why)
    # rank 5 noticed through NCCL: its receive from the dead rank failed (ncclRemoteError)
    # and the revoke policy ran; no other wait failed on an NCCL error
    nccl_errors = [(rank, err) for rank, err in failed_waits if isinstance(err, NcclError)]
    assert [rank for rank, _ in nccl_errors] == [STARVED], failed_waits
    error = nccl_errors[0][1]
    assert error.code == REMOTE and "ncclRemoteError" in error.message
    assert error.message.startswith(
        f"rank {STARVED}: the NCCL exchange with rank {DEAD} failed (receiving"
    )
    assert "the communicator was revoked" in error.message

    # drop-replica: the replica of the dead rank (ranks 4, 5) leaves the inference layout;
    # step 0 was verified on the full layout, the retried step 1 and the later ones on ranks 2, 3
    for rank in (2, 3):
        assert check_verified(results[rank], [0], "serve") == [0]
        assert min(check_verified(results[rank], range(1, STEPS), "serve_gen{g}")) >= 1
    assert check_verified(results[STARVED], [0], "serve") == [0]
    assert all("ok" not in c for c in results[STARVED]["checked"][1:])  # it holds nothing any more
    assert results[STARVED]["session"].destinations == {}
    assert {results[r]["session"].source.name for r in survivors} == {"rep"}  # training kept
    assert all(r.received_bytes > 0 for rank in (2, 3) for r in results[rank]["reports"])

    # NCCL: one communicator created, then shrunk in abort mode without the dead rank
    assert len(calls(nccl, "ncclCommInitRankConfig")) == 6
    assert sorted(calls(nccl, "ncclCommShrink")) == [
        f"ncclCommShrink(rank={r}, exclude=[{DEAD}], flags=NCCL_SHRINK_ABORT)" for r in survivors
    ]
    assert f"ncclCommRevoke(rank={STARVED}, flags=0)" in calls(nccl, "ncclCommRevoke")
    assert not calls(nccl, "ncclCommGrow")
    assert nccl.live_comms() == 1  # only the dead rank's communicator, never released


def test_a_joiner_takes_the_place_of_a_dead_rank_and_receives_its_shards(server, fabric):
    nccl, _ = fabric
    results = run_job(server, fabric, die=(DEAD, 1), joiners=(JOINER,))
    survivors = [0, 1, 2, 3, 5]
    final = [0, 1, 2, 3, 5, JOINER]
    assert results[DEAD]["died"]

    joiner = results[JOINER]
    joined = joiner["joined"]
    admitted_after = joined["step"]  # the step whose commit admitted it: the machine's timing
    assert admitted_after in (1, 2, 3), joined
    (grow,) = [rec for rec in joiner["session"].recoveries if JOINER in rec.joined]
    # the recovery plan gave it the last committed step's weights, byte for byte, in the
    # generation that admitted it, its last
    assert joined["generation"] == grow.generation == joiner["generation"], (joined, grow)
    assert joined["ok"] and joined["bytes"] > 0, joined
    assert grow.joined == (JOINER,) and grow.lost == ()
    assert grow.recovery_moves > 0 and grow.recovered_bytes > 0
    assert joiner["members"] == final
    assert [c["step"] for c in joiner["checked"]] == list(range(admitted_after + 1, STEPS))
    check_verified(joiner, range(admitted_after + 1, STEPS), "serve_gen{g}")
    group = joiner["session"].group
    assert group.how == "join" and group.order == [*survivors, JOINER]  # the joiner comes last

    for rank in survivors:
        seen = results[rank]
        assert seen["generation"] == joiner["generation"] and seen["members"] == final
        assert [c["step"] for c in seen["checked"]] == list(range(STEPS))
        recoveries = seen["session"].recoveries
        assert lost_and_joined(recoveries) == ([DEAD], [JOINER])
        # the dead rank's place opened first, then the joiner was admitted into it
        (shrink,) = [rec for rec in recoveries if DEAD in rec.lost]
        assert [rec.generation for rec in recoveries if JOINER in rec.joined] == [grow.generation]
        assert 0 < shrink.generation < grow.generation
        assert [c.generation for c in seen["grows"]] == [grow.generation]
        assert seen["session"].group.how == "grow" and seen["session"].group.order == [*survivors, JOINER]
    # the inference side is whole again: ranks 5 and 6 form the replica that ranks 4 and 5 were
    for rank in (2, 3):
        assert check_verified(results[rank], [0], "serve") == [0]
        before = check_verified(results[rank], range(1, admitted_after + 1), "serve_gen{g}")
        assert all(0 < g < grow.generation for g in before), before
        after = check_verified(results[rank], range(admitted_after + 1, STEPS), "serve_gen{g}")
        assert all(g >= grow.generation for g in after), after
    check_verified(results[STARVED], range(admitted_after + 1, STEPS), "serve_gen{g}")
    # recovered from the surviving inference replica: the training side sent nothing
    assert [rec.recovered_bytes > 0 for rec in results[STARVED]["session"].recoveries if JOINER in rec.joined] == [True]
    for rank in (0, 1):
        assert all(rec.recovered_bytes == 0 for rec in results[rank]["session"].recoveries)

    # NCCL: shrink without the dead rank, then grow by the joiner (the lowest job rank's id)
    assert sorted(calls(nccl, "ncclCommShrink")) == [
        f"ncclCommShrink(rank={r}, exclude=[{DEAD}], flags=NCCL_SHRINK_ABORT)" for r in survivors
    ]
    assert calls(nccl, "ncclCommGetUniqueId") == ["ncclCommGetUniqueId(rank=0)"]
    assert sorted(calls(nccl, "ncclCommGrow")) == [
        "ncclCommGrow(rank=0, nranks=6, id=set, newrank=-1)",
        *[f"ncclCommGrow(rank={r}, nranks=6, id=null, newrank=-1)" for r in range(1, 5)],
        "ncclCommGrow(rank=new, nranks=6, id=set, newrank=5)",
    ]
    assert nccl.live_comms() == 1  # only the dead rank's communicator


def test_a_rank_that_dies_before_its_rendezvous_record_is_noticed_within_the_deadline(
    server, fabric
):
    nccl, _ = fabric
    # rank 4 dies mid-refit; rank 1 dies as the survivors start building generation 1
    results = run_job(server, fabric, die=(DEAD, 1), die_in_build=(1, 1), session_timeout=10.0)
    survivors = [0, 2, 3, 5]
    assert results[1]["died"] and results[DEAD]["died"]
    generations = {results[rank]["generation"] for rank in survivors}
    assert len(generations) == 1, generations  # every survivor ends in the same one
    (generation,) = generations
    # rank 1 was a member of the generation that first left rank 4 out (it died building it):
    # a later one lost it
    assert generation >= 2
    for rank in survivors:
        seen = results[rank]
        assert seen["members"] == survivors
        assert [c["step"] for c in seen["checked"]] == list(range(STEPS))
        # the generation rank 1 died building was never entered: the recovery that lost rank 1
        # lost rank 4 too
        assert lost_and_joined(seen["session"].recoveries) == ([1, DEAD], [])
        (recovery,) = [rec for rec in seen["session"].recoveries if 1 in rec.lost]
        assert recovery.lost == (1, DEAD) and recovery.generation >= 2
        assert seen["session"].group.how == "shrink" and seen["session"].group.order == survivors
        assert seen["session"].source.name == f"rep_gen{generation}"  # training on rank 0 only
    for rank in (2, 3):
        assert check_verified(results[rank], [0], "serve") == [0]
        assert min(check_verified(results[rank], range(1, STEPS), "serve_gen{g}")) >= 2
    assert sorted(calls(nccl, "ncclCommShrink")) == [
        f"ncclCommShrink(rank={r}, exclude=[1, {DEAD}], flags=NCCL_SHRINK_ABORT)" for r in survivors
    ]
    # rank 1's exit was in the store at once: the survivors' builds of generation 1, watched
    # by their sessions, should end within about the deadline, not at the rendezvous timeout
    took = (
        max(rec.group_at for r in survivors for rec in results[r]["session"].recoveries if 1 in rec.lost)
        - results[1]["died_at"]
    )
    # each build has a store client of its own, so the watch sees the exit at once
    assert took < 5.0, f"the survivors built the generation without rank 1 {took:.1f} s after it died (timeout 10 s)"
