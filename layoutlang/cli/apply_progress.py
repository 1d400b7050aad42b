"""What ``layoutlang apply`` shows while it runs, on stderr, from its first second.

Three modes (:meth:`Display.for_command`):

- ``live``, when stderr is a terminal: the run's header at once, then one status line
  rewritten in place (``starting workers: 7/12 connected, 14 s``) and one lasting line per
  phase (workers ready, plan agreed, each run or step, each recovery); the status line is
  cleared before the report;
- ``lines``, when stderr is a pipe or a file: the same lasting lines and nothing else, one
  per phase, step or recovery (``layoutlang apply: workers ready (12/12) in 21 s``);
- ``off``, with ``--json``: nothing at all, so that stderr holds only an error's JSON object.

The report stays on stdout, as it was. What the display shows comes from the job's store,
which the launcher polls with a client of its own (:class:`ApplyWatch`,
:class:`ElasticWatch`): counters the workers raise as they connect and build their group
(:data:`~layoutlang.integrations.workers.CONNECTED_KEY`, :data:`~layoutlang.integrations.workers.READY_KEY`),
events rank 0 writes at each phase of a plain run (:func:`publisher`), and the keys elastic
ranks write for each committed step and each new generation. A handful of small writes per
phase, none per byte moved: the data path never waits for the display.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TextIO

__all__ = [
    "EVENTS_KEY", "PREFIX", "STEP_KEY", "ApplyWatch", "Display", "ElasticWatch", "elastic_keys", "publisher",
]

#: how every lasting line starts
PREFIX = "layoutlang apply"
#: rank 0's events in a plain run: EVENTS_KEY/1, EVENTS_KEY/2, ... (JSON objects)
EVENTS_KEY = "layoutlang/apply/event"
#: rank 0's executor steps: "POLICY DONE TOTAL", rewritten at each step
STEP_KEY = "layoutlang/apply/progress"


class Display:
    """The progress of one ``apply`` on ``stream`` (stderr), in one of the modes of the module doc.

    :meth:`say` writes a lasting line; :meth:`status` sets the live line (live mode only),
    which a thread redraws with the time since :meth:`start` every :attr:`REFRESH` seconds.
    """

    #: seconds between redraws of the status line
    REFRESH = 0.25

    def __init__(self, mode: str, stream: TextIO | None = None) -> None:
        if mode not in ("live", "lines", "off"):
            raise ValueError(f"unknown display mode {mode!r}")
        self.mode = mode
        self._stream = stream
        self._status = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()
        self._mark = self._started

    @classmethod
    def for_command(cls, as_json: bool) -> Display:
        """``off`` with ``--json``, ``live`` on a terminal, ``lines`` otherwise."""
        if as_json:
            return cls("off")
        terminal = getattr(sys.stderr, "isatty", lambda: False)()
        return cls("live" if terminal else "lines")

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr  # looked up late: a test may redirect stderr

    def elapsed(self) -> float:
        """Seconds since :meth:`start`."""
        return time.monotonic() - self._started

    def lap(self) -> float:
        """Seconds since the previous lap (or :meth:`start`): how long a phase took."""
        now = time.monotonic()
        seconds, self._mark = now - self._mark, now
        return seconds

    def start(self, header: str, status: str = "") -> None:
        """Say what runs, at once; in live mode, start redrawing the status line."""
        self._started = self._mark = time.monotonic()
        self._status = status
        self.say(header)
        if self.mode == "live":
            self._thread = threading.Thread(target=self._redraw, name="layoutlang-apply-display", daemon=True)
            self._thread.start()

    def say(self, text: str, status: str | None = None) -> None:
        """A lasting line: ``layoutlang apply: TEXT`` (above the status line, in live mode),
        and the status that follows it, if it changes."""
        if self.mode == "off":
            return
        with self._lock:
            if status is not None:
                self._status = status
            clear = "\r\x1b[2K" if self.mode == "live" else ""
            self._write(f"{clear}{PREFIX}: {text}\n")
            if self.mode == "live":
                self._draw()

    def status(self, text: str) -> None:
        """What runs now (live mode: the line rewritten in place; otherwise nothing)."""
        if self.mode != "live" or text == self._status:
            return
        with self._lock:
            self._status = text
            self._draw()

    def close(self) -> None:
        """Stop redrawing and clear the status line (the report follows on stdout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            with self._lock:
                self._write("\r\x1b[2K")

    def __enter__(self) -> Display:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _redraw(self) -> None:
        while True:
            with self._lock:
                self._draw()
            if self._stop.wait(self.REFRESH):
                return

    def _draw(self) -> None:
        """The status line with the time so far, cut to the terminal's width (a wrapped line
        cannot be rewritten in place)."""
        if self._stop.is_set():
            return
        line = f"{self._status}, {self.elapsed():.0f} s" if self._status else f"{self.elapsed():.0f} s"
        self._write(f"\r\x1b[2K{line[: max(10, self._width() - 1)]}")

    def _width(self) -> int:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            return os.get_terminal_size(self.stream.fileno()).columns or 80  # 0: a terminal of no size
        return 80

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # a closed stderr never fails the run
            self.stream.write(text)
            self.stream.flush()


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ------------------------------------------------------------------- the workers' side


def publisher(store: Any) -> Callable[..., None]:
    """How rank 0 of a plain run says what it did (``publish("plan", policy=...)``): the
    event's fields as JSON under the next :data:`EVENTS_KEY` number. A store that fails
    only loses the event: the display is never a reason for a run to fail."""
    count = 0

    def publish(event: str, **fields: Any) -> None:
        nonlocal count
        with contextlib.suppress(Exception):
            store.set(f"{EVENTS_KEY}/{count + 1}", json.dumps({"event": event, **fields}))
            count += 1

    return publish


def elastic_keys(namespace: str) -> str:
    """The prefix of the keys elastic ranks write for the display: ``step/S`` for each
    committed step and ``generation/G`` for each new generation (JSON objects)."""
    return f"{namespace}-progress"


# ------------------------------------------------------------------- the launcher's side


class _Reader:
    """A client of the job's store of the display's own (a client is never shared between
    threads: the launcher's watches use theirs); every read that fails reads as nothing."""

    def __init__(self, host: str, port: int) -> None:
        self._address = (host, port)
        self._store: Any = None

    def _client(self) -> Any:
        if self._store is None:
            import torch.distributed as dist  # the launcher of a job has imported torch already

            host, port = self._address
            self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
        return self._store

    def count(self, key: str) -> int:
        with contextlib.suppress(Exception):
            return int(self._client().add(key, 0))
        return 0

    def json(self, key: str) -> dict[str, Any] | None:
        with contextlib.suppress(Exception):
            store = self._client()
            if store.check([key]):
                value = json.loads(bytes(store.get(key)).decode())
                return value if isinstance(value, dict) else None
        return None

    def text(self, key: str) -> str | None:
        with contextlib.suppress(Exception):
            store = self._client()
            if store.check([key]):
                return bytes(store.get(key)).decode()
        return None


class _WorkersStarting:
    """The start of ``size`` workers: connected and ready counts, then one line when all are ready."""

    def __init__(self, display: Display, reader: _Reader, size: int) -> None:
        # integrations.workers imports elastic, which imports torch: apply imports this module
        # before it starts the display, and its header comes before torch is loaded
        from ..integrations.workers import CONNECTED_KEY, READY_KEY

        self.display, self.reader, self.size = display, reader, size
        self.keys = CONNECTED_KEY, READY_KEY
        self.ready = False

    def poll(self) -> bool:
        """True once every worker is ready (said once)."""
        if self.ready:
            return True
        connected_key, ready_key = self.keys
        ready = self.reader.count(ready_key)
        if ready >= self.size:
            self.ready = True
            self.display.say(f"workers ready ({self.size}/{self.size}) in {self.display.lap():.0f} s",
                             "compiling and agreeing on the plan")
            return True
        connected = max(self.reader.count(connected_key), ready)
        self.display.status(f"starting workers: {connected}/{self.size} connected, {ready}/{self.size} ready")
        return False


class ApplyWatch:
    """What a plain ``apply`` shows: its workers' start, then rank 0's events (the plan
    agreed, each run done) and executor steps. :meth:`poll` is called while the launcher
    waits for the results."""

    def __init__(self, display: Display, address: tuple[str, int], size: int) -> None:
        self.display = display
        self.reader = _Reader(*address)
        self.workers = _WorkersStarting(display, self.reader, size)
        self.size = size
        self._next = 1
        self._run = ""

    def poll(self) -> None:
        if not self.display.active or not self.workers.poll():
            return
        while (event := self.reader.json(f"{EVENTS_KEY}/{self._next}")) is not None:
            self._next += 1
            self._show(event)
        step = (self.reader.text(STEP_KEY) or "").split()
        if self._run and len(step) == 3:
            self.display.status(f"{self._run}, executor step {step[1]}/{step[2]}")

    def _show(self, event: dict[str, Any]) -> None:
        kind, policy = event.get("event"), event.get("policy", "?")
        if kind == "plan":
            moves = event.get("moves", 0)
            self.display.say(
                f"{policy}: {event.get('mode', '?')} plan compiled and agreed by every rank "
                f"({moves:,} moves, fingerprint {str(event.get('fingerprint', ''))[:12]}) "
                f"in {self.display.lap():.0f} s",
                f"{policy}: moving",
            )
            self._run = f"{policy}: moving"
        elif kind == "run":
            what = "delta refit" if event.get("delta") else "run"
            done, total = event.get("run", 0), event.get("runs", 0)
            self.display.lap()
            self._run = f"{policy}: {what} {done + 1}/{total}" if done < total else ""
            self.display.say(f"{policy}: {what} {done}/{total} done (rank 0 in {event.get('seconds', 0.0):.3f} s)",
                             self._run or f"{policy}: verifying every destination byte")

    def finished(self) -> None:
        """Every rank reported."""
        self.poll()
        self.display.say(f"every rank reported ({self.size}/{self.size}) in {self.display.elapsed():.0f} s",
                         "stopping the workers")


class ElasticWatch:
    """What ``apply --elastic`` shows: its workers' start, each committed step, each
    injected fault and each new generation (the keys of :func:`elastic_keys`, and the fault
    stamps of :mod:`~layoutlang.cli.elastic_job`), in the order of their time stamps: one
    look at the store may find several, written by different ranks."""

    def __init__(
        self, display: Display, address: tuple[str, int], size: int, namespace: str, steps: int,
        faults: Iterable[tuple[int, int, str]],
    ) -> None:
        self.display = display
        self.reader = _Reader(*address)
        self.workers = _WorkersStarting(display, self.reader, size)
        self.keys, self.ctl = elastic_keys(namespace), f"{namespace}-ctl"
        self.steps = steps
        self.faults = {rank: (step, how) for rank, step, how in faults}
        self._step = 0
        self._generation = 1  # generation 0 is the first: each later one is a recovery
        self._failed: dict[int, float] = {}  # rank -> the time.time() of its fault

    def poll(self) -> None:
        if not self.display.active or not self.workers.poll():
            return
        said: list[tuple[float, str]] = []
        for rank, (step, how) in sorted(self.faults.items()):
            if rank in self._failed or (stamp := self.reader.text(f"{self.ctl}/failed/{rank}")) is None:
                continue
            with contextlib.suppress(ValueError, IndexError):
                self._failed[rank] = float(stamp.split()[0])
                signal = "SIGSTOP" if how == "stop" else "SIGKILL"
                said.append((self._failed[rank], f"rank {rank}: {signal} injected in step {step}"))
        while (gen := self.reader.json(f"{self.keys}/generation/{self._generation}")) is not None:
            self._generation += 1
            said.append((_at(gen), self._recovery(gen)))
        while (committed := self.reader.json(f"{self.keys}/step/{self._step}")) is not None:
            self._step += 1
            text = f"step {self._step - 1} committed ({self._step}/{self.steps}) in generation"
            said.append((_at(committed), f"{text} {committed.get('generation')}"))
        for _, text in sorted(said, key=lambda item: item[0]):
            self.display.say(text)
        if self._step < self.steps:
            self.display.status(
                f"step {self._step} running ({self._step + 1}/{self.steps}), generation {self._generation - 1}"
            )
        else:
            self.display.status("collecting the ranks' reports")

    def _recovery(self, gen: dict[str, Any]) -> str:
        lost, joined = gen.get("lost") or [], gen.get("joined") or []
        what = [f"lost {', '.join(map(str, lost))}"] if lost else []
        what += [f"joined {', '.join(map(str, joined))}"] if joined else []
        faults = [self._failed[r] for r in lost if r in self._failed]
        since = f", {_at(gen) - min(faults):.1f} s after the fault" if faults and _at(gen) else ""
        return (
            f"recovery: generation {gen.get('generation')} ({'; '.join(what) or 'same members'}), "
            f"{_plural(len(gen.get('members') or []), 'member')}{since}"
        )

    def finished(self, reported: int) -> None:
        self.poll()
        self.display.say(f"{_plural(reported, 'rank')} reported in {self.display.elapsed():.0f} s",
                         "stopping the workers")


def _at(record: dict[str, Any]) -> float:
    """The ``time.time()`` a rank wrote a record at (0 when it has none)."""
    at = record.get("at")
    return float(at) if isinstance(at, (int, float)) else 0.0
