"""What every worker pool of layoutlang shares, whoever starts its workers.

A pool (the local processes of :class:`layoutlang.cli.launch.LocalWorkers`, the Ray actors
of :class:`layoutlang.integrations.ray.RayWorkers`) runs one task on all its ranks at once:
a module-level function and its arguments. This module holds the contract they share, so
that ``layoutlang apply`` reads their failures alike:

- :class:`WorkerError`: a task that failed on a rank, a worker that died or hung;
- :data:`worker_context`: what a task may read about its worker (rank, size, store);
- :func:`task_report`: how a worker packs a task's result or failure for its pool;
- :func:`first_failure`: which failure of several ranks a pool reports;
- :func:`init_default_group`: the workers' default gloo group, signed with the job's secret.
"""

from __future__ import annotations

import contextlib
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from elastic.auth import RecordSigner

from .._text import rank_ranges
from ..errors import ExitCode, LayoutError, RuntimeFailure

__all__ = [
    "CONNECTED_KEY",
    "FAILURE_GRACE",
    "READY_KEY",
    "WorkerError",
    "collect_results",
    "first_failure",
    "init_default_group",
    "loopback_interface",
    "task_report",
    "worker_context",
]

#: How long the other workers may take to report once one has failed (seconds; their
#: timeout + 5 s when that is shorter). Failures found before a byte moves stop every rank in
#: one agreement, and each rank reports within a second of the first; the rest covers a
#: loaded machine (16 workers on 2 cores). A worker silent past it is stopped or hung.
FAILURE_GRACE = 8.0

#: Counters in the job's store that a launcher's progress display reads
#: (:mod:`layoutlang.cli.apply_progress`): workers connected to the store, and workers whose
#: default group is built (:func:`init_default_group`). One ``add`` per worker each.
CONNECTED_KEY = "layoutlang/workers/connected"
READY_KEY = "layoutlang/workers/ready"


class WorkerError(RuntimeError):
    """A task failed on a worker (or a worker died or hung); the message names the rank.

    ``kind`` is the error's kind when the task failed on a user's mistake (a
    :class:`~layoutlang.errors.LayoutError`: a bad program, storage or checkpoint) or on a
    failure at run time (a :class:`~layoutlang.errors.RuntimeFailure`: a peer that died or
    hung, an agreement that failed); ``died`` for a worker that exited (its exit code, or the
    signal that killed it), ``hung`` for workers that did not finish in time, ``internal`` for
    anything else. Once a worker has failed, the others get a short grace
    (:data:`FAILURE_GRACE`, or their timeout + 5 s when that is shorter): the failure is then
    reported with the workers that never answered (stopped or hung, and killed), so a
    stopped peer ends a plain ``apply`` one timeout and a few seconds after it stopped,
    whatever ``--repeat`` says. ``exit_code`` says who must
    act (:class:`~layoutlang.errors.ExitCode`); ``message`` is the worker's error text
    without the rank prefix.
    """

    def __init__(self, text: str, kind: str = "internal", message: str = "", exit_code: int = ExitCode.INTERNAL):
        super().__init__(text)
        self.kind = kind
        self.message = message or text
        self.exit_code = ExitCode(exit_code)


#: set in each worker: its rank, the world size and the store (and its port, for local workers)
worker_context: dict[str, Any] = {}

#: a failed task as a worker reports it: (error class name, message, kind, exit code)
Failure = tuple[str, str, str, int]


def task_report(
    rank: int, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> tuple[int, bool, Any]:
    """Run one task on this worker: ``(rank, True, result)``, or ``(rank, False, failure)``
    with the failure as :data:`Failure` (a user's mistake and a failure at run time keep
    their kind and exit code; anything else is internal, with its traceback)."""
    try:
        return (rank, True, fn(*args, **kwargs))
    except (LayoutError, RuntimeFailure) as err:
        return (rank, False, (type(err).__name__, str(err), err.kind, int(err.exit_code)))
    except BaseException as err:  # report everything: the pool decides what it means
        text = f"{err}\n{traceback.format_exc()}"
        return (rank, False, (type(err).__name__, text, "internal", int(ExitCode.INTERNAL)))


def unsendable(err: BaseException) -> Failure:
    """The failure reported for a task whose result cannot be sent to the pool."""
    return (type(err).__name__, f"the task's result cannot be sent to the launcher: {err}", "internal",
            int(ExitCode.INTERNAL))


#: what a result that cannot be pickled raises
UNSENDABLE = (TypeError, AttributeError, pickle.PicklingError)


def first_failure(results: Mapping[int, tuple[bool, Any]], silent: Sequence[int], grace: float) -> WorkerError | None:
    """The error a pool raises for a task that failed on some ranks (None when none failed).

    A user's mistake is preferred over the runtime failures it caused on other ranks, and
    both over a bug: BAD_INPUT (2), then FAILURE (1), then INTERNAL (3). ``silent`` are the
    ranks that did not answer within ``grace`` seconds of the failure (the pool kills them).
    """
    failed = sorted(r for r, (ok, _) in results.items() if not ok)
    if not failed:
        return None
    order = {ExitCode.BAD_INPUT: 0, ExitCode.FAILURE: 1}
    first = min(failed, key=lambda r: (order.get(results[r][1][3], 2), r))
    name, message, kind, exit_code = results[first][1]
    note = ""
    if silent:
        one = len(silent) == 1
        note = (
            f"; {'worker' if one else 'workers'} {rank_ranges(silent)} did not answer within "
            f"{grace:g} s of it (stopped or hung) and {'was' if one else 'were'} killed"
        )
    return WorkerError(f"rank {first}: {name}: {message}{note}", kind, message + note, exit_code)


def collect_results(
    size: int,
    *,
    deadline: float,
    grace: float,
    next_result: Callable[[], tuple[int, bool, Any] | None],
    dead: Callable[[Mapping[int, Any]], tuple[int, str] | None],
    stop_silent: Callable[[list[int]], None],
    abandon: Callable[[], None] = lambda: None,
) -> list[Any]:
    """Every worker's result of one task, by rank: the loop both pools share.

    ``next_result()`` gives the next (rank, ok, value) or None; ``dead(results)`` a worker
    that died before reporting, as (rank, how), or None. Once a worker has failed, the others
    get ``grace`` seconds to report (a failure found before a byte moves stops every rank at
    once); the silent ones are then handed to ``stop_silent`` (a late result of theirs would
    be taken for the next task's) and the first failure is raised (:func:`first_failure`).
    A death, or the ``deadline`` (``time.monotonic()``) passing, raises at once after
    ``abandon()``."""
    results: dict[int, tuple[bool, Any]] = {}
    grace_until: float | None = None
    while len(results) < size:
        result = next_result()
        if result is not None:
            rank, ok, value = result
            results[rank] = (ok, value)
            if not ok and grace_until is None:
                grace_until = min(deadline, time.monotonic() + grace)
            continue
        died = dead(results)
        if died is not None:
            abandon()
            text = f"worker rank {died[0]} died ({died[1]})"
            raise WorkerError(text, "died", f"error: {text}", ExitCode.FAILURE)
        now = time.monotonic()
        if grace_until is not None and now > grace_until:
            break  # the failure is reported below, with the workers that never answered
        if now > deadline:
            abandon()
            text = f"workers {sorted(set(range(size)) - set(results))} did not finish in time"
            raise WorkerError(text, "hung", f"error: {text}", ExitCode.FAILURE)
    silent = sorted(set(range(size)) - set(results))
    failure = first_failure(results, silent, grace)
    if failure is not None:
        if silent:
            stop_silent(silent)
        raise failure
    return [results[r][1] for r in range(size)]


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux), or None when there is none."""
    with contextlib.suppress(OSError):
        for _, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo0"):
                return name
    return None


def init_default_group(store: Any, prefix: str, rank: int, size: int, timeout: float, secret: str | None) -> None:
    """The workers' default gloo group under ``prefix`` (each start of a pool's workers has
    its own). With the job's secret its rendezvous is signed and every worker proves it holds
    the secret before the group is used (:func:`elastic.groups.prove_group`): a process
    without it is never one of the pool's ranks."""
    # torch loads only in the workers: a pool's launcher, and the commands that import this
    # module, start without it
    import torch.distributed as dist

    # elastic.groups imports torch: only the worker (not the launcher's command) needs it
    from elastic.groups import SignedRendezvous, keep_store, prove_group

    records = RecordSigner(secret, prefix)
    rendezvous: Any = dist.PrefixStore(prefix, store)
    if records.authenticated:
        rendezvous = SignedRendezvous(store, prefix, records, timeout=timeout)
        keep_store(rendezvous)  # every later group of the workers (new_group) is built on it
    dist.init_process_group("gloo", store=rendezvous, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
    if records.authenticated:
        group = dist.distributed_c10d._get_default_group()
        prove_group(group, store, records, f"{prefix}/proof", range(size), rank, timeout=timeout,
                    what="the workers' default group")
    with contextlib.suppress(Exception):  # only a display reads it: never a reason to fail
        store.add(READY_KEY, 1)
