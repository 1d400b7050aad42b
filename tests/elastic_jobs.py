"""Jobs the elastic membership tests run on every worker of a LocalWorkers pool.

Times are ``time.time()`` stamps (one machine: comparable with the parent's), so the test
measures from the moment the parent stopped or killed a worker. Test-control keys live
under ``{namespace}-ctl``, apart from the elastic group's generation-prefixed keys.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from elastic import (
    ExcludedError,
    Heartbeat,
    Membership,
    abandon,
    admit,
    build_group,
    failed_peers,
)
from layoutlang.cli.launch import worker_context
from layoutlang.errors import ExecutionError


def _context():
    return (
        worker_context["rank"],
        worker_context["size"],
        worker_context["port"],
        worker_context["store"],
    )


def _ctl(store, namespace):
    return dist.PrefixStore(f"{namespace}-ctl", store)


def _barrier(ctl, name, count, timeout=30.0):
    ctl.add(name, 1)
    end = time.monotonic() + timeout
    while int(ctl.add(name, 0)) < count:
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {name} not reached by {count} workers within {timeout} s")
        time.sleep(0.01)


def _rebuild_without(failures, m, hb, store, g0, out):
    """Survivors agree on generation 1 without ``failures``, build its group, pass a ring
    over it, and drop the dead generation-0 group; times go into ``out``."""
    out.update(detected_at=time.time(), failures={str(k): v for k, v in failures.items()})
    m.agree(1, [r for r in m.members if r not in failures])
    hb.set_generation(1)
    g1 = build_group(store, m, timeout=20)
    out.update(generation1=m.members, ring1=_ring(g1, 2), rebuilt_at=time.time(), build1=g1.build_seconds)
    abandon(g0)


def _ring(group, tag, timeout=10.0):
    """Every member sends its job rank to the next member and receives from the previous."""
    members, rank = group.members, group.rank
    i = members.index(rank)
    nxt, prev = members[(i + 1) % len(members)], members[i - 1]
    send = torch.full((8,), float(rank))
    recv = torch.full((8,), -1.0)
    group.transport().exchange([(nxt, send)], [(prev, recv)], tag).wait(timeout)
    return int(recv[0].item()) if bool((recv == recv[0]).all()) else None


def agree_concurrently(namespace):
    """Every rank proposes generation 1 at once, each leaving out another rank."""
    rank, size, _, store = _context()
    m = Membership(store, rank, namespace=namespace)
    m.agree(0, range(size))
    proposal = [r for r in range(size) if r != (rank + 1) % size]
    _barrier(_ctl(store, namespace), "go", size)
    won = m.propose(1, proposal)
    again = m.propose(1, range(size))  # idempotent: the winner stays
    try:
        m.enter(1, won)
        excluded = None
    except ExcludedError as err:
        excluded = str(err)
    return {"proposal": proposal, "won": won, "again": again, "excluded": excluded}


def sigstop_shrink_and_regrow(namespace, victim, deadline=1.0):
    """Generation 0: everyone. The parent SIGSTOPs ``victim``; the survivors exclude it
    (generation 1), build the new group and exchange over it. After SIGCONT the victim
    learns it is excluded, asks to join, and the coordinator admits it (generation 2)."""
    rank, size, port, store = _context()
    ctl = _ctl(store, namespace)
    hb = Heartbeat("127.0.0.1", port, rank, namespace=namespace)
    m = Membership(store, rank, namespace=namespace, deadline=deadline)
    try:
        m.agree(0, range(size))
        g0 = build_group(store, m, timeout=20)
        out = {"ring0": _ring(g0, 1)}
        ctl.set(f"ready/{rank}", b"1")
        if rank == victim:
            try:
                m.enter(1, m.wait_for(1, timeout=40))
                out["excluded"] = None
            except ExcludedError as err:
                out["excluded"] = str(err)
            abandon(g0)
            m.request_join(2)
            g, members = m.wait_until_member(timeout=30, start=2)
            hb.set_generation(g)
            g2 = build_group(store, m, timeout=20)
            got = torch.zeros(16)
            g2.transport().exchange([], [(min(members), got)], 7).wait(10)
            out.update(generation=g, members=members, received=got.tolist(), ring2=_ring(g2, 8))
            return out
        detector = m.detector(0)
        failures = detector.wait_for_failure(timeout=20)
        _rebuild_without(failures, m, hb, store, g0, out)
        ctl.set(f"rebuilt/{rank}", b"1")
        # grow: the coordinator (lowest survivor) admits the victim into generation 2
        if rank == min(m.members):
            admit(m, m.members, wait_for=[victim], timeout=40)
        else:
            m.wait_until_member(timeout=40, start=2)
        hb.set_generation(2)
        g2 = build_group(store, m, timeout=20)
        if rank == min(m.members):
            g2.transport().exchange([(victim, torch.arange(16, dtype=torch.float32))], [], 7).wait(
                10
            )
        out.update(generation=m.generation, members=m.members, ring2=_ring(g2, 8))
        return out
    finally:
        hb.stop()


def sigkill_detect_and_rebuild(namespace, victim, deadline=1.0):
    """The parent SIGKILLs ``victim``. Rank ``(victim+1) % size`` is blocked in a receive from
    it (per-operation deadline, then a heartbeat check of that peer), the lowest survivor
    watches heartbeats only, the remaining one heartbeats and exit notifications; then the
    survivors build generation 1 and exchange."""
    rank, size, port, store = _context()
    hb = Heartbeat("127.0.0.1", port, rank, namespace=namespace)
    m = Membership(store, rank, namespace=namespace, deadline=deadline)
    try:
        m.agree(0, range(size))
        g0 = build_group(store, m, timeout=20)
        out = {"ring0": _ring(g0, 1)}
        _ctl(store, namespace).set(f"ready/{rank}", b"1")
        if rank == victim:
            time.sleep(60)  # killed here
            return out
        survivors_min = min(r for r in range(size) if r != victim)
        blocked = (victim + 1) % size
        detector = m.detector(0, use_exits=rank not in (survivors_min, blocked))
        if rank == blocked:
            out["source"] = "operation"
            try:
                g0.transport().exchange([], [(victim, torch.zeros(8))], 3).wait(10)
                failures = {}
            except ExecutionError as err:
                out["error"] = str(err)
                failures = failed_peers(err, detector)
        else:
            out["source"] = "heartbeat" if rank == survivors_min else "heartbeat+exit"
            failures = detector.wait_for_failure(timeout=20)
        _rebuild_without(failures, m, hb, store, g0, out)
        return out
    finally:
        hb.stop()


def stall_job(text, steps, *, namespace, stalled, stall_step, deadline=1.0, timeout=40.0):
    """Refit ``steps`` steps of an elastic session; rank ``stalled`` SIGSTOPs itself halfway
    through the transfer of step ``stall_step`` (the parent continues it: an overloaded host),
    after writing ``time.time()`` under ``stalled`` in the test-control keys. Returns each
    step's time, whether every destination byte of every step verified, and what the
    failure detector holds at the end."""
    import os
    import signal

    import layoutlang
    from elastic import ElasticSession
    from layoutlang.cli.elastic_job import synthetic_sources
    from layoutlang.io.weights import verify

    rank, _, port, store = _context()
    ctl = _ctl(store, namespace)

    def progress(step, done, total):
        if rank == stalled and step == stall_step and done == max(1, total // 2):
            ctl.set("stalled", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)

    program = layoutlang.loads(text)
    seconds, verified = [], []
    with ElasticSession(
        program, rank=rank, store=store, port=port, namespace=namespace, deadline=deadline, timeout=timeout
    ) as session:
        for step in range(steps):
            start = time.perf_counter()
            session.refit(step, synthetic_sources, progress=progress)
            seconds.append(time.perf_counter() - start)
            if rank in session.destination.mesh:
                verified.append(verify(session.destination, rank, session.destinations, version=step).ok)
        return {
            "rank": rank,
            "seconds": seconds,
            "verified": verified,
            "generation": session.generation,
            "members": session.members,
            "rechecks": session.rechecks,
            "suspected": {str(r): why for r, why in session.suspected.items()},
        }


def cast_sources_job(text, *, namespace, cast_sources, timeout=40.0):
    """One refit of a bf16 program from fp32 sources (master weights): with
    ``cast_sources`` the destinations must hold exactly ``source.to(bfloat16)``; without, the
    session refuses the sources before a byte moves. Returns the outcome per rank."""
    import layoutlang
    from elastic import ElasticSession
    from layoutlang.errors import RuntimeFailure

    rank, _, port, store = _context()
    program = layoutlang.loads(text)
    if not any(rank in layout.mesh for layout in program.layouts.values()):
        return {"rank": rank, "error": None, "idle": True}
    generator = torch.Generator().manual_seed(7)
    masters = {n: torch.randn(t.shape, generator=generator, dtype=torch.float32) for n, t in program.tensors.items()}

    def sources(step, session):
        layout = session.source
        return {name: masters[name][layout.boxes(name, rank)[0].slices()].contiguous()
                for name in layout.storages_on(rank)}

    with ElasticSession(program, rank=rank, store=store, port=port, namespace=namespace, timeout=timeout,
                        cast_sources=cast_sources) as session:
        try:
            session.refit(0, sources)
        except RuntimeFailure as err:
            return {"rank": rank, "error": err.message}
        if rank not in session.destination.mesh:
            return {"rank": rank, "error": None}
        layout = session.destination
        exact = all(
            torch.equal(session.destinations[name], masters[name][box.slices()].to(torch.bfloat16))
            for name in layout.storages_on(rank)
            for box in layout.boxes(name, rank)
        )
        return {"rank": rank, "error": None, "exact": exact}
