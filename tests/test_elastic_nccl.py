"""The NCCL generation backend over the mock fabric: create, shrink, grow, reuse, watch.

One thread per rank and an in-process HashStore stand in for processes and the launcher's
TCPStore; the mock fabric really moves bytes between communicators created from one id,
so layoutlang plans run end to end over each generation's NcclTransport. The mock's call
log shows which NCCL calls each generation made (ncclCommShrink with NCCL_SHRINK_ABORT,
ncclCommGrow with the coordinator's id), and its scripted errors play a dead peer.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import layoutlang
from elastic import Membership, MembershipError, admit
from elastic.nccl_backend import NcclGenerations, NcclGroup
from layoutlang.core import _core
from layoutlang.errors import NcclError, NcclTimeoutError
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder
from layoutlang.transport.nccl import WATCH_SLICE

pytestmark = pytest.mark.timeout(60)

N = _core.nccl
INTERNAL, REMOTE = 3, 6
NS = "job"


# ----------------------------------------------------------------------- helpers


@pytest.fixture
def fabric():
    nccl = N.NcclMock()
    return nccl, N.CudaMock(nccl)


def run_threads(functions, timeout=30.0):
    """Run each function in a thread (one per rank); returns the results, raising the
    first rank's exception if any rank failed."""
    results = [None] * len(functions)
    errors: list[BaseException | None] = [None] * len(functions)

    def target(i):
        try:
            results[i] = functions[i]()
        except BaseException as err:  # reported to the test
            errors[i] = err

    threads = [
        threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(functions))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results, errors


def all_ok(functions, timeout=30.0):
    results, errors = run_threads(functions, timeout)
    for err in errors:
        if err is not None:
            raise err
    return results


def build_all(backend, store, memberships, previous=None, **kwargs):
    """Every given member builds its current generation at once; rank -> group."""
    previous = previous or {}
    ranks = list(memberships)
    groups = all_ok(
        [lambda r=r: backend.build(store, memberships[r], previous.get(r), **kwargs) for r in ranks]
    )
    return dict(zip(ranks, groups))


def enter(store, generation, members, memberships=None):
    """Every member agrees on ``generation`` (new Membership objects unless given)."""
    memberships = (
        memberships
        if memberships is not None
        else {r: Membership(store, r, namespace=NS) for r in members}
    )
    for r in members:
        memberships[r].agree(generation, members)
    return {r: memberships[r] for r in members}


def shrink_calls(nccl):
    return [c for c in nccl.calls if c.startswith("ncclCommShrink")]


def grow_calls(nccl):
    return [c for c in nccl.calls if c.startswith("ncclCommGrow")]


def ring(group, tag=0, watch=None):
    """Every member sends 16 bytes of its job rank to the next member (sorted job ranks)."""
    members, rank = group.members, group.rank
    i = members.index(rank)
    out = torch.full((16,), rank + 1, dtype=torch.uint8)
    into = torch.zeros(16, dtype=torch.uint8)
    group.transport(watch=watch).exchange(
        [(members[(i + 1) % len(members)], out)], [(members[i - 1], into)], tag
    ).wait(10)
    return into.tolist()


def ring_ok(groups):
    got = all_ok([lambda g=g: ring(g) for g in groups.values()])
    for (rank, group), received in zip(groups.items(), got):
        prev = group.members[group.members.index(rank) - 1]
        assert received == [prev + 1] * 16  # byte for byte


def program(train, infer, dp):
    return layoutlang.loads(
        f"""
topology {{ domain_size = 2 }}
mesh train [tp = 2] on ranks {train}
mesh infer [dp = {dp}] on ranks {infer}
tensor "w" [64, 48] bf16
tensor "b" [64] fp32
layout tp on train {{
    "w": tp = shard(0)
    default: replicate
}}
layout dp on infer {{ default: replicate }}
reshard tp -> dp
"""
    )


def reshard(group, prog, watch=None):
    """Run the program's plan over the group's transport; returns this rank's check and report."""
    transport = group.transport(watch=watch)
    resharder = Resharder(prog, rank=group.rank, transport=transport, timeout=20)
    sources = resharder.allocate("source")
    fill_synthetic(resharder.plan.source, group.rank, sources)
    destinations = resharder.run(sources)
    destination = resharder.plan.destination
    check = (
        verify(destination, group.rank, destinations) if group.rank in destination.mesh else None
    )
    return check, resharder.last_report


def reshard_all(groups, prog, watch=None):
    results = all_ok([lambda g=g: reshard(g, prog, watch) for g in groups.values()])
    checks = {r: c for r, (c, _) in zip(groups, results) if c is not None}
    assert checks and all(c.ok for c in checks.values()), {
        r: c.mismatches for r, c in checks.items() if not c.ok
    }
    plan = layoutlang.compile_plan(prog)
    moved = sum(rep.sent["domain"] + rep.sent["network"] for _, rep in results)
    assert moved == plan.stats.bytes["domain"] + plan.stats.bytes["network"] > 0
    return {r: rep for r, (_, rep) in zip(groups, results)}


# -------------------------------------------------------- create, shrink, grow


def test_a_generation_is_created_shrunk_after_a_death_and_grown_by_a_joiner(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)

    # generation 0: four new ranks create one communicator and run a plan over it
    m = enter(store, 0, [0, 1, 2, 3])
    g0 = build_all(backend, store, m)
    assert {g.how for g in g0.values()} == {"create"}
    assert all(g.order == [0, 1, 2, 3] and g.size == 4 for g in g0.values())
    assert [g.communicator.rank for g in g0.values()] == [0, 1, 2, 3]
    assert [c for c in nccl.calls if c.startswith("ncclGetUniqueId")] == ["ncclGetUniqueId()"]
    reshard_all(g0, program("0..1", "2..3", 2), watch=lambda: None)

    # rank 2 dies: its thread stops taking part and the survivors' receives from it fail
    # (the mock's asynchronous ncclRemoteError); the revoke policy keeps them shrinkable
    survivors = [0, 1, 3]
    for r in survivors:
        nccl.fail_async(REMOTE, after_polls=1, rank=g0[r].rank_map()[r])

    def wait_on_dead(r):
        pending = g0[r].transport().exchange([], [(2, torch.zeros(8, dtype=torch.uint8))], 9)
        with pytest.raises(NcclError) as caught:
            pending.wait(5.0)
        return caught.value

    errors = all_ok([lambda r=r: wait_on_dead(r) for r in survivors])
    assert all(e.code == REMOTE and not isinstance(e, NcclTimeoutError) for e in errors)
    assert all("with rank 2 failed" in e.message for e in errors)
    assert {g0[r].communicator.state for r in survivors} == {"revoked"}

    # generation 1: the survivors agree and shrink in abort mode
    nccl.clear_calls()
    m1 = enter(store, 1, survivors, m)
    g1 = build_all(backend, store, m1, previous=g0)
    assert sorted(shrink_calls(nccl)) == [
        f"ncclCommShrink(rank={c}, exclude=[2], flags=NCCL_SHRINK_ABORT)" for c in (0, 1, 3)
    ]
    assert "ncclCommInitRankConfig" not in str(nccl.calls)  # no new communicator from scratch
    assert {g.how for g in g1.values()} == {"shrink"}
    assert all(g.order == survivors and g.rank_map() == {0: 0, 1: 1, 3: 2} for g in g1.values())
    assert [g1[r].communicator.rank for r in survivors] == [0, 1, 2]  # relative order kept
    assert {g0[r].communicator.state for r in survivors} == {"destroyed"}  # parents retired
    reshard_all(g1, program("0..1", "[3]", 1))

    # generation 2: a new process with job rank 2 joins; the survivors grow, it joins last
    nccl.clear_calls()
    joiner = Membership(store, 2, namespace=NS)

    def join():
        joiner.request_join(2)
        joiner.wait_until_member(timeout=10, start=2)
        return backend.build(store, joiner, None)

    def existing(r):
        if r == min(survivors):
            admit(m1[r], survivors, wait_for=[2], timeout=10)
        else:
            m1[r].wait_until_member(timeout=10, start=2)
        return backend.build(store, m1[r], g1[r])

    built = all_ok([join] + [lambda r=r: existing(r) for r in survivors])
    g2 = dict(zip([2, *survivors], built))
    assert g2[2].how == "join" and {g2[r].how for r in survivors} == {"grow"}
    for g in g2.values():
        assert g.generation == 2 and g.members == [0, 1, 2, 3]
        assert g.order == [0, 1, 3, 2]  # the joiner comes after the existing members
        assert g.rank_map() == {0: 0, 1: 1, 3: 2, 2: 3}
        assert g.communicator.rank == g.rank_map()[g.rank] and g.communicator.size == 4
    assert sorted(grow_calls(nccl)) == [
        "ncclCommGrow(rank=0, nranks=4, id=set, newrank=-1)",  # the coordinator (lowest job rank)
        "ncclCommGrow(rank=1, nranks=4, id=null, newrank=-1)",
        "ncclCommGrow(rank=2, nranks=4, id=null, newrank=-1)",
        "ncclCommGrow(rank=new, nranks=4, id=set, newrank=3)",
    ]
    assert [c.split("(")[0] for c in nccl.calls].count("ncclCommGetUniqueId") == 1
    assert not shrink_calls(nccl)  # nobody was gone
    reports = reshard_all(dict(sorted(g2.items())), program("0..1", "2..3", 2))
    assert sum(reports[2].received.values()) > 0  # bytes reached the joiner
    ring_ok(g2)

    # cleanup: the dead rank's communicator is abandoned, the live ones destroyed
    backend.abandon(g0[2])
    for g in g2.values():
        g.communicator.destroy()
    assert nccl.live_comms() == 0


def test_a_generation_with_the_same_members_reuses_a_healthy_communicator(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1, 2])
    g0 = build_all(backend, store, m)
    nccl.clear_calls()
    g1 = build_all(backend, store, enter(store, 1, [0, 1, 2], m), previous=g0)
    assert {g.how for g in g1.values()} == {"reuse"}
    assert all(g1[r].communicator is g0[r].communicator for r in g1)
    assert not [
        c for c in nccl.calls if c.startswith(("ncclCommShrink", "ncclCommGrow", "ncclCommInit"))
    ]
    for g in g0.values():  # the old generation handed its communicator on: abandoning it is a no-op
        backend.abandon(g)
    assert {g.communicator.state for g in g1.values()} == {"ready"}
    assert "ncclCommAbort" not in str(nccl.calls)
    ring_ok(g1)


def test_a_revoked_communicator_is_renewed_by_a_shrink_that_excludes_nobody(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1, 2])
    g0 = build_all(backend, store, m)
    g0[1].communicator.revoke()  # one rank's watch fired; the others are still ready
    nccl.clear_calls()
    g1 = build_all(backend, store, enter(store, 1, [0, 1, 2], m), previous=g0)
    assert {g.how for g in g1.values()} == {"shrink"}  # every member takes the same path
    assert sorted(shrink_calls(nccl)) == [
        f"ncclCommShrink(rank={r}, exclude=[], flags=NCCL_SHRINK_ABORT)" for r in range(3)
    ]
    assert all(g.order == [0, 1, 2] for g in g1.values())
    ring_ok(g1)


def test_an_asynchronous_error_not_yet_seen_also_renews_the_communicator(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1])
    g0 = build_all(backend, store, m)
    nccl.fail_async(REMOTE, rank=1)  # NCCL noticed something on rank 1; nobody asked yet
    assert g0[1].communicator.state == "ready"
    nccl.clear_calls()
    g1 = build_all(backend, store, enter(store, 1, [0, 1], m), previous=g0)
    assert {g.communicator.state for g in g0.values()} == {"aborted"}  # parents retired
    assert {g.how for g in g1.values()} == {"shrink"}
    assert len(shrink_calls(nccl)) == 2
    ring_ok(g1)


def test_a_rank_that_comes_back_with_a_stale_communicator_joins(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1, 2])
    g0 = build_all(backend, store, m)
    g1 = build_all(backend, store, enter(store, 1, [0, 1], m), previous=g0)  # rank 2 excluded
    assert {g.how for g in g1.values()} == {"shrink"}
    stale = g0[2].communicator
    assert stale.state == "ready"  # rank 2 never learnt
    nccl.clear_calls()
    g2 = build_all(
        backend, store, enter(store, 2, [0, 1, 2], m), previous={0: g1[0], 1: g1[1], 2: g0[2]}
    )
    assert (g2[0].how, g2[1].how, g2[2].how) == ("grow", "grow", "join")
    assert stale.state == "aborted"  # the stale communicator is released, not grown
    assert all(g.order == [0, 1, 2] for g in g2.values())
    assert len(grow_calls(nccl)) == 3
    ring_ok(g2)


def test_a_member_that_never_arrives_fails_the_build_within_its_timeout(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1])
    start = time.monotonic()
    with pytest.raises(MembershipError) as caught:
        backend.build(store, m[0], None, timeout=0.3)
    assert time.monotonic() - start < 5
    assert (
        "rank 0: members [1] did not reach the NCCL build of generation 0" in caught.value.message
    )
    assert nccl.live_comms() == 0


# ----------------------------------------------------------------------- errors


def test_an_nccl_error_during_shrink_is_a_membership_error_naming_rank_and_generation(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1, 2])
    g0 = build_all(backend, store, m)
    m1 = enter(store, 1, [0, 1], m)
    nccl.fail("ncclCommShrink", REMOTE, times=2)
    _, errors = run_threads([lambda r=r: backend.build(store, m1[r], g0[r]) for r in (0, 1)])
    for r, err in zip((0, 1), errors):
        assert isinstance(err, MembershipError), err
        message = err.message
        assert message.startswith(
            f"rank {r}: building the NCCL communicator of generation 1 (members [0, 1]) failed"
        )
        assert "ncclCommShrink" in message and "ncclRemoteError" in message  # NCCL's message kept
        assert isinstance(err.__cause__, NcclError) and err.__cause__.code == REMOTE
    assert {g0[r].communicator.state for r in (0, 1)} == {"ready"}  # the parent is left to abandon
    for g in g0.values():
        backend.abandon(g)
    assert nccl.live_comms() == 0


def test_an_nccl_error_during_create_is_a_membership_error(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1])
    nccl.fail("ncclCommInitRankConfig", INTERNAL, times=2)
    _, errors = run_threads([lambda r=r: backend.build(store, m[r], None) for r in (0, 1)])
    for r, err in zip((0, 1), errors):
        assert isinstance(err, MembershipError)
        assert f"rank {r}: building the NCCL communicator of generation 0" in err.message
        assert "ncclCommInitRankConfig" in err.message and "ncclInternalError" in err.message


def test_abandon_never_raises(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    m = enter(store, 0, [0, 1, 2])
    g0 = build_all(backend, store, m)
    g1 = build_all(backend, store, enter(store, 1, [0, 1], m), previous=g0)
    backend.abandon(None)
    nccl.clear_calls()
    backend.abandon(g0[0])  # retired (aborted while idle) by the shrink: nothing to do
    assert g0[0].communicator.state == "aborted" and nccl.calls == []
    nccl.fail("ncclCommAbort", INTERNAL)
    backend.abandon(g1[0])  # NCCL's abort fails: logged, never raised
    assert g1[0].communicator.state == "aborted"
    backend.abandon(g1[0])  # twice is fine
    backend.abandon(g1[1])
    backend.abandon(g0[2])
    assert {g0[2].communicator.state, g1[1].communicator.state} == {"aborted"}
    assert nccl.live_comms() == 1  # only the one whose scripted ncclCommAbort failed


def test_bad_arguments_are_refused(fabric):
    nccl, cuda = fabric
    store = dist.HashStore()
    with pytest.raises(ValueError, match="on_failure"):
        NcclGenerations(on_failure="ignore")
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    with pytest.raises(MembershipError, match="enter a generation"):
        backend.build(store, Membership(store, 0, namespace=NS), None)
    m = enter(store, 0, [0])
    g0 = backend.build(store, m[0], None)
    with pytest.raises(ValueError, match="not an earlier generation"):
        backend.build(store, m[0], g0)  # still generation 0


# ----------------------------------------------------------------------- watch


def _pair(backend, store):
    """Generation 0 of job ranks 5 and 7; rank 7 takes no part after the build."""
    groups = build_all(backend, store, enter(store, 0, [5, 7]))
    return groups[5], groups[7]


def test_a_watch_that_raises_revokes_and_its_error_propagates_unchanged(fabric):
    nccl, cuda = fabric
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    group, _ = _pair(backend, dist.HashStore())
    calls = []

    class MemberFailed(Exception):
        pass

    failure = MemberFailed("rank 9 failed (heartbeat stuck)")

    def watch():
        calls.append(time.monotonic())
        if len(calls) == 3:
            raise failure

    transport = group.transport(watch=watch)
    assert transport.watch is watch and transport.on_failure == "revoke"
    pending = transport.exchange([], [(7, torch.zeros(8, dtype=torch.uint8))], 1)  # 7 never posts
    start = time.monotonic()
    with pytest.raises(MemberFailed) as caught:
        pending.wait(30.0)
    assert caught.value is failure  # the watch's own exception, unchanged
    assert time.monotonic() - start < 3 * WATCH_SLICE + 1.0  # long before the deadline
    assert len(calls) == 3
    assert group.communicator.state == "revoked"
    assert "ncclCommRevoke" in str(nccl.calls)


def test_a_watch_that_never_raises_still_times_out_at_the_deadline(fabric):
    nccl, cuda = fabric
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10, on_failure="abort")
    group, _ = _pair(backend, dist.HashStore())
    calls = []
    pending = group.transport(watch=lambda: calls.append(1)).exchange(
        [], [(7, torch.zeros(8, dtype=torch.uint8))], 1
    )
    start = time.monotonic()
    with pytest.raises(NcclTimeoutError, match=r"did not complete within 0\.3 s"):
        pending.wait(0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert len(calls) >= 2  # called between slices
    assert group.communicator.state == "aborted"  # this backend's policy


def test_without_a_watch_a_wait_times_out_as_before(fabric):
    nccl, cuda = fabric
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    group, _ = _pair(backend, dist.HashStore())
    transport = group.transport()
    assert transport.watch is None
    pending = transport.exchange(
        [(7, torch.ones(8, dtype=torch.uint8))], [(7, torch.zeros(8, dtype=torch.uint8))], 1
    )
    with pytest.raises(NcclTimeoutError) as caught:
        pending.wait(0.1)
    assert caught.value.message.startswith(
        "rank 5: the NCCL exchange with rank 7 did not complete within 0.1 s"
    )
    assert "the communicator was revoked" in caught.value.message
    assert group.communicator.state == "revoked"


def test_a_watched_exchange_that_completes_returns_the_bytes(fabric):
    nccl, cuda = fabric
    backend = NcclGenerations(api=nccl, cuda=cuda, timeout=10)
    a, b = _pair(backend, dist.HashStore())
    assert isinstance(a, NcclGroup) and a.rank_map() == {5: 0, 7: 1}
    calls = []

    def late_sender():
        time.sleep(3 * WATCH_SLICE)  # a few slices pass before the bytes arrive
        b.transport().exchange([(5, torch.arange(8, dtype=torch.uint8))], [], 1).wait(5)

    into = torch.zeros(8, dtype=torch.uint8)
    pending = a.transport(watch=lambda: calls.append(1)).exchange([], [(7, into)], 1)
    thread = threading.Thread(target=late_sender, daemon=True)
    thread.start()
    pending.wait(10.0)
    thread.join(5)
    assert into.tolist() == list(range(8)) and calls
    assert a.communicator.state == "ready"
