"""The authenticated data plane (issue 24, cases 1-3): real attacker processes, loopback only.

The attacker is a process without the job's secret (tests/data_plane_attacker.py) that can
reach the job's store: it writes its own address under a group's rendezvous prefix and tries
to be built into the group and receive, writes garbage where gloo reads addresses, and
forges heartbeats of a stopped rank. The honest members here are threads of this process,
each with its own store client and gloo group (their warnings are this process's log), and a
live elastic job on the local workers. The oracle is the rule: what the honest members send
is what they receive, the attacker receives nothing, and its writes are logged and ignored.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic import FailureDetector, Heartbeat, Membership
from elastic.auth import JOB_RECORD, JobSecret, RecordSigner, StoreTampered, establish_job
from elastic.commit import CommitRecords
from elastic.groups import authenticated_group, build_group
from elastic.store import serve_store
from layoutlang.errors import MembershipError

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
SECRET = JobSecret.parse("da7a" * 16)


@pytest.fixture
def store():
    return serve_store(timeout=30)


def client(store):
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))


def attack(store, *args: object, timeout: float = 120) -> subprocess.Popen:
    """Start the attacker process (no secret in its environment)."""
    env = {k: v for k, v in os.environ.items() if k != "LAYOUTLANG_JOB_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "data_plane_attacker.py"), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def outcome(process: subprocess.Popen, timeout: float = 120) -> dict:
    """What the attacker says it achieved; a process that died (gloo aborts on a sealed
    address it cannot parse) achieved nothing."""
    out, err = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"received": 0, "died": process.returncode, "stderr": err[-2000:]}


def run_members(store, ranks, build, timeout: float = 60.0):
    """Run ``build(rank, client)`` for each rank in a thread of its own; rank -> result or error."""
    results: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            results[rank] = build(rank, client(store))
        except Exception as err:  # reported to the test
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert all(not t.is_alive() for t in threads), "a member hung"
    return results


PAYLOAD = 0x5A


def exchange(pg, group_rank: int, size: int) -> bool:
    """Group rank 0 sends a payload to every other rank; each checks what it received."""
    if group_rank == 0:
        data = torch.full((1 << 16,), PAYLOAD, dtype=torch.uint8)
        for works in [pg.send([data], r, 0) for r in range(1, size)]:
            works.wait()
        return True
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    pg.recv([buffer], 0, 0).wait()
    return bool((buffer == PAYLOAD).all())


# ------------------------------------------------------------------ the rendezvous


def test_a_process_without_the_secret_is_never_built_into_a_group(store, caplog):
    """The attacker writes its address under the next generation's group prefix first (as
    group rank 2, as the issue's attacker did with ``apply/gen2/pg/0/7``) and waits there to
    receive; garbage sits where rank 1's address goes. The members build their group, the
    forgeries are logged and ignored, every payload arrives, and the attacker gets nothing."""
    members = [0, 1, 2]
    rogue = attack(store, "member", store.port, "job/gen1/pg/0", 2, 3, 20)
    garbage = attack(store, "garbage", store.port, "job/gen1/pg/0/0/1")
    written = outcome(garbage)
    assert written.get("written"), written
    end = time.monotonic() + 30
    while not client(store).check(["job/gen1/pg/0/0/2"]):  # the rogue's address is there first
        assert time.monotonic() < end
        time.sleep(0.05)

    def member(rank: int, own) -> bool:
        if rank == 1:  # the others read rank 1's key while the garbage is still there
            time.sleep(3)
        m = Membership(own, rank, namespace="job", secret=SECRET)
        m.records.job = "job-1"
        m.enter(1, members)
        group = build_group(own, m, timeout=30)
        return exchange(group.pg, group.group_rank, group.size)

    with caplog.at_level(logging.WARNING, logger="elastic"):
        results = run_members(store, members, member)
    assert results == {0: True, 1: True, 2: True}, results
    got = outcome(rogue)
    assert got["received"] == 0, got
    ignored = [r.getMessage() for r in caplog.records if "written without the job's secret" in r.getMessage()]
    # the garbage was read and ignored (the rogue's address was replaced by rank 2's own
    # before anyone read it, or read and ignored the same way)
    assert any("gen1/pg/0/0/1" in m for m in ignored), ignored


def test_a_member_without_the_secret_fails_the_challenge_and_is_named(store):
    """A process that passes the rendezvous (its own signed address, made with another secret
    here, so that gloo connects it) but cannot prove the job's secret: the group is refused
    by every honest member, naming it, and no payload is sent over it."""
    members = [0, 1, 2]
    secrets = {0: SECRET, 1: SECRET, 2: JobSecret.parse("0bad" * 16)}

    def member(rank: int, own) -> object:
        records = RecordSigner(secrets[rank], "job")
        records.job = "job-1"
        # the impostor seals its address with its own secret: the honest ranks wait past it
        return authenticated_group(own, "gen0/pg", records, members, rank, timeout=4)

    results = run_members(store, members, member, timeout=150)
    for rank in (0, 1):
        assert isinstance(results[rank], MembershipError), results
        assert "failed its authentication" in str(results[rank]) or "gave no verdict" in str(results[rank])
        assert "2" in str(results[rank])


# ------------------------------------------------------------------ job and history


def test_a_record_of_another_job_with_the_same_secret_is_refused():
    """Two jobs share one operator secret. Job A's signed member list copied into job B does
    not open there; A's job record copied into B before B starts is refused by name."""
    store_a, store_b = serve_store(timeout=10), serve_store(timeout=10)
    a = Membership(store_a, 0, namespace="job", secret=SECRET)
    establish_job(a.store, a.records, port=store_a.port, create=True)
    b = Membership(store_b, 0, namespace="job", secret=SECRET)
    establish_job(b.store, b.records, port=store_b.port, create=True)
    a.agree(0, [0, 1, 2])
    a.agree(1, [0, 1])  # in job A rank 2 was lost
    b.agree(0, [0, 1, 2])
    client(store_b).set("job/gen1/members", bytes(client(store_a).get("job/gen1/members")))
    assert b.members_of(1) is None and b.records.refused >= 1  # ignored: B's rank 2 stays
    assert b.propose(1, [0, 1, 2]) == [0, 1, 2]

    store_c = serve_store(timeout=10)
    client(store_c).set(f"job/{JOB_RECORD}", bytes(client(store_a).get(f"job/{JOB_RECORD}")))
    c = Membership(store_c, 0, namespace="job", secret=SECRET)
    with pytest.raises(MembershipError, match="made for the store on port"):
        establish_job(c.store, c.records, port=store_c.port, create=True)


def test_a_deleted_record_of_the_committed_history_is_detected_never_decided(store):
    """The issue's attacker deleted ``gen1/commit/1`` and ``gen1/members`` during a recovery;
    the members then decided again from nothing. Now a member that read them stops."""
    m = Membership(store, 0, namespace="job", secret=SECRET)
    establish_job(m.store, m.records, port=store.port, create=True)
    m.agree(0, [0, 1])
    m.agree(1, [0, 1])
    commits = CommitRecords(m, timeout=5)
    commits.decide("commit/1", {"state": "committed", "joiners": []})
    assert commits.read("commit/1") == {"state": "committed", "joiners": []}
    attacker = client(store)
    attacker.delete_key("job/gen1/commit/1")
    with pytest.raises(StoreTampered, match="'job/gen1/commit/1' was deleted"):
        commits.read("commit/1")
    with pytest.raises(StoreTampered):
        commits.abort("commit/1")  # never decided again
    attacker.delete_key("job/gen1/members")
    with pytest.raises(StoreTampered, match="'job/gen1/members' was deleted"):
        m.members_of(1)
    with pytest.raises(StoreTampered):
        m.propose(1, [0])


def test_a_member_with_no_secret_or_another_one_is_refused_and_changes_nothing(store):
    first = Membership(store, 0, namespace="job", secret=SECRET)
    establish_job(first.store, first.records, port=store.port, create=True)
    first.agree(0, [0, 1])
    record = bytes(client(store).get(f"job/{JOB_RECORD}"))
    nobody = Membership(store, 1, namespace="job", secret=None)
    nobody.records.secret = None  # as a process started without LAYOUTLANG_JOB_SECRET
    with pytest.raises(MembershipError, match="this process has none"):
        establish_job(nobody.store, nobody.records, port=store.port, create=True)
    other = Membership(store, 1, namespace="job", secret=JobSecret.parse("07e4" * 16))
    with pytest.raises(MembershipError, match="does not open with this process's job secret"):
        establish_job(other.store, other.records, port=store.port, create=True)
    assert bytes(client(store).get(f"job/{JOB_RECORD}")) == record  # the authentic record is kept
    assert first.members_of(0) == [0, 1]


def test_a_forged_heartbeat_does_not_keep_a_stopped_rank_alive(store):
    """Rank 1 stops beating (its heartbeat thread stopped, as a SIGSTOPped process would);
    the attacker keeps writing advancing heartbeats for it, as counters and as forged seals.
    The detector finds rank 1 failed within its deadlines; rank 0 stays alive."""
    records = RecordSigner(SECRET, "job")
    records.job = "job-1"
    beating = Heartbeat("127.0.0.1", store.port, 0, namespace="job", interval=0.05, records=records)
    stopped = Heartbeat("127.0.0.1", store.port, 1, namespace="job", interval=0.05, records=records)
    stopped.stop()
    forger = attack(store, "heartbeat", store.port, "job/gen0/hb/1", 8)
    try:
        detector = FailureDetector(store, 0, [0, 1], namespace="job", deadline=0.5, records=records)
        failures = detector.wait_for_failure(6)
        assert 1 in failures and 0 not in failures, failures
        assert detector.check([0]) == {}
    finally:
        beating.stop()
        assert outcome(forger)["beats"] > 0


# ------------------------------------------------------------------ a live elastic job

LIVE = """
mesh train [dp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [64, 32] fp32
tensor "b" [32] fp32
layout fsdp on train { default: replicate }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""


@pytest.mark.workers(4, scope="module")  # its workers are respawned without a default group
@pytest.mark.timeout(240)
def test_a_live_elastic_job_recovers_past_a_rogue_at_the_next_generations_rendezvous(pool):
    """``apply --elastic``'s job on 4 workers; rank 3 is SIGKILLed in the middle of step 2,
    so the survivors build generation 1's group of ranks 0, 1, 2. Before that, the attacker
    wrote its own address there as group rank 2 (and waits to receive), garbage where rank
    1's address goes, and keeps forging rank 3's heartbeat. The job ends as it would without
    the attacker: every survivor commits every step in generation 1, every destination byte
    verified; the attacker received nothing."""

    from elastic import ExitWatcher
    from layoutlang.cli.elastic_job import refit_job

    pool.respawn()
    pool.run(os.getpid)
    ns, steps = "rogue", 6
    rogue = attack(pool.store, "member", pool.store.port, f"{ns}/gen1/pg/0", 2, 3, 60)
    garbage = attack(pool.store, "garbage", pool.store.port, f"{ns}/gen1/pg/0/0/1")
    beats = attack(pool.store, "heartbeat", pool.store.port, f"{ns}/gen0/hb/3", 60)
    try:
        with ExitWatcher(pool.store, dict(enumerate(pool.processes)), namespace=ns):
            pool.submit(refit_job, LIVE, steps, namespace=ns, faults=[(3, 2, "kill")], timeout=60.0)
            results: dict[int, dict] = {}
            end = time.monotonic() + 200
            while len(results) < 3 and time.monotonic() < end:
                result = pool.next_result(0.2)
                if result is None:
                    continue
                rank, ok, value = result
                assert ok, f"rank {rank} failed: {value[1]}"
                results[rank] = value
        assert sorted(results) == [0, 1, 2], results
        for out in results.values():
            assert "error" not in out, out
            assert out["members"] == [0, 1, 2] and out["generation"] >= 1, out
            assert [r["step"] for r in out["reports"]] == list(range(steps)), out["reports"]
        checked = results[2]["checked"]
        assert [c["step"] for c in checked] == list(range(steps))
        assert all(c["ok"] and not c["mismatches"] for c in checked), checked
        assert outcome(rogue)["received"] == 0
        assert outcome(garbage)["written"]
    finally:
        beats.kill()
        pool.respawn()
