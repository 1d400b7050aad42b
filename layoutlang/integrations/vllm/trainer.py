"""The trainer side: layoutlang as a vLLM ``TrainerWeightTransferEngine``.

Every trainer rank calls :meth:`LayoutlangTrainerWeightTransferEngine.trainer_init` with its
own rank and the same program, and :meth:`~LayoutlangTrainerWeightTransferEngine.send_weights`
after every optimizer step. Each rank sends the boxes of its own shards that the plan gives it
(its FSDP2 / TP / EP ``to_local()``): no rank gathers a whole tensor. Rank 0 (the sender)
also serves the refit session's store (unless a process that outlives the trainer does) and
drives the engines through their clients, one per engine.

The refit is an elastic session (:mod:`layoutlang.integrations.refit_session`): every refit
is a committed step, and the fleet of engines may change between and during steps without
anyone calling ``trainer_init`` again:

- an engine that loses a worker (or hangs) during a refit is dropped; the others' refit still
  commits within the same ``send_weights()`` call, which reports the lost engine
  (:class:`RefitReport`, and :attr:`~LayoutlangTrainerWeightTransferEngine.on_engines_lost`);
- :meth:`~LayoutlangTrainerWeightTransferEngine.add_engine` (a restarted engine, or one more
  for throughput) is admitted at the next step boundary, receives the weights of the step
  just committed from an engine that holds the same boxes, and is applied before
  ``send_weights()`` returns: it serves the others' version;
- a lost engine that was started again under the same client (a Ray actor restarted by Ray,
  driven through :class:`~layoutlang.integrations.ray.vllm.RestartAwareRayClient`) asks to
  join again by itself at the next ``send_weights()``, under the same index, and is admitted
  as an added engine is;
- :meth:`~LayoutlangTrainerWeightTransferEngine.remove_engine` leaves on purpose (not a
  failure): the engine axis shrinks at the next step;
- a trainer rank lost with no replica of its shards stops the refit with
  :class:`~layoutlang.errors.DataLossError`; the engines keep serving their last committed
  weights and stay in the session, and a restarted trainer (same job secret, same store) calls
  ``trainer_init`` again to re-attach to them.

All or nothing: every worker of every engine receives the step and *prepares* it (checked
against its model, nothing written; ``update_weights`` fails unless all of the engine's
workers did), and only when every engine that is still a member of the step prepared it does
the sender call ``finish_weight_update`` on them all, which applies it. If one cannot, none
applies: the others are told to discard it (``update_weights`` with ``discard``), every engine
keeps serving its previous weights, and the report names the engine and why
(:attr:`RefitReport.failed`, :attr:`RefitReport.held_back`). An engine lost during the step
is no member: the others still apply it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import attrs
import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    materialize_full_tensor,
)

from elastic import ElasticSession, JobSecret, Recovery

from ..._text import rank_ranges
from ...errors import DataLossError, ExecutionError, LayoutValueError, RuntimeFailure
from ...runtime.delta import DeltaOptions, DeltaReport
from ..dtensor import local_storages, state_dict_problems
from ..refit_session import (
    DEFAULT_NAMESPACE,
    SessionAddress,
    allocate_engine_ranks,
    engines_of,
    fleet_session,
    job_secret,
    read_engine_ranks,
    session_exists,
)
from .common import BACKEND, RefitProgram, WorkerInitFields, first_of, secret_fingerprint
from .lora import AdapterSpec

__all__ = [
    "Engine",
    "LayoutlangTrainerInitInfo",
    "LayoutlangTrainerWeightTransferEngine",
    "OfflineLLMClient",
    "RefitReport",
    "StateDictSource",
]


class StateDictSource(WeightSource):
    """A trainer's weights as a vLLM ``WeightSource``: a module (its ``state_dict()``, read
    afresh at every refit so that in-place optimizer steps are seen) or a mapping of names to
    DTensors / local tensors. ``rename`` maps its names to the program's tensor names.

    Iterating it yields whole tensors, as the protocol asks; the layoutlang engine never
    iterates it: it sends each rank's local shards (:meth:`state_dict`).
    """

    def __init__(self, weights: torch.nn.Module | Mapping[str, Any], *, rename: Callable[[str], str] | None = None):
        self._weights = weights
        self.rename = rename

    def state_dict(self) -> dict[str, Any]:
        weights = self._weights.state_dict() if isinstance(self._weights, torch.nn.Module) else self._weights
        return {(self.rename(k) if self.rename else k): v for k, v in weights.items()}

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.state_dict().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state_dict().items():
            yield name, materialize_full_tensor(tensor)


class OfflineLLMClient:
    """A ``VLLMWeightSyncClient`` for a ``vllm.LLM`` in this process (vLLM ships HTTP and
    Ray clients; this one calls the ``LLM`` object's own weight-sync methods)."""

    def __init__(self, llm: Any):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


@dataclass(kw_only=True)
class LayoutlangTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info; ``rank`` is this trainer process's rank (program rank).

    ``master_address:master_port`` is the refit session's store: trainer rank 0 serves it
    there (listening on that address only) unless ``host_store`` is False, when a process
    that outlives the trainer serves it (then a restarted trainer re-attaches to the running
    engines). ``secret`` is the job's secret (default: ``LAYOUTLANG_JOB_SECRET``, else one
    rank 0 generates and broadcasts over the trainer's default process group); it reaches the
    engines in their init info (or, with ``send_secret=False``, only its fingerprint does: the
    engines hold it in their own environment, as a ``vllm serve`` server refitted over HTTP
    does) and is never shown. ``master_port`` 0 (the default): the sender's store takes a free
    port of ``master_address``, and the engines learn it from their init info.
    """

    backend: ClassVar[str] = BACKEND

    master_address: str
    #: 0: the sender serves the store on a free port of ``master_address`` and tells the other
    #: trainer ranks (over the trainer's default process group) and the engines (init info)
    master_port: int = 0
    program: str = ""
    program_path: str | None = None
    reshard: str | None = None
    #: first program rank of each engine, in the order of the clients; default: the
    #: destination mesh's engines (coordinates of ``engine_axis``) in order
    engine_rank_offsets: list[int] | None = None
    timeout: float = 300.0
    #: seconds a member may stay silent before it is suspected (a second deadline confirms it)
    deadline: float = 2.0
    namespace: str = DEFAULT_NAMESPACE
    secret: str | None = field(default=None, repr=False)
    #: False: the engines read the job's secret from their own environment
    #: (``LAYOUTLANG_JOB_SECRET``, set where ``vllm serve`` starts); their init info carries
    #: only its fingerprint, so a control plane that is not private (HTTP) never carries it,
    #: and an engine holding another secret refuses the init
    send_secret: bool = True
    host_store: bool = True
    memory_budget: int | None = None
    #: the destination mesh's axis that indexes engines (its first axis)
    engine_axis: str = "dp"
    #: seconds an added engine waits to be admitted at a step boundary (add_engine)
    join_timeout: float = 3600.0
    #: send sources of another dtype (fp32 master weights) as the program declares them
    cast_sources: bool = False
    #: the destination layout names checkpoint tensors (see WorkerInitFields)
    checkpoint_format: bool = False
    #: delta refits: each refit sends only what changed since the version each engine worker
    #: holds (its staged storages); an engine that joined or missed a step gets dense, then deltas;
    #: ``"digests"``: the trainer keeps a digest per 4 KiB block of what it sent, not a copy;
    #: :class:`~layoutlang.runtime.delta.DeltaOptions`: a budget for the copies, or a directory for them
    delta: bool | str | DeltaOptions = False
    #: the program refits a LoRA adapter, not the base weights (:mod:`.lora`): its
    #: :class:`~.lora.AdapterSpec` (or that as JSON). Give each adapter its own ``namespace``;
    #: the engines start with ``enable_lora=True``
    lora: AdapterSpec | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.lora is not None:
            self.lora = AdapterSpec.from_json(self.lora)


@dataclass
class Engine:
    """One inference engine as the sender sees it.

    ``state``: ``joining`` (asked to join, admitted at the next step boundary), ``serving``,
    ``lost`` (a worker died or hung: vLLM stopped it), ``left`` (removed on purpose) or
    ``failed`` (its control plane failed, or it could not join; ``error`` says why).
    ``version`` is the session's step whose weights it serves (None: not known yet).
    """

    index: int
    client: Any = field(repr=False)
    ranks: tuple[int, ...] = ()
    state: str = "joining"
    version: int | None = None
    error: str | None = None
    token: str = field(default_factory=lambda: uuid.uuid4().hex, repr=False)
    admission: concurrent.futures.Future[Any] | None = field(default=None, repr=False)


@attrs.frozen
class RefitReport:
    """What one ``send_weights()`` did, on this rank (engine lists are the sender's).

    ``refitted``: the engines that applied ``step``; ``joined``: engines admitted at this
    step's boundary (caught up with ``step`` and applied); ``lost`` / ``left``: engines that
    went during it; ``failed``: engines that could not prepare or apply ``step``, or whose
    control plane failed (index -> why), which did not apply it; ``held_back``: engines that
    prepared ``step`` but did not apply it because an engine of ``failed`` that is still a
    member could not prepare it (all or nothing: every engine serves its previous weights).
    ``recoveries``: the session's membership changes during the call;
    ``recovered_from``: their recovery plans' bytes by where they were read (``destination``:
    other engines, ``source``: the trainer). ``delta``: with delta refits, this rank's
    :class:`~layoutlang.runtime.delta.DeltaReport` of the step.
    """

    step: int
    seconds: float
    generation: int
    refitted: tuple[int, ...]
    joined: tuple[int, ...] = ()
    lost: tuple[int, ...] = ()
    left: tuple[int, ...] = ()
    failed: dict[int, str] = attrs.Factory(dict)
    recoveries: tuple[Recovery, ...] = ()
    held_back: tuple[int, ...] = ()
    #: with ``delta=True``: this rank's sends of the try that committed (wire bytes against dense)
    delta: DeltaReport | None = None
    #: seconds of the call's phases on this rank: ``sources`` (reading the local shards),
    #: ``start`` (``start_weight_update`` on every engine), ``step`` (the session's step: its
    #: ``step.begin``, ``step.agree``, ``step.transfer`` and ``step.commit``), ``updates``
    #: (the engines' ``update_weights`` replies after the commit: their prepares and vLLM's
    #: RPC), ``finish`` (``finish_weight_update`` on every engine: the apply)
    phases: dict[str, float] = attrs.Factory(dict)

    @property
    def recovered_from(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for recovery in self.recoveries:
            for where, nbytes in recovery.recovered_from.items():
                out[where] = out.get(where, 0) + nbytes
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "seconds": self.seconds, "generation": self.generation,
            "refitted": list(self.refitted), "joined": list(self.joined), "lost": list(self.lost),
            "left": list(self.left), "failed": {str(k): v for k, v in self.failed.items()},
            "held_back": list(self.held_back),
            "recoveries": [r.to_json() for r in self.recoveries], "recovered_from": self.recovered_from,
            **({"delta": attrs.asdict(self.delta)} if self.delta is not None else {}),
            "phases": dict(self.phases),
        }


def _call(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Run one control-plane call in a daemon thread: a call to a hung engine never returns,
    and must neither block the refit nor keep the process from exiting."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # handed to whoever waits on the future
            future.set_exception(err)

    threading.Thread(target=run, name="layoutlang-engine-call", daemon=True).start()
    return future


def _start_update(engine: Engine) -> None:
    """``start_weight_update`` on an engine. An engine this trainer has not refitted yet may
    have an update left open by a trainer killed before its ``finish_weight_update`` (vLLM
    then refuses a new one): it is ended first (its workers, initialized by this trainer, apply
    nothing at that finish), and the start tried once more."""
    try:
        engine.client.start_weight_update()
    except Exception:
        if engine.version is not None:
            raise
        with contextlib.suppress(Exception):  # an engine with no update open refuses the finish
            engine.client.finish_weight_update(None)
        engine.client.start_weight_update()


def _outcome(future: concurrent.futures.Future[Any], timeout: float) -> str | None:
    """None when the call succeeded within ``timeout`` seconds, else what went wrong."""
    try:
        future.result(timeout=max(0.0, timeout))
    except concurrent.futures.TimeoutError:
        return f"no answer within {timeout:g} s"
    except Exception as err:
        text = str(err).strip().splitlines()
        return f"{type(err).__name__}: {text[-1] if text else ''}"
    return None


class LayoutlangTrainerWeightTransferEngine(TrainerWeightTransferEngine[LayoutlangTrainerInitInfo]):
    """One trainer rank's side of a layoutlang refit (see the module's docstring)."""

    init_info_cls = LayoutlangTrainerInitInfo

    def __init__(
        self,
        *,
        clients: Sequence[Any],
        source: StateDictSource,
        rank: int,
        refit: RefitProgram,
        session: ElasticSession,
        info: LayoutlangTrainerInitInfo,
        secret: JobSecret,
        store: Any,
        engines: list[Engine],
    ):
        super().__init__(client=clients[0] if clients else None, source=source, is_sender=rank == 0)
        self.rank = rank
        self.refit = refit
        self.session = session
        self.info = info
        self._secret = secret
        self._store = store
        self.engines = engines
        #: ``on_engines_lost(engines)``: called on the sender after a refit that lost engines
        #: (so a framework stops routing prompts to them)
        self.on_engines_lost: Callable[[list[Engine]], None] | None = None
        #: ``on_engines_joined(engines)``: called on the sender once joined engines serve
        self.on_engines_joined: Callable[[list[Engine]], None] | None = None
        self.last_report: RefitReport | None = None
        self._closed = False

    # ------------------------------------------------------------------ init
    @classmethod
    def trainer_init(
        cls,
        init_info: LayoutlangTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | torch.nn.Module | Mapping[str, Any] | None = None,
    ) -> LayoutlangTrainerWeightTransferEngine:
        """Join the refit session and start it with the engines (``client``: one client per
        engine, a sequence, or one), or re-attach to the running engines of a session that a
        store outliving the previous trainer still holds. Every member agrees before a byte
        moves: an engine whose parameters do not match the destination layout fails this on
        every rank, naming the parameter and the rank."""
        if source is None:
            raise ValueError("the layoutlang trainer engine needs the trainer's weights (source=)")
        weights = source if isinstance(source, StateDictSource) else StateDictSource(source)
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        refit = RefitProgram(init_info.program, init_info.program_path, init_info.reshard, init_info.engine_axis)
        rank = init_info.rank
        if rank not in refit.source.mesh:
            raise LayoutValueError(
                f"trainer rank {rank} is not in mesh '{refit.source.mesh.name}' of layout '{refit.source.name}' "
                f"(its ranks: {rank_ranges(refit.source.mesh.ranks)})"
            )
        if not init_info.program:
            raise ValueError("the layoutlang trainer engine needs the refit's program (program=)")
        store, secret, returning, port = _open_session(init_info)
        if port != init_info.master_port:  # the free port the sender's store took
            init_info = dataclasses.replace(init_info, master_port=port)
        address = SessionAddress(init_info.master_address, port, init_info.namespace)
        engines = [Engine(i, c, state="serving") for i, c in enumerate(clients)]
        calls: list[concurrent.futures.Future[Any]] = []
        if init_info.is_sender:
            calls = cls._init_engines(init_info, refit, engines, secret, attach=returning)
        problems = state_dict_problems(refit.source, weights.state_dict(), rank, allow_dtype=init_info.cast_sources)
        if returning and problems:
            raise LayoutValueError(
                f"rank {rank}'s weights do not match layout '{refit.source.name}': " + "; ".join(problems[:3])
            )
        try:
            session = fleet_session(
                refit.program, refit.reshard.name, rank=rank, store=store, address=address, secret=secret,
                join=returning, engine_axis=init_info.engine_axis, timeout=init_info.timeout,
                deadline=init_info.deadline, memory_budget=init_info.memory_budget,
                device=_device_of(weights.state_dict()), problem=None if returning else first_of(problems),
                delta=init_info.delta, cast_sources=init_info.cast_sources,
            )
        except RuntimeFailure:
            # an engine's own error names its parameters and ranks, whole: it comes first
            _raise_engine_errors(engines, calls, init_info.timeout, rank)
            raise
        try:
            _raise_engine_errors(engines, calls, init_info.timeout, rank)
        except ExecutionError:
            session.close()
            raise
        if returning and init_info.is_sender:
            for engine in engines:  # the ranks each engine holds in the session it re-attached to
                engine.ranks = read_engine_ranks(store, address, secret, engine.token) or ()
        return cls(
            clients=clients, source=weights, rank=rank, refit=refit, session=session, info=init_info,
            secret=secret, store=store, engines=engines,
        )

    @staticmethod
    def _init_engines(
        info: LayoutlangTrainerInitInfo, refit: RefitProgram, engines: list[Engine], secret: JobSecret, *, attach: bool
    ) -> list[concurrent.futures.Future[Any]]:
        """Initialize every engine's weight transfer, concurrently (they rendezvous with the
        trainer ranks): the first generation's engines, or the running engines of the session
        a restarted trainer re-attaches to."""
        offsets = info.engine_rank_offsets or refit.engine_offsets()
        if not attach and len(offsets) != len(engines):
            raise ValueError(
                f"{len(engines)} engine clients, but the destination layout '{refit.destination.name}' has "
                f"{len(offsets)} engines (engine_rank_offsets or the '{info.engine_axis}' axis of its mesh)"
            )
        calls = []
        known = {ranks[0]: ranks for ranks in refit.engines}
        for engine, offset in zip(engines, offsets if not attach else [0] * len(engines)):
            if not attach:
                if offset not in known:
                    raise LayoutValueError(
                        f"engine {engine.index}'s rank offset {offset} is not the first rank of an engine of layout "
                        f"'{refit.destination.name}' (its engines: "
                        + ", ".join(rank_ranges(r) for r in refit.engines) + ")"
                    )
                engine.ranks = known[offset]
            fields = _worker_fields(info, refit, secret, mode="attach" if attach else "start", offset=offset,
                                    token=engine.token)
            calls.append(_call(engine.client.init_weight_transfer_engine, asdict(fields)))
        return calls

    # --------------------------------------------------------------- refits
    def _sources(self) -> tuple[dict[str, torch.Tensor], str | None]:
        """This rank's local shards, or what is wrong with them (then every rank stops)."""
        assert isinstance(self.source, StateDictSource)
        weights = self.source.state_dict()
        layout = self.refit.source
        problems = state_dict_problems(layout, weights, self.rank, allow_dtype=self.info.cast_sources)
        if problems:
            return {}, f"rank {self.rank}'s weights do not match layout '{layout.name}': " + "; ".join(problems[:3])
        return local_storages(layout, weights, self.rank, checked=False), None

    def send_weights(self, *, progress: Callable[[int, int], None] | None = None) -> RefitReport:
        """Refit every engine from this rank's current weights (called on every trainer rank).

        Returns when the step committed on the session's members, engines lost meanwhile
        dropped, engines admitted at its boundary caught up, and (on the sender) every member
        engine applied it, or none did: one engine that could not prepare it is named in the
        report's ``failed`` and the others in its ``held_back``, and every engine serves its
        previous weights (nothing is raised). Raises :class:`~layoutlang.errors.DataLossError` when a
        trainer rank with no replica of its shards was lost: this trainer's part of the
        session ends (the engines keep serving the last committed step; restart the trainer
        and call ``trainer_init`` again), and :class:`~layoutlang.errors.AgreementError` when
        a rank's weights do not match the training layout (nothing moved). ``progress(done,
        total)`` is called after each of this rank's executor steps."""
        if self._closed:
            raise ExecutionError(f"rank {self.rank}: this trainer engine was shut down", rank=self.rank)
        session = self.session
        step = session.next_step
        begin = time.perf_counter()
        first = len(session.recoveries)
        sources, not_ready = self._sources()
        phases = {"sources": time.perf_counter() - begin}
        mark = time.perf_counter()
        if self.is_sender:
            self._rejoin_restarted()
            self._await_joiners()
            self._drop_failed_joiners()
        # an engine leaving on purpose is a member until the others notice: it is not called
        members = [e for e in self.engines if e.state in ("serving", "leaving")] if self.is_sender else []
        serving = [e for e in members if e.state == "serving"]
        failed: dict[int, str] = {}
        updates: dict[int, concurrent.futures.Future[Any]] = {}
        if serving:
            started = {e.index: _call(_start_update, e) for e in serving}
            for e in serving:
                error = _outcome(started[e.index], self.info.timeout)
                if error is not None:
                    failed[e.index] = f"could not start the weight update: {error}"
                    # its workers would be members that never begin the step: let them leave
                    # now (an engine whose workers died fails this too, and is dropped anyway)
                    _call(e.client.shutdown_weight_transfer_engine)
            updates = {e.index: _call(e.client.update_weights, self._update_info(step=step)) for e in serving
                       if e.index not in failed}
        phases["start"], mark = time.perf_counter() - mark, time.perf_counter()
        try:
            committed = session.refit(
                step, lambda _step, _session: sources, not_ready=not_ready,
                progress=None if progress is None else lambda _step, done, total: progress(done, total),
            )
        except DataLossError:
            self._end()  # the engines keep step - 1 and wait for a restarted trainer
            raise
        phases["step"] = time.perf_counter() - mark
        phases.update({f"step.{name}": seconds for name, seconds in session.phases.items()})
        if not self.is_sender:
            report = RefitReport(step, time.perf_counter() - begin, committed.generation, (),
                                 recoveries=tuple(session.recoveries[first:]), delta=committed.delta, phases=phases)
            self.last_report = report
            return report
        report = self._settle_engines(step, members, updates, failed, begin, session.recoveries[first:], committed,
                                      phases)
        self.last_report = report
        return report

    def _settle_engines(
        self,
        step: int,
        members: list[Engine],
        updates: dict[int, concurrent.futures.Future[Any]],
        failed: dict[int, str],
        begin: float,
        recoveries: Sequence[Recovery],
        committed: Any,
        phases: dict[str, float],
    ) -> RefitReport:
        """After the step committed: which engines went, which joined, and apply it on every
        engine that received it (the joiners: the step they caught up with)."""
        present = set(engines_of(self.session.destination, self.info.engine_axis))
        left_ranks = {r for recovery in recoveries for r in recovery.left}
        lost: list[Engine] = []
        left: list[Engine] = []
        for engine in members:
            if engine.ranks not in present:
                gone_on_purpose = engine.state == "leaving" or (
                    set(engine.ranks) <= left_ranks and engine.index not in failed  # not told to leave by a failure
                )
                engine.state = "left" if gone_on_purpose else "lost"
                (left if gone_on_purpose else lost).append(engine)
        serving = [e for e in members if e.state == "serving"]
        unprepared: list[Engine] = []  # members whose update failed: vLLM's update is still open on some workers
        mark = time.perf_counter()
        for engine in serving:
            error = _outcome(updates[engine.index], self.info.timeout) if engine.index in updates else None
            if error is not None:
                failed[engine.index] = f"could not receive or prepare step {step}: {error}"
                unprepared.append(engine)
        joined = [e for e in self.engines if e.state == "joining" and e.ranks in present]
        for engine in joined:
            assert engine.admission is not None
            error = _outcome(engine.admission, self.info.timeout)
            if error is not None:
                failed[engine.index] = f"could not join: {error}"
                continue
            started = _outcome(_call(engine.client.start_weight_update), self.info.timeout)
            if started is not None:
                failed[engine.index] = f"could not apply the weights it caught up with: {started}"
        phases["updates"], mark = time.perf_counter() - mark, time.perf_counter()
        applying = [e for e in [*serving, *joined] if e.index not in failed]
        # every member engine prepared the step, or none applies it
        blocked = [e.index for e in [*serving, *joined] if e.index in failed]
        refitted: list[int] = []
        held_back: list[int] = []
        if blocked:
            held_back = [e.index for e in applying]
            self._abandon(step, applying, unprepared, failed)
        else:
            finishes = {e.index: _call(e.client.finish_weight_update, str(step)) for e in applying}
            for engine in applying:
                error = _outcome(finishes[engine.index], self.info.timeout)
                if error is not None:
                    # past its prepare only vLLM's loaders can fail: what it serves is not known
                    failed[engine.index] = f"could not apply step {step} (it may serve a mix of versions): {error}"
                    engine.version = None
                    continue
                engine.state, engine.version = "serving", step
                refitted.append(engine.index)
        phases["finish"] = time.perf_counter() - mark
        for index, error in failed.items():
            # an engine whose workers are still members is called at every step (the session
            # waits for them); it only keeps what it served before, and says why
            self.engines[index].error = error
        for engine in joined:
            if engine.state == "joining":
                engine.state = "serving"  # admitted: a member, with its caught-up weights unapplied unless refitted
        for engine in lost:  # a client that can tell when its engine is back starts watching now
            restarted = getattr(engine.client, "restarted", None)
            if restarted is not None:
                restarted()
        if lost and self.on_engines_lost is not None:
            self.on_engines_lost(lost)
        now_serving = [e for e in joined if e.index in refitted]
        if now_serving and self.on_engines_joined is not None:
            self.on_engines_joined(now_serving)
        return RefitReport(
            step, time.perf_counter() - begin, committed.generation, tuple(refitted),
            tuple(e.index for e in now_serving), tuple(e.index for e in lost), tuple(e.index for e in left),
            failed, tuple(recoveries), held_back=tuple(held_back), delta=committed.delta, phases=phases,
        )

    def _abandon(self, step: int, prepared: list[Engine], unprepared: list[Engine], failed: dict[int, str]) -> None:
        """No engine applies ``step``: the engines that prepared it discard it, and vLLM's
        update is ended on every engine (a later ``start_weight_update`` needs it ended)."""
        timeout = self.info.timeout

        def discard(engine: Engine) -> None:
            engine.client.update_weights(self._update_info(step=step, discard=True))
            engine.client.finish_weight_update(None)

        discards = {e.index: _call(discard, e) for e in prepared}
        # the worker whose update raised has ended its own; vLLM refuses it this finish, and
        # the others end theirs: the error it answers is expected
        ends = [_call(e.client.finish_weight_update, None) for e in unprepared]
        for engine in prepared:
            error = _outcome(discards[engine.index], timeout)
            if error is not None:
                failed[engine.index] = f"prepared step {step} but could not discard it: {error}"
        concurrent.futures.wait(ends, timeout=timeout)

    def _await_joiners(self) -> None:
        """Wait (at most ``timeout``) until every engine added since the last step has asked to
        join, so that this step's boundary admits it: its init (checking its model, reaching
        the store) runs while the trainer trains, and may still be running."""
        end = time.monotonic() + self.info.timeout
        while time.monotonic() < end:
            asking = set(self.session.asking)
            pending = [
                e for e in self.engines
                if e.state == "joining" and not set(e.ranks) <= asking and not (e.admission and e.admission.done())
            ]
            if not pending:
                return
            time.sleep(0.05)

    def _drop_failed_joiners(self) -> None:
        """Joining engines whose init failed before they were admitted (a model that does not
        match the layout, a program that differs): they never become members."""
        for engine in self.engines:
            admission = engine.admission
            if engine.state == "joining" and admission is not None and admission.done():
                error = _outcome(admission, 0)
                if error is not None and engine.ranks not in set(engines_of(self.session.destination,
                                                                             self.info.engine_axis)):
                    engine.state, engine.error = "failed", f"could not join: {error}"

    # --------------------------------------------------------- the fleet
    def _update_info(self, **fields: Any) -> dict[str, Any]:
        """An update info of this refit: an adapter's names its session (the worker keeps one
        per namespace)."""
        return {**fields, "namespace": self.info.namespace} if self.info.lora is not None else fields

    def _adapter_name(self) -> str:
        return "" if self.info.lora is None else repr(AdapterSpec.from_json(self.info.lora).lora_name)

    def remove_adapter(self) -> dict[int, str]:
        """Take this refit's adapter out of every serving engine and end the refit (called on
        every trainer rank, like ``shutdown``): each engine's workers remove it from their LoRA
        manager and their memory, and leave its session. Stop routing its requests first: a
        request that names it afterwards cannot load it, as for a path that does not exist (which
        vLLM 0.32 answers by stopping the engine). The
        base weights and the other adapters are untouched. Returns, on the sender, the engines
        that could not remove it (index -> why)."""
        if self.info.lora is None:
            raise ValueError("this trainer engine refits the base weights, not an adapter: shutdown() ends it")
        failed: dict[int, str] = {}
        if self.is_sender and not self._closed:
            serving = [e for e in self.engines if e.state == "serving"]

            def remove(engine: Engine) -> None:
                engine.client.start_weight_update()
                try:
                    engine.client.update_weights(self._update_info(step=self.session.next_step, remove=True))
                finally:
                    engine.client.finish_weight_update(None)

            calls = {e.index: _call(remove, e) for e in serving}
            for engine in serving:
                error = _outcome(calls[engine.index], self.info.timeout)
                if error is not None:
                    failed[engine.index] = f"could not remove adapter {self._adapter_name()}: {error}"
                    engine.error = failed[engine.index]
                engine.state = "left"
        if not self._closed:
            self._end()
        return failed

    def add_engine(self, client: Any) -> Engine:
        """Add an engine (restarted after a crash, or one more for throughput) on the sender:
        it asks to join at once and is admitted at the next step boundary, receives the weights
        of that step from an engine that holds the same boxes (else from the trainer), and is
        applied before that ``send_weights()`` returns (then ``state`` is ``serving``). Its
        engine is started with ``weight_transfer_config={"backend": "layoutlang"}`` like the
        others and the same tensor parallelism; dummy weights are fine."""
        self._sender_only("add an engine")
        if self.info.lora is not None:
            raise ValueError("an adapter's refit takes the engines it started with (add_engine: base weights only)")
        engine = Engine(len(self.engines), client)
        self._ask_to_join(engine)
        self.engines.append(engine)
        return engine

    def _ask_to_join(self, engine: Engine) -> None:
        """Ranks of a new engine position for ``engine``, and its init (in the background):
        it asks to join, and the next step's boundary admits it."""
        ranks = allocate_engine_ranks(self._store, self._address, self.refit.program, self.refit.reshard.name,
                                      self.info.engine_axis)
        engine.ranks, engine.state, engine.version, engine.error = tuple(ranks), "joining", None, None
        engine.token = uuid.uuid4().hex
        fields = _worker_fields(self.info, self.refit, self._secret, mode="join", offset=ranks[0], token=engine.token)
        fields.join_timeout = self.info.join_timeout
        engine.admission = _call(engine.client.init_weight_transfer_engine, asdict(fields))

    def _rejoin_restarted(self) -> None:
        """Lost engines whose client says their engine was started again (a Ray actor that
        Ray restarted: :class:`~layoutlang.integrations.ray.vllm.RestartAwareRayClient`) ask
        to join again, under the same index: this step's boundary admits them."""
        for engine in self.engines:
            restarted = getattr(engine.client, "restarted", None)
            if engine.state == "lost" and restarted is not None and restarted():
                self._ask_to_join(engine)

    def remove_engine(self, engine: Engine | int) -> Engine:
        """Take an engine out on purpose (not a failure): its workers leave the session now,
        and the engine axis shrinks at the next step. The engine keeps serving its weights."""
        self._sender_only("remove an engine")
        engine = self.engines[engine] if isinstance(engine, int) else engine
        if engine.state != "serving":
            raise ValueError(
                f"engine {engine.index} is {engine.state}: only a serving engine can be removed"
                + (" (a joining one is, once it serves after the next send_weights())" if engine.state == "joining"
                   else "")
            )
        engine.state = "leaving"
        error = _outcome(_call(engine.client.shutdown_weight_transfer_engine), self.info.timeout)
        if error is not None:
            engine.state, engine.error = "failed", f"could not leave: {error}"
            raise ExecutionError(f"rank {self.rank}: engine {engine.index} could not leave the session: {error}",
                                 rank=self.rank)
        return engine

    @property
    def _address(self) -> SessionAddress:
        return SessionAddress(self.info.master_address, self.info.master_port, self.info.namespace)

    def _sender_only(self, what: str) -> None:
        if not self.is_sender:
            raise ValueError(f"only the sender (trainer rank 0, which holds the clients) can {what}")

    def _end(self) -> None:
        """This trainer rank's part of the session is over: it leaves (the members take its
        position as vacant at once) and refuses further refits."""
        self._closed = True
        self.session.leave()

    def shutdown(self) -> None:
        """Leave the refit session. The engines stay in it and keep serving their weights;
        a trainer started again later re-attaches to them (with a store that outlived this
        one)."""
        if not self._closed:
            self._end()


def _open_session(info: LayoutlangTrainerInitInfo) -> tuple[Any, JobSecret, bool, int]:
    """The session's store (served by the sender unless ``host_store`` is False), the job's
    secret, whether the session exists already (a restarted trainer re-attaches), and the
    store's port (``master_port``, or the free one the sender's store took when it is 0).
    Rank 0 decides the last three and tells the other trainer ranks over the trainer's own
    default process group, so that all of them decide alike."""
    import torch.distributed as dist

    rank = info.rank
    address = SessionAddress(info.master_address, info.master_port, info.namespace)
    store = address.connect(serve=True, timeout=info.timeout) if info.is_sender and info.host_store else None
    if store is not None:
        address = SessionAddress(info.master_address, int(store.port), info.namespace)
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    decision: list[Any] = [None, None, address.port]
    if info.is_sender:
        secret = job_secret(info.secret, rank=rank, group=False)
        if store is None:
            store = address.connect(serve=False, timeout=info.timeout)
        decision = [secret.text(), session_exists(store, address, secret), address.port]
    if shared:
        dist.broadcast_object_list(decision, src=0)
    address = SessionAddress(info.master_address, int(decision[2]), info.namespace)
    if address.port == 0:
        raise LayoutValueError(
            f"trainer rank {rank} cannot learn the store's port: give master_port, or a default process group "
            "over which the sender tells it"
        )
    if decision[0] is None:  # no default group: every trainer rank has the secret from its environment
        secret = job_secret(info.secret, rank=rank, group=False)
        decision = [secret.text(), None, address.port]
    if store is None:
        store = address.connect(serve=False, timeout=info.timeout)
    secret = JobSecret.parse(decision[0])
    returning = decision[1] if decision[1] is not None else session_exists(store, address, secret)
    return store, secret, bool(returning), address.port


def _raise_engine_errors(
    engines: Sequence[Engine], calls: Sequence[concurrent.futures.Future[Any]], timeout: float, rank: int
) -> None:
    """Wait for the engines' init calls; raise the first one's error, whole."""
    concurrent.futures.wait(calls, timeout=timeout + 30)
    for engine, call in zip(engines, calls):
        if not call.done():
            raise ExecutionError(
                f"rank {rank}: engine {engine.index} did not answer its init within {timeout + 30:g} s", rank=rank
            )
        err = call.exception()
        if err is not None:
            raise ExecutionError(
                f"rank {rank}: engine {engine.index} (program ranks {rank_ranges(engine.ranks)}) could not initialize "
                f"the weight transfer: {type(err).__name__}: {err}",
                rank=rank,
            ) from err


def _worker_fields(
    info: LayoutlangTrainerInitInfo, refit: RefitProgram, secret: JobSecret, *, mode: str, offset: int, token: str
) -> WorkerInitFields:
    return WorkerInitFields(
        master_address=info.master_address, master_port=info.master_port, program=info.program,
        program_path=info.program_path, reshard=refit.reshard.name, rank_offset=offset, namespace=info.namespace,
        mode=mode, secret=secret.text() if info.send_secret else "", secret_id=secret_fingerprint(secret),
        token=token, timeout=info.timeout, deadline=info.deadline,
        memory_budget=info.memory_budget, engine_axis=info.engine_axis, checkpoint_format=info.checkpoint_format,
        # the workers are told what to keep; the trainer's budget and place are its own
        delta=info.delta.keep if isinstance(info.delta, DeltaOptions) else info.delta,
        lora=None if info.lora is None else AdapterSpec.from_json(info.lora).to_json(),
    )


def _device_of(state_dict: Mapping[str, Any]) -> torch.device:
    """Where the trainer's shards live (CUDA: the session runs over NCCL)."""
    for tensor in state_dict.values():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if isinstance(local, torch.Tensor):
            return local.device
    return torch.device("cpu")
