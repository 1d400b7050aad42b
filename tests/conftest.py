"""Worker pools for the multi-process tests: started once, never under a test's timeout.

Each worker process pays about 1.7 s to import torch (more on a busy machine). pytest-timeout
times a test's fixtures together with the test, so a pool started by a fixture would spend
that time under the first test that uses it. Here a hook around each test's run starts (and,
when needed, checks) its pool before pytest-timeout starts the test's timer, and closes the
pool after the last collected test that needs it.

A test asks for workers with the ``workers`` marker and takes the ``pool`` fixture (a
:class:`layoutlang.cli.launch.LocalWorkers`)::

    pytestmark = pytest.mark.workers(16)       # every test of the module that takes ``pool``

    @pytest.mark.workers(6, scope="function")  # a fresh pool for this test alone: it kills a worker
    def test_a_peer_dies(pool): ...

``workers(size, *, scope="session", timeout=60.0, warm=None)``:

- ``size``: ranks 0..size-1, one gloo group of exactly that many processes. Jobs that need a
  group of N ranks (DeviceMesh over the world, elastic membership of the world) get one of
  N; the jobs of ``tests/workers.py`` run on a prefix of any larger pool (``participants``).
- ``scope``: ``"session"``, one pool per (size, timeout, warm) shared by every module that asks
  for it; ``"module"``, a pool for one module alone, for tests that leave state in their
  workers that no other module should inherit (DeviceMeshes, unmatched point-to-point
  operations, workers respawned without a default group, store keys); ``"function"``, a
  fresh pool for one test, for tests that kill workers.
- ``timeout``: the pool's timeout (gloo operations, and how long ``run`` waits for results).
- ``warm``: a job every worker of a fresh pool runs once before its first test (building
  DeviceMeshes collectively, first-call costs).

Before a test, its pool is replaced by a fresh one if a worker died, and checked (every worker
answers with its own pid) if workers were replaced since the last check (``respawn``: a
replaced worker imports torch before it answers) or the previous test that used the pool
failed (it may have left a job running, or results queued); a pool that fails the check is
replaced too.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from layoutlang.cli.launch import LocalWorkers

SCOPES = ("session", "module", "function")
START_S = 300.0  # many processes importing torch on two busy cores
CHECK_S = 5.0  # a healthy pool answers at once; a busy or hung one is replaced after this


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """What a test's ``workers`` marker asks for; equal specs share one pool."""

    size: int
    scope: str
    owner: str  # "" (session), the module's path, or the test's node id
    timeout: float
    warm: Callable[[], Any] | None

    def describe(self) -> str:
        where = "shared" if self.scope == "session" else f"for {self.owner}"
        return f"the pool of {self.size} workers {where}"


def spec_of(item: pytest.Item) -> PoolSpec | None:
    """The pool ``item`` needs, or None when it takes no ``pool``."""
    if "pool" not in getattr(item, "fixturenames", ()):
        return None
    marker = item.get_closest_marker("workers")
    if marker is None:
        return None  # the fixture says what is missing
    (size,) = marker.args
    options = dict(marker.kwargs)
    scope = options.pop("scope", "session")
    timeout = float(options.pop("timeout", 60.0))
    warm = options.pop("warm", None)
    if options or scope not in SCOPES or not isinstance(size, int) or size < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: workers({marker.args}, {marker.kwargs}): expected workers(size >= 1, "
            f"scope in {SCOPES}, timeout=seconds, warm=job)"
        )
    owner = {"session": "", "module": item.nodeid.split("::")[0], "function": item.nodeid}[scope]
    return PoolSpec(size, scope, owner, timeout, warm)


def discard(pool: LocalWorkers) -> None:
    """Close a pool whose workers may be hung or stopped: kill them first (close would wait
    10 s for each)."""
    for process in pool.processes:
        if process.is_alive():
            process.kill()
    pool.close()


class Pools:
    """The session's pools: which tests need which, the live ones, their start-up times."""

    def __init__(self) -> None:
        self.specs: dict[str, PoolSpec] = {}  # node id -> the pool it needs
        self.last_use: dict[PoolSpec, str] = {}  # the node id after which a pool is closed
        self.live: dict[PoolSpec, LocalWorkers] = {}
        self.errors: dict[PoolSpec, str] = {}
        self.checked: dict[PoolSpec, list[int | None]] = {}  # worker pids at the last check
        self.suspect: set[PoolSpec] = set()  # its last test failed: check before the next
        self.started: list[tuple[int, float]] = []  # (workers, seconds) of every start

    def plan(self, items: list[pytest.Item]) -> None:
        for item in items:
            spec = spec_of(item)
            if spec is not None:
                self.specs[item.nodeid] = spec
                self.last_use[spec] = item.nodeid

    def prepare(self, spec: PoolSpec) -> None:
        """Make ``spec``'s pool ready for a test: started, alive, answering."""
        if spec in self.errors:
            return  # it could not start once: its tests fail at once, not after another START_S
        pool = self.live.get(spec)
        if pool is not None and not self.healthy(spec, pool):
            del self.live[spec]
            discard(pool)
            pool = None
        if pool is None:
            try:
                self.live[spec] = self.start(spec)
                self.errors.pop(spec, None)
            except Exception as err:  # the tests that need the pool report it
                self.errors[spec] = f"{type(err).__name__}: {err}"

    def start(self, spec: PoolSpec) -> LocalWorkers:
        # imported here: a session that starts no workers never loads layoutlang from its
        # conftest, so a broken build fails the modules that import it, not every module
        from layoutlang.cli.launch import LocalWorkers

        begin = time.monotonic()
        pool = LocalWorkers(spec.size, timeout=spec.timeout)
        try:
            if not self.check(spec, pool, START_S):
                raise RuntimeError(f"{spec.describe()} started, but its workers did not answer")
            if spec.warm is not None:
                pool.run(spec.warm, timeout=START_S)
        except BaseException:
            discard(pool)
            raise
        self.started.append((spec.size, time.monotonic() - begin))
        return pool

    def healthy(self, spec: PoolSpec, pool: LocalWorkers) -> bool:
        if not all(process.is_alive() for process in pool.processes):
            return False
        pids = [process.pid for process in pool.processes]
        if pids != self.checked.get(spec):  # respawned workers answer once they have imported torch
            return self.check(spec, pool, START_S)
        if spec in self.suspect:
            return self.check(spec, pool, CHECK_S)
        return True

    def check(self, spec: PoolSpec, pool: LocalWorkers, timeout: float) -> bool:
        """Every worker answers with its own pid: none is busy, none left a result queued."""
        from layoutlang.cli.launch import WorkerError  # loaded by start() already

        self.suspect.discard(spec)
        try:
            answers = pool.run(os.getpid, timeout=timeout)
        except WorkerError:
            return False
        pids = [process.pid for process in pool.processes]
        self.checked[spec] = pids
        return answers == pids

    def pool_for(self, item: pytest.Item) -> LocalWorkers:
        spec = self.specs.get(item.nodeid)
        if spec is None:
            pytest.fail(f"{item.nodeid} takes `pool` but has no @pytest.mark.workers(size)", pytrace=False)
        if spec in self.errors:
            pytest.fail(f"{spec.describe()} could not start: {self.errors[spec]}", pytrace=False)
        return self.live[spec]

    def finished(self, item: pytest.Item) -> None:
        spec = self.specs.get(item.nodeid)
        if spec is not None and self.last_use[spec] == item.nodeid and spec in self.live:
            pool = self.live.pop(spec)
            self.close_one(spec, pool)

    def close_one(self, spec: PoolSpec, pool: LocalWorkers) -> None:
        if spec in self.suspect:
            discard(pool)  # after a failure a worker may still be busy: close would wait 10 s for it
        else:
            pool.close()

    def close(self) -> None:
        while self.live:
            self.close_one(*self.live.popitem())


POOLS = pytest.StashKey[Pools]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "workers(size, *, scope='session', timeout=60.0, warm=None): the test's `pool` fixture is a "
        "LocalWorkers pool of exactly `size` ranks, started outside the test's timeout (tests/conftest.py)",
    )
    config.stash[POOLS] = Pools()


def pytest_collection_finish(session: pytest.Session) -> None:
    session.config.stash[POOLS].plan(session.items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # tryfirst: this wrapper is outside pytest-timeout's, whose timer starts after it
    pools = item.config.stash[POOLS]
    spec = pools.specs.get(item.nodeid)
    if spec is not None:
        # Workers inherit this process's stderr: start them inside pytest's capture, as a
        # fixture would, so that what they print is shown with the test that fails.
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.resume_global_capture()
        try:
            pools.prepare(spec)
        finally:
            if capture is not None:
                capture.suspend_global_capture()
    try:
        return (yield)
    finally:
        pools.finished(item)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    pools = item.config.stash[POOLS]
    if report.failed and item.nodeid in pools.specs:
        pools.suspect.add(pools.specs[item.nodeid])
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    session.config.stash[POOLS].close()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    started = config.stash[POOLS].started
    if started:
        workers, seconds = sum(n for n, _ in started), sum(s for _, s in started)
        terminalreporter.write_line(
            f"worker pools: {len(started)} started ({workers} workers) in {seconds:.1f} s, outside the tests' timeouts"
        )


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> LocalWorkers:
    """The LocalWorkers pool that the test's ``workers`` marker asks for, already started."""
    return request.config.stash[POOLS].pool_for(request.node)
