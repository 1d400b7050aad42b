"""Local worker processes joined in one gloo group: what ``layoutlang apply`` starts when it
is not launched by torchrun, and what the tests use.

The parent process hosts the TCPStore (so the store outlives any worker) and hands tasks to
every worker: a module-level function and its arguments, run on all ranks at once. A pool
is kept for many tasks, since each worker pays about 1.7 s to import torch.

Security by default: the store listens on loopback only (torch's TCPStore server binds every
interface whatever host it is given, so the launcher binds the socket itself and hands it
over), the workers' gloo groups bind loopback (``GLOO_SOCKET_IFNAME=lo`` unless set), and
the job has a secret (the operator's ``LAYOUTLANG_JOB_SECRET``, or one generated here)
that each worker is handed when it starts and keeps in its environment, never through the
store (:mod:`elastic.auth`).

A worker never outlives its launcher: a watch thread in every worker sees the launcher go
(its parent process changes) and ends the worker within a second, idle or in the middle of
an exchange, with one line on stderr naming its rank and the launcher's pid.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from elastic.auth import SECRET_ENV, JobSecret, remember
from elastic.store import serve_store

from ..integrations.workers import (
    CONNECTED_KEY,
    FAILURE_GRACE,
    UNSENDABLE,
    WorkerError,
    collect_results,
    init_default_group,
    loopback_interface,
    task_report,
    unsendable,
    worker_context,
)

__all__ = ["FAILURE_GRACE", "LAUNCHER_GONE", "LocalWorkers", "WorkerError", "watch_launcher", "worker_context"]

#: The exit status of a worker that lost its launcher.
LAUNCHER_GONE = 75
#: How often a worker looks for its launcher (seconds).
WATCH_PERIOD = 0.25
def watch_launcher(launcher: int, rank: int, period: float = WATCH_PERIOD) -> threading.Thread:
    """End this worker when its launcher (its parent, pid ``launcher``) is gone.

    A daemon thread compares ``os.getppid()`` with ``launcher`` every ``period`` seconds: an
    orphan is adopted by another process (init, or a subreaper), so its parent changes. The
    thread then writes one line on stderr and ends the process with ``os._exit`` (whatever
    the main thread is doing: waiting for a task, or blocked in an exchange with a peer).
    Polling, not ``PR_SET_PDEATHSIG``: that signal follows the launcher's *thread* that
    started the worker, and a launcher may start workers from a thread that ends first.
    """

    def run() -> None:
        while os.getppid() == launcher:
            time.sleep(period)
        with contextlib.suppress(OSError, ValueError):
            print(
                f"layoutlang worker rank {rank}: the launcher (pid {launcher}) is gone; exiting",
                file=sys.stderr,
                flush=True,
            )
        os._exit(LAUNCHER_GONE)

    thread = threading.Thread(target=run, name=f"layoutlang-launcher-watch-{rank}", daemon=True)
    thread.start()
    return thread


def _worker_main(
    rank: int,
    size: int,
    port: int,
    timeout: float,
    tasks,
    results,
    default_group: bool = True,
    launcher: int | None = None,
    secret: str | None = None,
    prefix: str = "layoutlang",
) -> None:
    if launcher is not None:
        watch_launcher(launcher, rank)
    if secret is not None:  # what elastic sessions (and anything this worker starts) read
        os.environ[SECRET_ENV] = secret
    # Gloo binds the address the host name resolves to unless told otherwise: these workers
    # talk only to each other, so they bind loopback (an operator's choice is kept).
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)

    import torch
    import torch.distributed as dist

    # Several workers share this machine's cores: one intra-op thread each, as torchrun does.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False, timeout=timedelta(seconds=timeout))
    with contextlib.suppress(RuntimeError):  # for the launcher's progress display only
        store.add(CONNECTED_KEY, 1)
    if default_group:  # a respawned worker cannot rejoin the first one: its peers built it long ago
        try:
            init_default_group(store, prefix, rank, size, timeout, secret)
        except RuntimeError:
            _await_watch(launcher)  # the store went with the launcher: its watch ends this worker
            raise
    worker_context.update(rank=rank, size=size, port=port, store=store)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        report = task_report(rank, fn, args, kwargs)
        try:
            results.send(report)
        except OSError:  # the pipe's reader is gone (BrokenPipeError): so is the launcher
            _await_watch(launcher)
            raise
        except UNSENDABLE as err:  # a result the parent cannot receive
            results.send((rank, False, unsendable(err)))
    if default_group:
        dist.destroy_process_group()


def _await_watch(launcher: int | None) -> None:
    """When the launcher is gone (its store, its end of a pipe), give its watch
    (:func:`watch_launcher`) the time to end this worker with its message, before the error
    that found it does."""
    if launcher is None:
        return
    end = time.monotonic() + 4 * WATCH_PERIOD
    while time.monotonic() < end:
        time.sleep(WATCH_PERIOD / 4)


def _receive(reader: Any) -> tuple[int, bool, Any] | None:
    """A worker's next result from its pipe; None (and the pipe closed) when the worker died,
    maybe in the middle of writing one."""
    try:
        return reader.recv()
    except (EOFError, OSError):
        reader.close()
        return None


def _exit_text(code: int | None) -> str:
    """How a worker process ended: its exit code, or the signal that killed it."""
    import signal

    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class LocalWorkers:
    """``size`` worker processes on this machine, ranks 0..size-1 of one gloo group.

    The store listens on 127.0.0.1 only. ``secret`` is the job's secret; by default the
    operator's ``LAYOUTLANG_JOB_SECRET``, else a fresh one. Each worker is handed it at its
    start (a process argument, never the store) and sets ``LAYOUTLANG_JOB_SECRET`` in its
    own environment; this process remembers it for :attr:`store`
    (:func:`elastic.auth.remember`), so an :class:`~elastic.ExitWatcher` on that store signs
    with it. Every worker ends within about a second if this process dies
    (:func:`watch_launcher`).

    ``grace`` is how long :meth:`collect` waits for the other workers once one has failed
    (at most their ``timeout`` + 5 s). Workers still silent then are killed, and the pool
    starts all its workers afresh (a new process group) before its next task: a worker
    killed in the middle of a task leaves its peers' group without it.
    """

    def __init__(
        self,
        size: int,
        *,
        timeout: float = 120.0,
        start_timeout: float = 180.0,
        secret: JobSecret | None = None,
        grace: float = FAILURE_GRACE,
    ):

        self.size = size
        self.timeout = timeout
        self.grace = min(grace, timeout + 5)
        self.secret: JobSecret = secret or JobSecret.from_environment() or JobSecret.generate()
        self.store = serve_store("127.0.0.1", 0, size + 1, timeout=start_timeout)
        remember(self.store, self.secret)
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers, read at their start
        self._ctx = mp.get_context("spawn")
        self._starts = 0  # how many times the whole pool was started: its group's store prefix
        self._results: list[Any] = [None] * size  # each worker's pipe of results (the reading end)
        self._writers: dict[int, Any] = {}  # writing ends not yet handed to a started worker
        self._stale = False  # workers were killed mid-task: start afresh before the next task
        self._start_all()

    def _start_all(self) -> None:
        """Start ``size`` workers that build one process group together, on fresh queues and pipes."""
        self._tasks = [self._ctx.SimpleQueue() for _ in range(self.size)]
        prefix = "layoutlang" if self._starts == 0 else f"layoutlang/start{self._starts}"
        self._starts += 1
        self.processes = [self._spawn(rank, prefix) for rank in range(self.size)]
        for rank in range(self.size):
            self._start(rank)

    def _start(self, rank: int) -> None:
        """Start the process of worker ``rank``; only the worker keeps the writing end of its pipe,
        so that its death ends the pipe (the reader sees the end rather than waiting on it)."""
        self.processes[rank].start()
        self._writers.pop(rank).close()

    def _spawn(self, rank: int, prefix: str | None) -> Any:
        """The process of worker ``rank`` (not started), with a fresh pipe for its results;
        ``prefix`` None: no default group.

        Each worker reports on a pipe of its own, never on one queue they all share: a worker
        killed while it held a shared queue's lock would silence every other worker."""
        reader, writer = self._ctx.Pipe(duplex=False)
        if self._results[rank] is not None:
            self._results[rank].close()
        self._results[rank] = reader
        self._writers[rank] = writer
        return self._ctx.Process(
            target=_worker_main,
            args=(
                rank,
                self.size,
                self.store.port,
                self.timeout,
                self._tasks[rank],
                writer,
                prefix is not None,
                os.getpid(),
                self.secret.text(),
                prefix or "layoutlang",
            ),
            daemon=True,
            name=f"layoutlang-worker-{rank}",
        )

    def _restart(self) -> None:
        """Replace every worker by a fresh one, in a fresh process group: after workers were
        killed in the middle of a task, the survivors' group misses them (and a killed worker
        may have left its pipe with half a result in it)."""
        for p in self.processes:
            if p.is_alive():
                p.kill()  # idle, or finished with a failure: nothing of theirs is lost
        for p in self.processes:
            p.join(timeout=10)
        self._start_all()
        self._stale = False

    def respawn(self, ranks=None) -> list[int]:
        """Replace dead (or stopped: they are killed first) workers by fresh processes with
        the same ranks; returns the ranks replaced. A respawned worker has the store but no
        default process group (its peers built that at the start): elastic jobs need none."""
        import signal

        ranks = [r for r in range(self.size) if not self.processes[r].is_alive()] if ranks is None else list(ranks)
        for rank in ranks:
            old = self.processes[rank]
            if old.is_alive():
                os.kill(old.pid, signal.SIGKILL)
                old.join(timeout=10)
            self._tasks[rank] = self._ctx.SimpleQueue()
            self.processes[rank] = self._spawn(rank, None)
            self._start(rank)
        return ranks

    def kill(self, rank: int) -> None:
        """End worker ``rank`` at once with SIGKILL (a stopped one too: after an elastic job)."""
        import signal

        process = self.processes[rank]
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker; returns the results by rank.

        Raises WorkerError naming the first failing rank (its LayoutError message, or the
        traceback of anything else), or a worker that died.
        """
        self.submit(fn, *args, **kwargs)
        return self.collect(timeout)

    def collect(self, timeout: float | None = None) -> list[Any]:
        """Every worker's result, by rank; raises :class:`WorkerError` for the first failure.

        Once a worker has failed, the others get :attr:`grace` seconds to report (a failure
        found before a byte moves stops every rank at once; a rank waiting on the failed one
        would wait its whole timeout) rather than the whole task's deadline: a worker that is
        stopped (SIGSTOP, an overloaded host) or blocked never answers, and the job must end
        with the failure, naming it. The silent workers are killed, and the next task starts
        every worker afresh.
        """
        def dead(results: Mapping[int, Any]) -> tuple[int, str] | None:
            gone = [i for i, p in enumerate(self.processes) if not p.is_alive() and i not in results]
            return (gone[0], _exit_text(self.processes[gone[0]].exitcode)) if gone else None

        return collect_results(
            self.size, deadline=time.monotonic() + (timeout or self.timeout + 60), grace=self.grace,
            next_result=self.next_result, dead=dead, stop_silent=self._stop,
        )

    def _stop(self, ranks: list[int]) -> None:
        """Kill the workers of ``ranks`` (silent in a task that failed elsewhere): a late result
        of theirs would be taken for the next task's. The next task restarts the pool."""
        for rank in ranks:
            self.processes[rank].kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        for rank in ranks:
            self.processes[rank].join(timeout=10)
        self._stale = True

    def results_by_rank(self, timeout: float | None = None) -> dict[int, tuple[bool, Any]]:
        """Every worker's (ok, value) without raising: for tests of failures."""
        deadline = time.monotonic() + (timeout or self.timeout + 60)
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.size and time.monotonic() < deadline:
            result = self.next_result()
            if result is not None:
                rank, ok, value = result
                results[rank] = (ok, value)
            elif all(not p.is_alive() or i in results for i, p in enumerate(self.processes)):
                break
        return results

    def next_result(self, timeout: float = 0.2) -> tuple[int, bool, Any] | None:
        """The next (rank, ok, value) a worker reported, or None after ``timeout`` seconds
        without one. For jobs whose workers end apart (elastic ones, where some are killed):
        :meth:`collect` waits for every worker."""
        end = time.monotonic() + timeout
        while True:
            readers = [r for r in self._results if r is not None and not r.closed]
            ready = mp_connection.wait(readers, max(0.0, end - time.monotonic()))
            for reader in ready:
                result = _receive(reader)
                if result is not None:
                    return result
            if time.monotonic() >= end:
                return None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start ``fn`` on every worker without waiting (collect with results_by_rank); after a
        task whose silent workers were killed, every worker is started afresh first."""
        if self._stale:
            self._restart()
        for rank in range(self.size):
            self._tasks[rank].put((fn, args, kwargs))

    def close(self) -> None:
        for rank, p in enumerate(self.processes):
            if p.is_alive():
                with contextlib.suppress(OSError, ValueError):  # its queue is already closed
                    self._tasks[rank].put(None)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for reader in self._results:
            if reader is not None:
                reader.close()

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def os_exit(code: int = 1) -> None:
    """Kill the calling worker at once (failure tests)."""
    os._exit(code)
