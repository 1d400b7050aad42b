"""Local worker processes joined in one gloo group: what ``layoutlang apply`` starts when it
is not launched by torchrun, and what the tests use.

The parent process hosts the TCPStore (so the store outlives any worker) and hands tasks to
every worker: a module-level function and its arguments, run on all ranks at once. A pool
is kept for many tasks, since each worker pays about 1.7 s to import torch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._text import rank_ranges
from ..errors import ExitCode, LayoutError, RuntimeFailure

__all__ = ["LocalWorkers", "WorkerError", "worker_context"]


class WorkerError(RuntimeError):
    """A task failed on a worker (or a worker died or hung); the message names the rank.

    ``kind`` is the error's kind when the task failed on a user's mistake (a
    :class:`~layoutlang.errors.LayoutError`: a bad program, storage or checkpoint) or on a
    failure at run time (a :class:`~layoutlang.errors.RuntimeFailure`: a peer that died or
    hung, an agreement that failed); ``died`` for a worker that exited (its exit code, or the
    signal that killed it), ``hung`` for workers that did not finish in time, ``internal`` for
    anything else. Once a worker has failed, the others get one more timeout (+5 s): the
    failure is then reported with the workers that never answered (stopped or hung), so a
    stopped peer ends a plain ``apply`` about two timeouts after it stopped, whatever
    ``--repeat`` says. ``exit_code`` says who must
    act (:class:`~layoutlang.errors.ExitCode`); ``message`` is the worker's error text
    without the rank prefix.
    """

    def __init__(self, text: str, kind: str = "internal", message: str = "", exit_code: int = ExitCode.INTERNAL):
        super().__init__(text)
        self.kind = kind
        self.message = message or text
        self.exit_code = ExitCode(exit_code)


#: set in each worker: its rank, the world size and the store's port
worker_context: dict[str, Any] = {}


def _worker_main(rank: int, size: int, port: int, timeout: float, tasks, results, default_group: bool = True) -> None:
    import torch
    import torch.distributed as dist

    # Several workers share this machine's cores: one intra-op thread each, as torchrun does.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    store = dist.TCPStore("127.0.0.1", port, size + 1, is_master=False, timeout=timedelta(seconds=timeout))
    if default_group:  # a respawned worker cannot rejoin the first one: its peers built it long ago
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("layoutlang", store),
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout),
        )
    worker_context.update(rank=rank, size=size, port=port, store=store)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except (LayoutError, RuntimeFailure) as err:
            results.put((rank, False, (type(err).__name__, str(err), err.kind, int(err.exit_code))))
        except BaseException as err:  # report everything: the parent decides what it means
            failure = (type(err).__name__, f"{err}\n{traceback.format_exc()}", "internal", int(ExitCode.INTERNAL))
            results.put((rank, False, failure))
    if default_group:
        dist.destroy_process_group()


def _exit_text(code: int | None) -> str:
    """How a worker process ended: its exit code, or the signal that killed it."""
    import signal

    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class LocalWorkers:
    """``size`` worker processes on this machine, ranks 0..size-1 of one gloo group."""

    def __init__(self, size: int, *, timeout: float = 120.0, start_timeout: float = 180.0):
        import torch.distributed as dist

        self.size = size
        self.timeout = timeout
        self.store = dist.TCPStore("127.0.0.1", 0, size + 1, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=start_timeout))
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers, read at their start
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.SimpleQueue() for _ in range(size)]
        self.processes = [
            ctx.Process(
                target=_worker_main,
                args=(rank, size, self.store.port, timeout, self._tasks[rank], self._results),
                daemon=True,
                name=f"layoutlang-worker-{rank}",
            )
            for rank in range(size)
        ]
        self._ctx = ctx
        for p in self.processes:
            p.start()

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
            self.processes[rank] = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.size, self.store.port, self.timeout, self._tasks[rank], self._results, False),
                daemon=True,
                name=f"layoutlang-worker-{rank}",
            )
            self.processes[rank].start()
        return ranks

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker; returns the results by rank.

        Raises WorkerError naming the first failing rank (its LayoutError message, or the
        traceback of anything else), or a worker that died.
        """
        for rank in range(self.size):
            self._tasks[rank].put((fn, args, kwargs))
        return self.collect(timeout)

    def collect(self, timeout: float | None = None) -> list[Any]:
        """Every worker's result, by rank; raises :class:`WorkerError` for the first failure.

        Once a worker has failed, the others get one more ``timeout`` (their own exchanges end
        within it) rather than the whole task's deadline: a worker that is stopped (SIGSTOP, an
        overloaded host) never answers, and the job must end with the failure, naming it.
        """
        deadline = time.monotonic() + (timeout or self.timeout + 60)
        results: dict[int, tuple[bool, Any]] = {}
        grace_until: float | None = None
        while len(results) < self.size:
            result = self._next_result()
            if result is not None:
                rank, ok, value = result
                results[rank] = (ok, value)
                if not ok and grace_until is None:
                    grace_until = min(deadline, time.monotonic() + self.timeout + 5)
                continue
            dead = [i for i, p in enumerate(self.processes) if not p.is_alive() and i not in results]
            if dead:
                text = f"worker rank {dead[0]} died ({_exit_text(self.processes[dead[0]].exitcode)})"
                raise WorkerError(text, "died", f"error: {text}", ExitCode.FAILURE)
            now = time.monotonic()
            if grace_until is not None and now > grace_until:
                break  # the failure is reported below, with the workers that never answered
            if now > deadline:
                missing = sorted(set(range(self.size)) - set(results))
                text = f"workers {missing} did not finish in time"
                raise WorkerError(text, "hung", f"error: {text}", ExitCode.FAILURE)
        silent = sorted(set(range(self.size)) - set(results))
        failed = sorted(r for r, (ok, _) in results.items() if not ok)
        if failed and silent:
            first = min(failed)
            name, message, kind, exit_code = results[first][1]
            note = (
                f"; {'worker' if len(silent) == 1 else 'workers'} {rank_ranges(silent)} did not answer within "
                f"{self.timeout + 5:g} s of it (stopped or hung)"
            )
            raise WorkerError(f"rank {first}: {name}: {message}{note}", kind, message + note, exit_code)
        if failed:
            # Prefer a user's mistake over the runtime failures it caused on other ranks, and
            # both over a bug: BAD_INPUT (2), then FAILURE (1), then INTERNAL (3).
            order = {ExitCode.BAD_INPUT: 0, ExitCode.FAILURE: 1}
            first = min(failed, key=lambda r: (order.get(results[r][1][3], 2), r))
            name, message, kind, exit_code = results[first][1]
            raise WorkerError(f"rank {first}: {name}: {message}", kind, message, exit_code)
        return [results[r][1] for r in range(self.size)]

    def results_by_rank(self, timeout: float | None = None) -> dict[int, tuple[bool, Any]]:
        """Every worker's (ok, value) without raising: for tests of failures."""
        deadline = time.monotonic() + (timeout or self.timeout + 60)
        results: dict[int, tuple[bool, Any]] = {}
        while len(results) < self.size and time.monotonic() < deadline:
            result = self._next_result()
            if result is not None:
                rank, ok, value = result
                results[rank] = (ok, value)
            elif all(not p.is_alive() or i in results for i, p in enumerate(self.processes)):
                break
        return results

    def _next_result(self) -> tuple[int, bool, Any] | None:
        """The next (rank, ok, value) a worker reported, or None after 0.2 s without one."""
        try:
            return self._results.get(timeout=0.2)
        except queue.Empty:
            return None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start ``fn`` on every worker without waiting (collect with results_by_rank)."""
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

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def os_exit(code: int = 1) -> None:
    """Kill the calling worker at once (failure tests)."""
    os._exit(code)
