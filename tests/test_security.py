"""Security by default: issue 14's case 5 ("anyone who can reach the store owns the job").

The attacker is a plain TCPStore client without the job's secret, writing the keys an
elastic job reads. Each attack of the issue is tried against the records directly
(Membership, FailureDetector, CommitRecords over a live store, with heartbeats running):

- a forged member list (and a forged exit notification) would exclude a healthy rank;
- a forged commit record (and a forged count of finished members) would make a step
  committed that a member had not finished;
- a join request written without the secret (as rank 66) would be admitted;

and each must be ignored, while the same operations with the secret work. The oracle is
the rule itself: what the honest members wrote is what they read back. The stores must
listen on loopback only: a connection to the machine's other address is refused, where
torch's own TCPStore server (the oracle that the address is reachable at all) accepts it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic import ExitWatcher, FailureDetector, Heartbeat, MemberFailure, Membership
from elastic.auth import SECRET_ENV, JobSecret, RecordSigner, StoreTampered, resolve_secret
from elastic.commit import COMMITTED, CommitRecords
from elastic.store import serve_store
from layoutlang.errors import MembershipError

pytestmark = pytest.mark.timeout(60)

SECRET = JobSecret.parse("5ec4e7" * 8)


@pytest.fixture
def store():
    return serve_store(timeout=10)


def attacker(store) -> dist.TCPStore:
    """A client of the job's store that knows everything but the secret."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))


# ------------------------------------------------------------------- the records


def test_a_sealed_record_opens_only_under_its_own_key_and_secret():
    records = RecordSigner(SECRET, "job")
    sealed = records.seal("gen1/members", b"[0,1,2]")
    assert records.open("gen1/members", sealed) == b"[0,1,2]"
    assert records.open("gen2/members", sealed) is None  # replayed into another generation
    assert RecordSigner(SECRET, "other").open("gen1/members", sealed) is None  # another namespace
    assert RecordSigner(JobSecret(b"wrong"), "job").open("gen1/members", sealed) is None
    assert records.open("gen1/members", b"[0,1]") is None  # written without any secret
    tampered = sealed[:-2] + b"]]"
    assert records.open("gen1/members", tampered) is None
    assert records.refused == 3  # this signer's: gen2, unsigned, tampered


def test_the_secret_comes_from_the_environment_as_hex_or_text(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "00ff")
    assert resolve_secret(None) == JobSecret(b"\x00\xff")
    monkeypatch.setenv(SECRET_ENV, "correct horse")
    assert resolve_secret(None) == JobSecret(b"correct horse")
    assert "horse" not in repr(resolve_secret(None))
    monkeypatch.delenv(SECRET_ENV)
    assert resolve_secret(None) is None
    assert resolve_secret("00ff") == JobSecret(b"\x00\xff")


# ----------------------------------------------------------- a forged exclusion


def test_a_forged_member_list_excludes_nobody_and_is_replaced(store, caplog):
    m = Membership(store, 0, namespace="job", secret=SECRET)
    other = Membership(store, 2, namespace="job", secret=SECRET)
    m.agree(0, [0, 1, 2])
    forger = attacker(store)
    forger.set("job/gen1/members", b"[0,1]")  # rank 2 "failed", says nobody who knows the secret
    with caplog.at_level(logging.WARNING, logger="elastic.auth"):
        assert m.members_of(1) is None and m.members_of(1) is None  # ignored, as if absent
        assert m.latest() == 0
    warnings = [r for r in caplog.records if "job/gen1/members" in r.getMessage()]
    assert len(warnings) == 1  # one warning per key, however often it is read
    # The honest proposal replaces the forgery; every member reads the honest winner.
    assert other.propose(1, [0, 1, 2]) == [0, 1, 2]
    assert m.members_of(1) == [0, 1, 2] and m.propose(1, [0, 1]) == [0, 1, 2]
    # A forgery written over the agreed list is a tampered store for every member that read
    # the list: they stop, never decide generation 1 again (the attacker can deny service only).
    forger.set("job/gen1/members", b"[0,1]")
    with pytest.raises(StoreTampered, match="'job/gen1/members' was deleted"):
        m.members_of(1)


def test_a_forged_exit_notification_does_not_fail_a_healthy_rank(store):
    signed = RecordSigner(SECRET, "job")  # heartbeats are signed records too
    heartbeats = [Heartbeat("127.0.0.1", store.port, r, namespace="job", interval=0.05, records=signed)
                  for r in (0, 1)]
    try:
        detector = FailureDetector(store, 0, [0, 1], namespace="job", deadline=0.5, secret=SECRET)
        forger = attacker(store)
        forger.set("job/gen0/exited/1", b"exit code -9")
        forger.add("job/gen0/exits", 1)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert detector.poll() == {}, "a forged exit notification failed rank 1"
            time.sleep(0.05)
    finally:
        for hb in heartbeats:
            hb.stop()

    class Exited:  # the launcher's view of a worker that really exited
        exitcode = -9

        def is_alive(self):
            return False

    with ExitWatcher(store, {1: Exited()}, namespace="job", period=0.02, secret=SECRET):
        end = time.monotonic() + 5
        while 1 not in detector.poll() and time.monotonic() < end:
            time.sleep(0.02)
    assert detector.failures[1] == "its process exited (exit code -9)"


# ------------------------------------------------------------- a forged commit


def test_a_forged_commit_record_does_not_commit_a_step(store):
    ranks = (0, 1)
    members = {r: Membership(store, r, namespace="job", secret=SECRET) for r in ranks}
    for m in members.values():
        m.agree(0, ranks)
    commits = {r: CommitRecords(members[r], timeout=1.0) for r in ranks}
    forger = attacker(store)
    forger.set("job/gen0/commit/0", b'{"state": "committed", "joiners": []}')
    forger.add("job/gen0/done/commit/0", 5)  # "every member finished"
    assert commits[0].read("commit/0") is None
    # rank 1 never finished step 0: rank 0's commit must not end committed
    with pytest.raises(MemberFailure):
        commits[0].commit("commit/0", watch=lambda: None)
    assert commits[0].read("commit/0") is None
    # with rank 1 finishing too, the honest record replaces the forgery
    outcome: dict[int, dict] = {}

    def finish(rank: int) -> None:
        outcome[rank] = commits[rank].commit("commit/0", watch=lambda: None)

    threads = [threading.Thread(target=finish, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert outcome[0] == outcome[1] == {"state": COMMITTED, "joiners": []}
    # a forged abort of the next step is ignored too
    forger.set("job/gen0/commit/1", b'{"state": "aborted"}')
    commits[0].open = "commit/1"
    assert not commits[0].open_aborted()


# --------------------------------------------------------------- a forged join


def test_a_join_request_without_the_secret_is_not_admitted(store):
    coordinator = Membership(store, 0, namespace="job", secret=SECRET)
    coordinator.agree(0, [0, 1])
    forger = attacker(store)
    index = forger.add("job/gen1/joins", 1) - 1
    forger.set(f"job/gen1/join/{index}", b"66")  # a plain client asks to join as rank 66
    Membership(store, 67, namespace="job", secret=b"a guess").request_join(1)  # a wrong secret
    assert coordinator.join_requests(1) == []
    Membership(store, 5, namespace="job", secret=SECRET).request_join(1)  # a replacement of the job
    assert coordinator.join_requests(1) == [5]
    # the joiner waits for its generation; a forged one naming it is not one
    forger.set("job/gen1/members", b"[0,1,66]")
    rank66 = Membership(store, 66, namespace="job", secret=b"a guess")
    with pytest.raises(MembershipError, match="not admitted"):
        rank66.wait_until_member(timeout=0.3, start=1)


# ------------------------------------------------------------------ loopback only


def other_address() -> str | None:
    """An address of this machine that is not loopback (None: it has none)."""
    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    return next((a for a in candidates if not a.startswith("127.") and a != "0.0.0.0"), None)


def reachable(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex((address, port)) == 0


def test_the_stores_listen_on_loopback_only(store):
    address = other_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    torch_own = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=5), wait_for_workers=False)
    if not reachable(address, torch_own.port):
        pytest.skip(f"{address} is not reachable from this machine, even for torch's own store")
    assert reachable("127.0.0.1", store.port)
    assert not reachable(address, store.port), f"the store answers on {address}"

    from layoutlang.integrations.refit_session import SessionAddress

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = SessionAddress("127.0.0.1", port).connect(serve=True, timeout=10)  # a trainer's rank 0
    assert reachable("127.0.0.1", served.port) and not reachable(address, served.port)


@pytest.mark.workers(2)
def test_the_launcher_store_is_loopback_and_its_workers_hold_the_secret(pool):
    address = other_address()
    if address is not None:
        assert not reachable(address, pool.store.port), f"the launcher's store answers on {address}"
    assert reachable("127.0.0.1", pool.store.port)
    assert pool.run(os.getenv, SECRET_ENV) == [pool.secret.text()] * 2
    # gloo binds loopback in the workers, unless the operator chose an interface
    assert pool.run(os.getenv, "GLOO_SOCKET_IFNAME") == [os.environ.get("GLOO_SOCKET_IFNAME", "lo")] * 2


# ------------------------------------------------------------- a live elastic job

SMALL = """
mesh train [dp = 2]
mesh infer [dp = 2] on ranks 2..3
tensor "w" [64, 32] fp32
tensor "b" [32] fp32
layout fsdp on train { default: replicate }
layout serve on infer { default: replicate }
reshard refit: fsdp -> serve
"""


@pytest.mark.workers(4)
@pytest.mark.timeout(120)
def test_a_live_elastic_job_ignores_every_forgery(pool):
    """The elastic job of ``apply --elastic`` on 4 workers while a plain client forges the
    exclusion of rank 3 (its exit, the next generation without it), and commits and aborts
    of every step with inflated counts. Before the fix rank 3 was excluded; now every step
    commits in generation 0 on all four ranks, with every destination byte verified."""
    from layoutlang.cli.elastic_job import refit_job

    steps, ns = 40, "live"
    pool.submit(refit_job, SMALL, steps, namespace=ns, deadline=1.0, timeout=30.0)
    forger = attacker(pool.store)
    end = time.monotonic() + 60
    while not forger.check([f"{ns}/gen0/members"]):
        assert time.monotonic() < end, "the job did not start"
        time.sleep(0.01)
    forger.set(f"{ns}/gen1/members", b"[0,1,2]")
    forger.set(f"{ns}/gen0/exited/3", b"exit code -9")
    forger.add(f"{ns}/gen0/exits", 1)
    for step in range(steps):
        state = "aborted" if step % 2 else "committed"
        forger.set(f"{ns}/gen0/commit/{step}", f'{{"state": "{state}", "joiners": []}}'.encode())
        forger.add(f"{ns}/gen0/done/commit/{step}", 10)
    results = pool.results_by_rank(timeout=90)
    assert sorted(results) == [0, 1, 2, 3] and all(ok for ok, _ in results.values()), results
    for rank, (_, out) in results.items():
        assert "error" not in out, out
        assert out["generation"] == 0 and out["members"] == [0, 1, 2, 3], out
        assert out["recoveries"] == [] and [r["step"] for r in out["reports"]] == list(range(steps))
        if rank in (2, 3):  # the destination ranks verified every step's bytes
            assert all(c["ok"] and not c["mismatches"] for c in out["checked"]), out["checked"]
            assert [c["step"] for c in out["checked"]] == list(range(steps))
