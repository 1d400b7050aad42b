"""Ranks of a layoutlang job as Ray actors: the :class:`LayoutlangRank` mixin, and
:class:`RayWorkers`, the pool ``layoutlang apply --ray`` runs a program's workers on.

Placement decides the domains (the ranks that share fast links). When the program's
topology gives them (``topology { domain_size = N }``), each domain's ranks are placed on
one Ray node (a ``STRICT_PACK`` placement group per domain). When it does not, a Ray node
is a domain: the ranks are packed onto as few nodes as hold them, consecutive ranks on one
node, and the plan's domains are the largest blocks of consecutive ranks that never span
two nodes (:attr:`RayWorkers.domain_size`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic.auth import JobSecret, remember

from ...errors import ExitCode, LayoutValueError
from ..workers import (
    FAILURE_GRACE,
    UNSENDABLE,
    WorkerError,
    collect_results,
    task_report,
    unsendable,
    worker_context,
)
from .rendezvous import join as join_rendezvous
from .rendezvous import start_rendezvous

__all__ = ["LayoutlangRank", "RayWorkers", "domain_size_of"]


class LayoutlangRank:
    """Mixed into a Ray actor class, makes its instances ranks of a layoutlang job.

    ``join_layoutlang(job, rank)`` finds the job's rendezvous actor by name and joins the
    job's default gloo group (signed with the job's secret); the actor can then build a
    :class:`~layoutlang.runtime.Resharder` as a source or destination rank::

        @ray.remote
        class Trainer(LayoutlangRank):
            def refit(self, program, rank):
                self.join_layoutlang("my-job", rank)
                resharder = Resharder(program, rank=rank)
                ...
    """

    layoutlang_rank: int | None = None
    layoutlang_store: Any = None

    def join_layoutlang(self, job: str, rank: int, *, timeout: float = 180.0) -> None:
        """Join ``job`` as ``rank`` (returns once every rank has joined and proved the secret)."""
        self.layoutlang_store = join_rendezvous(job, rank, timeout=timeout)
        self.layoutlang_rank = rank

    def leave_layoutlang(self) -> None:
        """Leave the job: destroy the default group this rank joined."""
        # torch loads in the ranks only: the launcher that imports this module starts without it
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.layoutlang_rank = self.layoutlang_store = None


class _PoolWorker(LayoutlangRank):
    """One worker of a :class:`RayWorkers` pool: joins the job, then runs its tasks."""

    def __init__(self, job: str, rank: int, size: int, timeout: float):
        self.job, self.rank, self.size, self.timeout = job, rank, size, timeout

    def start(self) -> str:
        """Join the job; the Ray node this worker runs on."""
        self.join_layoutlang(self.job, self.rank, timeout=self.timeout)
        store = self.layoutlang_store
        worker_context.update(rank=self.rank, size=self.size, store=store, host=store.host, port=store.port)
        return ray.get_runtime_context().get_node_id()

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[int, bool, Any]:
        report = task_report(self.rank, fn, args, kwargs)
        try:
            ray.cloudpickle.dumps(report)
        except UNSENDABLE as err:
            return (self.rank, False, unsendable(err))
        return report


def domain_size_of(node_of: Mapping[int, str]) -> int:
    """The largest ``d`` such that every block of ranks ``[k*d, (k+1)*d)`` that holds ranks of
    ``node_of`` (program rank -> Ray node) holds ranks of one node only: the domain size that
    makes every domain of the plan one Ray node, or part of one."""
    ranks = sorted(node_of)
    for d in range(max(1, len(ranks)), 1, -1):
        block_node: dict[int, str] = {}
        if all(block_node.setdefault(r // d, node_of[r]) == node_of[r] for r in ranks):
            return d
    return 1


class _ActorProcess:
    """A worker's actor as :class:`~elastic.membership.ExitWatcher` watches a process: alive
    until a call to it fails. The call waits behind the actor's task while it runs; once
    the actor is dead, it fails at once. Ray does not say with which exit code."""

    exitcode = None

    def __init__(self, actor: Any):
        self.actor = actor
        self._probe = actor.__ray_ready__.remote()

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return True
        try:
            ray.get(self._probe)
        except ray.exceptions.RayActorError:
            return False
        self._probe = self.actor.__ray_ready__.remote()
        return True


class RayWorkers:
    """``size`` Ray actors, ranks 0..size-1 of one gloo group: the interface of
    :class:`~layoutlang.cli.launch.LocalWorkers` (run, submit, collect, results_by_rank,
    next_result, close), with its :class:`~layoutlang.integrations.workers.WorkerError`
    semantics and exit codes; an actor that dies is reported naming its rank.

    ``ranks`` are the program ranks the workers play (worker i plays ``ranks[i]``; default
    0..size-1); ``resources`` what each worker holds (a placement bundle; default one CPU,
    ``{"GPU": 1}`` for a rank per GPU); ``domain_size`` is the program's topology's, or None when a Ray node is a
    domain (:attr:`domain_size` then says what placement gave). The job's store is served
    by a named rendezvous actor on this node (:mod:`.rendezvous`); this process keeps a
    client of it (:attr:`store`). Call it with Ray initialized.
    """

    def __init__(
        self,
        size: int,
        *,
        ranks: Sequence[int] | None = None,
        domain_size: int | None = None,
        timeout: float = 120.0,
        start_timeout: float = 180.0,
        secret: JobSecret | None = None,
        grace: float = FAILURE_GRACE,
        resources: Mapping[str, float] | None = None,
    ):
        self.size = size
        self.resources = dict(resources or {"CPU": 1.0})
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.grace = min(grace, timeout + 5)
        self.secret: JobSecret = secret or JobSecret.from_environment() or JobSecret.generate()
        self.ranks = list(range(size)) if ranks is None else list(ranks)
        self._groups: list[Any] = []
        self.nodes: dict[int, str] = {}  # program rank -> the Ray node its worker runs on
        self._strategies = self._place(domain_size)
        self.actors: list[Any] = []
        self.rendezvous: Any = None
        self._pending: dict[Any, int] = {}  # a running task's result -> the rank that runs it
        self._dead: dict[int, str] = {}  # rank -> how its actor died
        self._stale = False
        self._start_all()

    # ------------------------------------------------------------- placement

    def _place(self, domain_size: int | None) -> list[PlacementGroupSchedulingStrategy]:
        """One bundle of :attr:`resources` per worker, placed as the module doc says; sets
        :attr:`domain_size` and :attr:`nodes` (program rank -> Ray node)."""
        bundle = self.resources
        if domain_size is not None:
            domains: dict[int, list[int]] = {}
            for index, rank in enumerate(self.ranks):
                domains.setdefault(rank // domain_size, []).append(index)
            self._groups = [placement_group([bundle] * len(members), strategy="STRICT_PACK")
                            for members in domains.values()]
            self._wait_placed()
            strategies: list[Any] = [None] * self.size
            for group, members in zip(self._groups, domains.values(), strict=True):
                nodes = placement_group_table(group)["bundles_to_node_id"]
                for j, index in enumerate(members):
                    strategies[index] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=j)
                    self._node_of(index, nodes[j])
            self.domain_size = domain_size
            return strategies
        group = placement_group([bundle] * self.size, strategy="PACK")
        self._groups = [group]
        self._wait_placed()
        nodes = placement_group_table(group)["bundles_to_node_id"]
        first_seen = {node: i for i, node in reversed(list(enumerate(nodes[b] for b in range(self.size))))}
        order = sorted(range(self.size), key=lambda b: (first_seen[nodes[b]], b))  # a node's bundles together
        for index, b in enumerate(order):
            self._node_of(index, nodes[b])
        self.domain_size = domain_size_of(self.nodes)
        return [PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=b) for b in order]

    def _node_of(self, index: int, node: str) -> None:
        self.nodes[self.ranks[index]] = node

    def _wait_placed(self) -> None:
        ready, _ = ray.wait([g.ready() for g in self._groups], num_returns=len(self._groups),
                            timeout=self.start_timeout)
        if len(ready) < len(self._groups):
            total = ray.cluster_resources()
            self._remove_groups()
            has = ", ".join(f"{total.get(name, 0):g} {name}" for name in self.resources)
            raise LayoutValueError(
                f"the Ray cluster cannot place {self.size} workers ({self.resources} each) within "
                f"{self.start_timeout:g} s: it has {has} in all",
                hint="add nodes or CPUs to the cluster, or free what other jobs hold",
            )

    def _remove_groups(self) -> None:
        for group in self._groups:
            remove_placement_group(group)
        self._groups = []

    # ------------------------------------------------------------- lifecycle

    def _start_all(self) -> None:
        """A fresh job: a rendezvous actor under a fresh name, and one actor per worker that joins it."""
        self.job = secrets.token_hex(8)
        self.rendezvous = start_rendezvous(self.job, self.size, secret=self.secret, timeout=self.start_timeout)
        contact = ray.get(self.rendezvous.contact.remote())
        # torch loads here only when a pool starts: importing this module stays light
        import torch.distributed as dist

        self.store = dist.TCPStore(contact.host, contact.port, is_master=False,
                                   timeout=timedelta(seconds=self.start_timeout))
        remember(self.store, self.secret)  # what watches this store (an ExitWatcher) signs with the job's secret
        worker = ray.remote(_PoolWorker)
        self.actors = [
            worker.options(
                num_cpus=self.resources.get("CPU", 0),
                num_gpus=self.resources.get("GPU", 0),
                resources={k: v for k, v in self.resources.items() if k not in ("CPU", "GPU")},
                max_restarts=0,
                scheduling_strategy=self._strategies[index],
            ).remote(
                self.job, index, self.size, self.timeout
            )
            for index in range(self.size)
        ]
        #: each worker's actor as a process that an ExitWatcher watches (``--elastic``)
        self.processes = [_ActorProcess(actor) for actor in self.actors]
        self._dead, self._pending = {}, {}
        self._await_joined({actor.start.remote(): index for index, actor in enumerate(self.actors)})

    def _await_joined(self, starts: dict[Any, int]) -> None:
        """Wait until every worker has joined the job; raise :class:`WorkerError` naming the
        first that died or failed to join (and end the others), or those that did not in time."""
        ready, late = ray.wait(list(starts), num_returns=len(starts), timeout=self.start_timeout)
        problems: dict[int, str] = {}
        for ref in ready:
            problem = _join_problem(ref)
            if problem is not None:
                problems[starts[ref]] = problem
        if problems or late:
            self._kill_all()
            if problems:
                first = min(problems)
                text, kind = f"worker rank {first} {problems[first]}", "died"
            else:
                text, kind = f"workers {sorted(starts[r] for r in late)} did not join in time", "hung"
            raise WorkerError(text, kind, f"error: {text}", ExitCode.FAILURE)

    def _kill_all(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.rendezvous is not None:
            ray.kill(self.rendezvous, no_restart=True)
        self.actors, self.rendezvous, self._pending = [], None, {}

    def kill(self, rank: int) -> None:
        """End worker ``rank`` at once (a stopped or hung one, after an elastic job)."""
        ray.kill(self.actors[rank], no_restart=True)

    def _restart(self) -> None:
        """Replace every worker (and the rendezvous) by fresh ones: after workers were killed
        in the middle of a task, the survivors' group misses them."""
        self._kill_all()
        self._start_all()
        self._stale = False

    # ------------------------------------------------------------- tasks

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every worker; returns the results by rank."""
        self.submit(fn, *args, **kwargs)
        return self.collect(timeout)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Start ``fn`` on every worker without waiting; after a task whose silent workers
        were killed, every worker is started afresh first."""
        if self._stale or self._dead:
            self._restart()
        self._pending = {actor.run.remote(fn, args, kwargs): rank for rank, actor in enumerate(self.actors)}

    def next_result(self, timeout: float = 0.2) -> tuple[int, bool, Any] | None:
        """The next (rank, ok, value) a worker reported, or None after ``timeout`` seconds
        without one. A worker whose actor died reports nothing: :meth:`collect` names it."""
        end = time.monotonic() + timeout
        while self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                return None
            rank = self._pending.pop(ready[0])
            try:
                return ray.get(ready[0])
            except ray.exceptions.RayActorError as err:
                self._dead[rank] = _death_text(err)
        return None

    def collect(self, timeout: float | None = None) -> list[Any]:
        """Every worker's result, by rank; raises :class:`WorkerError` for the first failure,
        as :meth:`LocalWorkers.collect <layoutlang.cli.launch.LocalWorkers.collect>` does."""
        def dead(results: Mapping[int, Any]) -> tuple[int, str] | None:
            gone = sorted(r for r in self._dead if r not in results)
            return (gone[0], self._dead[gone[0]]) if gone else None

        def stop_silent(ranks: list[int]) -> None:
            for rank in ranks:
                ray.kill(self.actors[rank], no_restart=True)
            self._stale = True

        def abandon() -> None:
            self._stale = True

        return collect_results(
            self.size, deadline=time.monotonic() + (timeout or self.timeout + 60), grace=self.grace,
            next_result=self.next_result, dead=dead, stop_silent=stop_silent, abandon=abandon,
        )

    def results_by_rank(self, timeout: float | None = None) -> dict[int, tuple[bool, Any]]:
        """Every worker's (ok, value) without raising: for tests of failures."""
        deadline = time.monotonic() + (timeout or self.timeout + 60)
        results: dict[int, tuple[bool, Any]] = {}
        while self._pending and time.monotonic() < deadline:
            result = self.next_result(min(1.0, max(0.0, deadline - time.monotonic())))
            if result is not None:
                rank, ok, value = result
                results[rank] = (ok, value)
        return results

    def close(self) -> None:
        self._kill_all()
        self._remove_groups()

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _join_problem(started: Any) -> str | None:
    """What went wrong when a worker joined its job (None: it joined)."""
    try:
        ray.get(started)
    except ray.exceptions.RayActorError as err:
        return f"died while joining the job ({_death_text(err)})"
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if err.cause is not None else err
        return f"could not join the job: {type(cause).__name__}: {cause}"
    return None


def _death_text(err: BaseException) -> str:
    """How an actor died, in a few words: Ray's explanation is several paragraphs."""
    text = " ".join(str(err).split())
    if "ray.kill" in text:
        return "its Ray actor was killed with ray.kill"
    if "worker process has died" in text or "died unexpectedly" in text:
        return "its Ray actor's process died"
    return f"its Ray actor died: {text[:160]}"
