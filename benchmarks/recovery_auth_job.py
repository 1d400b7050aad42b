"""The part of bench_recovery.py that runs in the pool's workers for the ``auth`` path: the
group a recovery builds (a generation's gloo group of the survivors), built with the data
plane's authentication (signed rendezvous, the challenge over every pair, signed verdicts)
and without it, alternately, the same members and the same store."""

from __future__ import annotations

import time
from typing import Any


def build_groups(namespace: str, members: list[int], rounds: int, timeout: float = 60.0) -> dict[str, Any]:
    """Build ``rounds`` groups of ``members`` each way on this worker; seconds per build, per way.

    Every build starts at a store barrier of the members (so a slow arrival is not timed),
    and the ways alternate (on, off, off, on, ...). "off" is a signer without a secret: the
    group is built as before the data plane was authenticated, for this comparison only."""
    from elastic.auth import RecordSigner
    from elastic.groups import authenticated_group
    from layoutlang.cli.launch import worker_context

    rank, store = worker_context["rank"], worker_context["store"]
    if rank not in members:
        return {"rank": rank, "idle": True}
    on = RecordSigner(None, namespace)  # the job's secret, from the launcher
    on.job = f"{namespace}-job"
    off = RecordSigner(None, namespace)
    off.secret = None
    times: dict[str, list[float]] = {"on": [], "off": []}
    groups = []  # kept until the end: a group given up while a peer still builds it fails that peer
    for i in range(rounds):
        ways = [("on", on), ("off", off)] if i % 2 == 0 else [("off", off), ("on", on)]
        for way, records in ways:
            barrier = f"{namespace}/barrier/{i}/{way}"
            store.add(barrier, 1)
            end = time.monotonic() + timeout
            while int(store.add(barrier, 0)) < len(members) and time.monotonic() < end:
                time.sleep(0.0005)
            start = time.perf_counter()
            pg = authenticated_group(store, f"{namespace}/{i}/{way}", records, members, rank, timeout=timeout)
            times[way].append(time.perf_counter() - start)
            groups.append(pg)
    return {"rank": rank, "times": times}
