"""Elastic membership on real processes: heartbeats, exit notifications, per-operation
deadlines, survivor agreement, and the gloo group of each generation (shrink and grow).

Failures are real: the parent SIGSTOPs or SIGKILLs a worker and times every phase from
that moment. Each test uses its own namespace, so no key is shared between tests.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import elastic_jobs
import pytest
import torch.distributed as dist

import elastic
from elastic import ExcludedError, Membership, MembershipError, decode_members, encode_members
from layoutlang.errors import ExecutionError

SIZE = 4


def _wait_keys(store, keys, timeout):
    end = time.monotonic() + timeout
    while not all(store.check([k]) for k in keys):
        assert time.monotonic() < end, f"keys {keys} not all set within {timeout} s"
        time.sleep(0.02)


# The `pool` of the multi-process tests (tests/conftest.py): exactly SIZE ranks (the jobs'
# membership is the whole world), the module's own: a test SIGSTOPs one of its workers, and
# the jobs leave elastic groups in the workers and their keys in the store.
pytestmark = pytest.mark.workers(SIZE, scope="module")


# ----------------------------------------------------------------- in one process


@pytest.mark.timeout(30)
def test_members_are_plain_json_and_one_writer_wins_in_one_process(monkeypatch):
    monkeypatch.delenv("LAYOUTLANG_JOB_SECRET", raising=False)  # unsigned: the stored value is the list
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    assert encode_members([3, 1, 1, 0]) == b"[0,1,3]"
    assert decode_members(b"[0,1,3]") == [0, 1, 3]
    with pytest.raises(MembershipError):
        decode_members(b'{"a": 1}')
    a, b = Membership(store, 0, namespace="solo"), Membership(store, 2, namespace="solo")
    assert a.propose(1, [0, 1]) == [0, 1]
    assert b.propose(1, [0, 1, 2]) == [0, 1]  # the first writer won
    with pytest.raises(ExcludedError, match="rank 2 is excluded from generation 1"):
        b.agree(1, [0, 1, 2])
    assert isinstance(ExcludedError(2, 1, [0]), ExecutionError)  # the user's error family
    assert a.latest() is None and a.members_of(0) is None
    a.propose(0, [0, 1, 2])
    assert a.latest() == 1
    with pytest.raises(MembershipError, match="not agreed within"):
        a.wait_for(5, timeout=0.1)
    assert store.get("solo/gen1/members") == b"[0,1]"


@pytest.mark.timeout(30)
def test_heartbeat_detector_and_exit_notification_in_one_process():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    hb = elastic.Heartbeat("127.0.0.1", store.port, 5, namespace="one", interval=0.05)
    detector = elastic.FailureDetector(store, 0, [5, 6], namespace="one", deadline=0.4)
    start = time.monotonic()
    failures = detector.wait_for_failure(timeout=3)
    assert set(failures) == {6} and "no heartbeat" in failures[6]  # 6 never beat
    assert 0.3 < time.monotonic() - start < 2.0
    assert detector.check([5]) == {}  # alive: its counter advances
    hb.set_generation(1)  # it moved on: still alive for peers watching generation 0
    assert detector.check([5]) == {}
    assert elastic.FailureDetector(store, 1, [5], namespace="one", deadline=0.4).check([5]) == {}
    hb.stop()
    assert set(detector.check([5])) == {5}  # stopped: no advance within the deadline

    class Done:
        exitcode = -9

        def is_alive(self):
            return False

    with elastic.ExitWatcher(store, {7: Done()}, namespace="one", period=0.02):
        _wait_keys(store, ["one/gen0/exited/7", "one/gen1/exited/7"], 3)
    exits = elastic.FailureDetector(store, 0, [7], namespace="one", deadline=10)
    assert "exited (exit code -9)" in exits.poll()[7]


@pytest.mark.timeout(30)
def test_failed_peers_reads_the_peers_of_a_transport_error():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False)
    hb = elastic.Heartbeat("127.0.0.1", store.port, 1, namespace="op", interval=0.05)
    try:
        detector = elastic.FailureDetector(store, 0, [1, 2], namespace="op", deadline=0.3)
        # TorchTransport's message names the peer; rank 2 never beats, rank 1 is alive but slow
        err = ExecutionError(
            "rank 0: receiving 64 bytes from rank 2 failed or did not complete within 1 s"
        )
        assert set(elastic.failed_peers(err, detector)) == {2}
        slow = ExecutionError(
            "rank 0: sending 64 bytes to rank 1 failed or did not complete within 1 s"
        )
        assert elastic.failed_peers(slow, detector) == {}  # a slow peer is not declared failed
        # GlooTransport names its peers in the error's typed field; rank_of maps them to job ranks
        tagged = ExecutionError("opaque", rank=0, peers=[11])
        assert set(elastic.failed_peers(tagged, detector, rank_of={11: 2})) == {2}
    finally:
        hb.stop()


# ----------------------------------------------------------------- multi-process


@pytest.mark.timeout(60)
def test_survivors_agree_when_several_propose_at_once(pool):
    results = pool.run(elastic_jobs.agree_concurrently, "agree", timeout=45)
    won = {tuple(r["won"]) for r in results}
    assert len(won) == 1, results  # exactly one writer won
    (winner,) = won
    assert winner in {tuple(r["proposal"]) for r in results}
    assert all(tuple(r["again"]) == winner for r in results)  # proposing again: the same list
    for rank, r in enumerate(results):
        if rank in winner:
            assert r["excluded"] is None
        else:
            assert f"rank {rank} is excluded from generation 1" in r["excluded"]
    # the stored list is a signed record: read it as a member does (the launcher's secret)
    assert Membership(pool.store, 0, namespace="agree").members_of(1) == list(winner)


@pytest.mark.timeout(90)
def test_sigstopped_worker_is_excluded_then_regrown(pool):
    ns, victim = "stop", 3
    pool.submit(elastic_jobs.sigstop_shrink_and_regrow, ns, victim)
    pid = pool.processes[victim].pid
    _wait_keys(pool.store, [f"{ns}-ctl/ready/{r}" for r in range(SIZE)], 40)
    time.sleep(0.3)
    stopped_at = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_keys(pool.store, [f"{ns}-ctl/rebuilt/{r}" for r in range(SIZE) if r != victim], 30)
    finally:
        os.kill(pid, signal.SIGCONT)
    results = pool.results_by_rank(timeout=60)
    assert sorted(results) == list(range(SIZE)), results
    assert all(ok for ok, _ in results.values()), results
    out = {rank: value for rank, (ok, value) in results.items()}
    survivors = [r for r in range(SIZE) if r != victim]
    for r in survivors:
        detect, rebuild = out[r]["detected_at"] - stopped_at, out[r]["rebuilt_at"] - stopped_at
        print(
            f"rank {r}: frozen detected after {detect:.2f} s, generation 1 exchanged after {rebuild:.2f} s"
        )
        assert list(out[r]["failures"]) == [str(victim)]
        assert 0.7 < detect < 3.0  # frozen past the 1 s deadline counts as failed
        assert rebuild < 4.0  # far below the old group's 60 s timeout
        assert out[r]["generation1"] == survivors
        ring = survivors[survivors.index(r) - 1]
        assert out[r]["ring1"] == ring  # data crossed the generation-1 group
    assert f"rank {victim} is excluded from generation 1" in out[victim]["excluded"]
    # grow: the victim was re-admitted at generation 2 and received data on the new group
    assert out[victim]["generation"] == 2 and out[victim]["members"] == list(range(SIZE))
    assert out[victim]["received"] == [float(i) for i in range(16)]
    assert all(out[r]["ring2"] == (r - 1) % SIZE for r in range(SIZE))
    # every key is generation-prefixed; no unprefixed heartbeat or member key exists
    store = pool.store
    for key in [
        "gen0/members",
        "gen1/members",
        "gen2/members",
        "gen0/hb/3",
        "gen1/hb/0",
        "gen2/hb/3",
        "gen2/joins",
        "gen2/join/0",
    ]:
        assert store.check([f"{ns}/{key}"]), key
    assert not store.check([f"{ns}/gen1/hb/3"])  # the excluded rank never beat in generation 1
    assert not store.check([f"{ns}/hb/0"]) and not store.check([f"{ns}/members"])
    assert [Membership(store, 0, namespace=ns).members_of(g) for g in range(3)] == [
        list(range(SIZE)),
        survivors,
        list(range(SIZE)),
    ]


@pytest.mark.timeout(90)
@pytest.mark.workers(SIZE, scope="function")  # a pool of its own: it kills a worker
def test_sigkilled_worker_is_detected_and_survivors_rebuild_at_once(pool):
    ns, victim = "kill", 2
    with elastic.ExitWatcher(pool.store, pool.processes, namespace=ns):
        pool.submit(elastic_jobs.sigkill_detect_and_rebuild, ns, victim)
        _wait_keys(pool.store, [f"{ns}-ctl/ready/{r}" for r in range(SIZE)], 40)
        time.sleep(0.3)
        killed_at = time.time()
        os.kill(pool.processes[victim].pid, signal.SIGKILL)
        results = pool.results_by_rank(timeout=40)
        _wait_keys(pool.store, [f"{ns}/gen0/exited/{victim}"], 5)
    survivors = [r for r in range(SIZE) if r != victim]
    assert sorted(results) == survivors, results
    assert all(ok for ok, _ in results.values()), results
    out = {rank: value for rank, (ok, value) in results.items()}
    for r in survivors:
        detect, rebuild = out[r]["detected_at"] - killed_at, out[r]["rebuilt_at"] - killed_at
        print(
            f"rank {r} ({out[r]['source']}): killed detected after {detect:.2f} s, "
            f"generation 1 exchanged after {rebuild:.2f} s (group built in {out[r]['build1']:.2f} s)"
        )
        assert list(out[r]["failures"]) == [str(victim)], out[r]
        assert detect < 2.5
        assert rebuild < 4.0  # far below the old group's 60 s timeout
        assert out[r]["generation1"] == survivors
        assert out[r]["ring1"] == survivors[survivors.index(r) - 1]
    heartbeat_only = out[min(survivors)]
    assert "heartbeat" in heartbeat_only["failures"][str(victim)]
    blocked = out[(victim + 1) % SIZE]
    assert f"from rank {victim}" in blocked["error"]  # the per-operation deadline names the peer
    assert "heartbeat" in blocked["failures"][str(victim)]  # ... and its stopped heartbeat confirms
    # The third survivor watches exit notifications too: whichever of the exit notification
    # and the stopped heartbeat it read first is the machine's timing; the launcher's exit
    # notification is there, and a detector reads it as the failure it is.
    (notified,) = [r for r in survivors if out[r]["source"] == "heartbeat+exit"]
    why = out[notified]["failures"][str(victim)]
    assert why == "its process exited (exit code -9)" or "heartbeat" in why, why
    exits = elastic.FailureDetector(pool.store, 0, [victim], namespace=ns, deadline=10)
    assert exits.poll()[victim] == "its process exited (exit code -9)"


@pytest.mark.timeout(30)
def test_a_heartbeat_stops_when_the_process_serving_its_store_is_gone():
    """A TCPStore client never reconnects: once the process serving the store is gone, every
    beat would fail (and torch logs a warning for each), so the heartbeat thread ends."""
    import subprocess
    import sys

    serve = (
        "import sys, time, datetime, torch.distributed as dist\n"
        "s = dist.TCPStore('127.0.0.1', 0, 1, True, datetime.timedelta(seconds=5), wait_for_workers=False)\n"
        "print(s.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        hb = elastic.Heartbeat("127.0.0.1", port, 3, namespace="gone", interval=0.05)
        time.sleep(0.2)
        assert hb._thread.is_alive() and hb.beats > 1
        server.kill()
        server.wait()
        hb._thread.join(5)
        assert not hb._thread.is_alive()
    finally:
        server.kill()
        server.wait()
