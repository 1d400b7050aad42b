"""Progress of long commands on stderr (``plan``, ``check``): silent when they are quick.

A thread per step waits on an event; the step's end sets it. Python code and the C++ core
(which releases the GIL) both let the thread run, so a step is named while it works.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator

__all__ = ["Progress"]


class Progress:
    """Says on stderr what a long command is doing: a step still running after
    :attr:`after` seconds is named with its time, again every :attr:`every` seconds, and
    its end is reported. Quick commands print nothing, so outputs stay as they were. With
    ``--json`` each line is a JSON object (``{"progress": ..., "seconds": ...}``).

    ``command`` starts each plain line (``layoutlang plan: compiling the plan: running for 12 s``).
    """

    #: the first word on a terminal, where someone waits
    AFTER_ON_A_TERMINAL = 2.0
    #: the first word in a log or a pipe: later, so that what scripts and tests read of a
    #: command that is merely slow on a loaded machine stays as it was
    AFTER_OTHERWISE = 10.0
    #: between words, while the step runs
    EVERY = 10.0

    def __init__(self, command: str, as_json: bool) -> None:
        self._command = command
        self._json = as_json
        terminal = getattr(sys.stderr, "isatty", lambda: False)()
        self.after = self.AFTER_ON_A_TERMINAL if terminal else self.AFTER_OTHERWISE
        self.every = self.EVERY

    def _say(self, what: str, seconds: float, done: bool = False) -> None:
        if self._json:
            line = json.dumps({"progress": what, "seconds": round(seconds, 1), "done": done})
        else:
            line = f"layoutlang {self._command}: {what}: {'done in' if done else 'running for'} {seconds:.0f} s"
        print(line, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        finished = threading.Event()
        start = time.monotonic()
        announced = False

        def watch() -> None:  # the C++ core releases the GIL, so this runs while it works
            nonlocal announced
            wait = self.after
            while not finished.wait(wait):
                announced = True
                self._say(what, time.monotonic() - start)
                wait = self.every

        watcher = threading.Thread(target=watch, name=f"{self._command}-progress", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            finished.set()
            watcher.join()
            if announced:
                self._say(what, time.monotonic() - start, done=True)
