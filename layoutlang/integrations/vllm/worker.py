"""The inference side: layoutlang as a vLLM ``WeightTransferEngine``.

vLLM builds one per worker when the engine is started with
``weight_transfer_config={"backend": "layoutlang"}`` (the plugin registered by the
``vllm.general_plugins`` entry point of this package). Its lifecycle is vLLM's, carried by the
refit session (:mod:`layoutlang.integrations.refit_session`), of which every worker is a member:

``init_transfer_engine``
    ``start``: the worker enters the session's first generation with the trainer; its
    destination storages are resolved against the worker's own model
    (:class:`~.targets.EngineTargets`) and every member agrees before a byte moves: a mismatch
    on any worker fails the init on every member, naming the parameter and the rank.
    ``join``: a new or restarted engine checks its model against the layout, asks to join,
    and returns once the members admitted it at a step boundary and it received the weights
    of the last committed step (from another engine where one holds them): the trainer then
    applies them (``start_weight_update`` and ``finish_weight_update``), so it serves the
    others' version. ``attach``: the worker is a member already and a restarted trainer comes
    back: the members admit it.
``start_weight_update``
    forgets any refit not applied.
``update_weights``
    takes part in the session's refit of the step it names, receiving this worker's boxes into
    staging buffers; the session recovers from failures meanwhile (an engine that loses a
    worker is dropped, and the others' refit still commits). Then it *prepares* the received
    refit (:meth:`~.targets.EngineTargets.prepare`: every check that can fail, against the
    model as it is now, writing nothing), and the engine's workers settle the outcome: the
    call fails, naming each worker and its reason, unless every worker prepared.
    ``{"step": s, "discard": true}`` drops a prepared refit instead (another engine of the
    fleet could not prepare it: none applies).
``finish_weight_update``
    applies the prepared refit (:meth:`~.targets.EngineTargets.apply`): direct copies into
    parameters vLLM keeps as loaded, the CPU GEMMs the prepare packed swapped in where vLLM's
    CPU backend only repacks a weight, vLLM's own ``load_weights`` (layerwise reload,
    post-processing included) for the others. After a failed or discarded update it only
    ends vLLM's update: the model keeps its previous weights.
``shutdown``
    leaves the session on purpose: the engine axis shrinks at the members' next step.

LoRA adapters (:mod:`.lora`): an init info with ``lora`` starts a session of its own (its
namespace) for that adapter, beside the base weights' session and the other adapters'; the
update info then names the namespace (``{"step": s, "namespace": ns}``), and the finish that
follows swaps the prepared adapter into the engine's LoRA manager under its id. The same two
phases hold. ``{"namespace": ns, "remove": true}`` takes the adapter out of the engine and
leaves its session.

The trainer calls ``finish_weight_update`` to apply only when every engine that is a member of
the step prepared it (two phases across engines and across each engine's workers): an engine
never serves a half-applied refit, and a fleet never serves two versions because one engine
could not take the step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from elastic import ElasticSession, JobSecret
from elastic.auth import SECRET_ENV

from ..._text import counted
from ...errors import AgreementError, ExecutionError, LayoutError, LayoutValueError, RuntimeFailure
from ..refit_session import SessionAddress, fleet_session, write_engine_ranks
from .common import RefitProgram, WorkerInitFields, first_of, secret_fingerprint
from .lora import AdapterSpec, AdapterTargets, PreparedAdapter
from .targets import EngineTargets, PreparedRefit

__all__ = [
    "LayoutlangInitInfo",
    "LayoutlangUpdateInfo",
    "LayoutlangWeightTransferEngine",
    "LayoutlangWorkerExtension",
    "worker_phases",
    "worker_raw_exchange",
]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LayoutlangInitInfo(WorkerInitFields, WeightTransferInitInfo):
    """Worker-side init info (see :class:`~.common.WorkerInitFields`)."""


@dataclass
class LayoutlangUpdateInfo(WeightTransferUpdateInfo):
    """Per-refit info: the session's step this refit commits; ``discard``: drop the prepared
    refit of that step instead (the fleet does not apply it)."""

    step: int = 0
    discard: bool = False
    #: the session this update belongs to (None: the base weights'; an adapter's namespace)
    namespace: str | None = None
    #: take the namespace's adapter out of the engine and leave its session
    remove: bool = False


@dataclass
class _AdapterRefit:
    """One LoRA adapter's refit session on this worker (see :mod:`.lora`)."""

    spec: AdapterSpec
    session: ElasticSession
    address: SessionAddress
    targets: AdapterTargets
    prepared: PreparedAdapter | None = None
    staged: int | None = None
    abandoned: bool = False
    version: int | None = None

    def leave(self) -> None:
        with contextlib.suppress(RuntimeError, RuntimeFailure):  # its store may be gone
            self.session.leave()
        self.session.close()


class LayoutlangWeightTransferEngine(WeightTransferEngine[LayoutlangInitInfo, LayoutlangUpdateInfo]):
    """One vLLM worker's side of a layoutlang refit."""

    init_info_cls = LayoutlangInitInfo
    update_info_cls = LayoutlangUpdateInfo
    # the plan is resolved against the model it was built for
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.session: ElasticSession | None = None
        self.address: SessionAddress | None = None
        self.targets: EngineTargets | None = None
        #: the committed step ``staged``, received and checked against the model, not yet applied
        self.prepared: PreparedRefit | None = None
        self.staged: int | None = None
        #: the engine's last update failed or was discarded (every worker knows, settled): its
        #: finish only ends vLLM's update
        self.abandoned = False
        #: the session's step whose weights this worker's model serves (None: none applied yet)
        self.version: int | None = None
        self.rank = -1
        #: the adapters' sessions, by namespace; the one the update in progress names
        self.adapters: dict[str, _AdapterRefit] = {}
        self._current: _AdapterRefit | None = None
        #: seconds of each phase of this worker's recent refits, oldest first (see :func:`worker_phases`)
        self.phases: list[dict[str, float]] = []

    def _program_rank(self, rank_offset: int) -> tuple[int, int]:
        """This worker's program rank and tensor-parallel rank."""
        from vllm.distributed import get_tensor_model_parallel_rank

        parallel = self.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise LayoutValueError(
                "the layoutlang weight transfer serves tensor-parallel engines (pipeline parallel: 1)"
            )
        tp_rank = get_tensor_model_parallel_rank()
        dp_rank = getattr(parallel, "data_parallel_rank", 0) or 0
        return rank_offset + dp_rank * parallel.tensor_parallel_size + tp_rank, tp_rank

    def _problems(self, refit: RefitProgram, position: int, tp_rank: int, checkpoint_format: bool) -> list[str]:
        """What keeps this worker from holding the storages of ``position`` (a rank of the
        destination layout: its own, or for a joiner one that holds the same boxes)."""
        problems = self._position_problems(refit, position, tp_rank)
        if problems:
            return problems
        engine = f"vLLM's {type(self.model).__name__}"
        self.targets = EngineTargets(
            self.model, refit.destination, position, engine=engine, checkpoint_format=checkpoint_format
        )
        return self.targets.problems

    def _position_problems(self, refit: RefitProgram, position: int, tp_rank: int) -> list[str]:
        """Whether ``position`` is in the destination mesh, at this worker's tensor-parallel rank."""
        layout = refit.destination
        if position not in layout.mesh.ranks:
            return [f"rank {position} (this worker) is not in mesh '{layout.mesh.name}' of layout '{layout.name}'"]
        coords = layout.mesh.coords(position)
        tp = self.parallel_config.tensor_parallel_size
        sizes = dict(layout.mesh.axes)
        if "tp" in coords and (coords["tp"] != tp_rank or sizes["tp"] != tp):
            return [
                (
                    f"rank {self.rank} is tp {coords['tp']} of {sizes['tp']} in mesh '{layout.mesh.name}', "
                    f"but tensor-parallel rank {tp_rank} of {tp} in the engine (check rank_offset)"
                )
            ]
        return []

    def _settle(self, error: BaseException | None) -> bool:
        """Make one RPC's outcome the engine's: every worker learns every worker's error.

        vLLM's ``collective_rpc`` reads its workers' answers in order and stops at the first
        failure, leaving the later workers' answers queued, to be read as the answers of the
        next call. So the outcome is gathered over the engine's own tensor-parallel group and
        only its last worker raises (naming every worker's error); the others return, knowing.
        """
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        mine = None if error is None else (self.rank, f"{type(error).__name__}: {error}")
        outcomes: list[Any] = [None] * group.world_size
        dist.all_gather_object(outcomes, mine, group=group.cpu_group)
        failed = [o for o in outcomes if o is not None]
        if not failed:
            return True
        if group.rank_in_group != group.world_size - 1:
            return False
        if error is not None and len(failed) == 1:
            raise error
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise ExecutionError(
            f"workers {ranks} of this engine failed:\n" + "\n".join(f"rank {r}: {m}" for r, m in failed),
            rank=self.rank,
        )

    def init_transfer_engine(self, init_info: LayoutlangInitInfo) -> None:
        error: BaseException | None = None
        try:
            self._init(init_info)
        except (LayoutError, RuntimeFailure) as err:
            error = err
        self._settle(error)

    def _init(self, info: LayoutlangInitInfo) -> None:
        # the trainer's secret, else this process's own (a server started with LAYOUTLANG_JOB_SECRET)
        secret = JobSecret.parse(info.secret) if info.secret else JobSecret.from_environment()
        if secret is None:
            raise LayoutValueError(
                f"the layoutlang init info carries no job secret and this engine has none in {SECRET_ENV}: "
                "start the engine with the trainer's secret in its environment, or let the trainer send it"
            )
        if info.secret_id and secret_fingerprint(secret) != info.secret_id:
            raise LayoutValueError(
                f"this engine's job secret ({SECRET_ENV} where the engine started) is not the trainer's "
                "(their fingerprints differ): give both the same secret"
            )
        if info.lora is not None:
            self._init_adapter(info, secret)
            return
        if info.namespace in self.adapters:
            raise LayoutValueError(
                f"namespace '{info.namespace}' is adapter '{self.adapters[info.namespace].spec.lora_name}''s refit "
                "session on this engine: give the base weights' refit a namespace of its own"
            )
        if info.mode == "attach":
            self._attach(info, secret)
            return
        self.rank, tp_rank = self._program_rank(info.rank_offset)
        self._leave()  # an earlier session (another store, or one that failed) is left first
        # vLLM's update may still be open (a trainer killed between update_weights and
        # finish_weight_update): the finish that ends it applies nothing
        self.abandoned = info.mode == "start"
        refit = RefitProgram(info.program, info.program_path, info.reshard, info.engine_axis)
        joining = info.mode == "join"
        position = refit.position_like(tp_rank) if joining else self.rank
        problems = self._problems(refit, position, tp_rank, info.checkpoint_format)
        if joining and problems:  # a joiner that cannot hold its boxes never asks to join
            raise LayoutValueError(
                f"rank {self.rank}: the engine does not match the destination layout "
                f"({counted(len(problems), 'problem')}):\n  " + "\n  ".join(problems)
            )
        address = info.address
        store = address.connect(serve=False, timeout=info.timeout)
        try:
            self.session = fleet_session(
                refit.program, refit.reshard.name, rank=self.rank, store=store, address=address, secret=secret,
                join=joining, engine_axis=info.engine_axis, timeout=info.timeout, deadline=info.deadline,
                memory_budget=info.memory_budget, device=self.device, problem=None if joining else first_of(problems),
                join_timeout=info.join_timeout, delta=info.delta,
            )
        except AgreementError:
            if problems:  # this worker's own list, whole
                raise LayoutValueError(
                    f"rank {self.rank}: the engine does not match the destination layout "
                    f"({counted(len(problems), 'problem')}):\n  " + "\n  ".join(problems)
                ) from None
            raise
        self.address = address
        session = self.session
        if joining:
            coords = session.destination.mesh.coords(self.rank)
            if coords.get("tp", tp_rank) != tp_rank:
                raise ExecutionError(
                    f"rank {self.rank} took position tp {coords['tp']} but is tensor-parallel rank {tp_rank}: "
                    "engine ranks are allocated in aligned runs (allocate_engine_ranks)",
                    rank=self.rank,
                )
            # the boxes of its position (the same as the representative's), in its own layout
            self.targets = EngineTargets(
                self.model, session.destination, self.rank, engine=f"vLLM's {type(self.model).__name__}",
                checkpoint_format=info.checkpoint_format,
            )
        if info.token and tp_rank == 0:
            write_engine_ranks(store, address, secret, info.token, self._engine_ranks())
        if joining and session.holds_committed:
            # caught up with the last committed step from the other engines (or the trainer):
            # prepared now, applied when the trainer calls start/finish_weight_update
            assert self.targets is not None
            self.prepared, self.staged = self.targets.prepare(session.destinations), session.committed_step

    def _init_adapter(self, info: LayoutlangInitInfo, secret: JobSecret) -> None:
        """Start the refit session of a LoRA adapter (its own namespace): every member agrees
        that this worker can take the adapter before a byte moves."""
        if info.mode != "start":
            raise LayoutValueError(
                f"an adapter's refit session starts with its engines (mode 'start'), not mode '{info.mode}'"
            )
        assert info.lora is not None
        if self.address is not None and info.namespace == self.address.namespace:
            raise LayoutValueError(
                f"namespace '{info.namespace}' is the base weights' refit session on this engine: give the adapter "
                "a namespace of its own"
            )
        spec = AdapterSpec.from_json(info.lora)
        rank, tp_rank = self._program_rank(info.rank_offset)
        self.rank = rank
        earlier = self.adapters.pop(info.namespace, None)
        if earlier is not None:  # the namespace's earlier session (a trainer started again) is left first
            earlier.leave()
        refit = RefitProgram(info.program, info.program_path, info.reshard, info.engine_axis)
        problems = self._position_problems(refit, rank, tp_rank)
        targets = AdapterTargets(self.model, refit.destination, rank, spec, self.vllm_config)
        problems = problems or targets.problems
        address = info.address
        store = address.connect(serve=False, timeout=info.timeout)
        try:
            session = fleet_session(
                refit.program, refit.reshard.name, rank=rank, store=store, address=address, secret=secret,
                engine_axis=info.engine_axis, timeout=info.timeout, deadline=info.deadline,
                memory_budget=info.memory_budget, device=self.device, problem=first_of(problems), delta=info.delta,
            )
        except AgreementError:
            if problems:
                raise LayoutValueError(
                    f"rank {rank}: the engine cannot take adapter '{spec.lora_name}' "
                    f"({counted(len(problems), 'problem')}):\n  " + "\n  ".join(problems)
                ) from None
            raise
        self.adapters[info.namespace] = _AdapterRefit(spec, session, address, targets)

    def _engine_ranks(self) -> list[int]:
        """The ranks of this worker's engine in the session's destination layout."""
        assert self.session is not None
        mesh = self.session.destination.mesh
        axis = mesh.axis_names[0]
        coordinate = mesh.coords(self.rank)[axis]
        return [r for r in mesh.ranks if mesh.coords(r)[axis] == coordinate]

    def _attach(self, info: LayoutlangInitInfo, secret: JobSecret) -> None:
        """A restarted trainer comes back to this worker's session: admit it with the others."""
        session = self.session
        if session is None or self.address != info.address:
            raise ExecutionError(
                f"rank {self.rank}: this engine is not a member of refit session '{info.namespace}' at "
                f"{info.master_address}:{info.master_port}; start it again, or let it join (mode 'join')",
                rank=self.rank,
            )
        session.admit()
        if info.token and session.destination.mesh.coords(self.rank).get("tp", 0) == 0:
            write_engine_ranks(session.store, info.address, secret, info.token, self._engine_ranks())

    def _phase(self, name: str, seconds: float) -> None:
        """Record ``seconds`` of phase ``name`` for the refit under way (the last one)."""
        if not self.phases:
            self.phases.append({})
        self.phases[-1][name] = self.phases[-1].get(name, 0.0) + seconds

    def start_weight_update(self) -> None:
        self._current = None
        for adapter in self.adapters.values():
            adapter.prepared, adapter.abandoned = None, False
        self.phases = [*self.phases[-63:], {}]
        if self.prepared is not None and self.staged is not None and self.staged != self.version:
            return  # a joiner's catch-up, applied by the finish that follows
        self.prepared, self.abandoned = None, False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        namespace = update_info.get("namespace") if isinstance(update_info, dict) else None
        if namespace is not None and (self.address is None or namespace != self.address.namespace):
            self._update_adapter(namespace, update_info)
            return
        # received bytes are on the CPU (gloo) and applied at finish: nothing to synchronize
        error: BaseException | None = None
        self.prepared = None
        began = time.perf_counter()
        try:
            info = self.parse_update_info(update_info)
            if info.discard:
                self.abandoned = True
                return  # every worker is told: nothing to settle
            self.receive_weights(info)
        except Exception as err:  # settled whatever it is: the other workers wait for this one's outcome
            error = err
            if _store_gone(err, self.session):
                # the session's store went with the process that served it (a trainer killed
                # mid-refit): nobody can use the session again, and its heartbeat would retry
                # the dead store until the next init. The model keeps its weights; the next
                # trainer's init starts a new session.
                self._close()
        settling = time.perf_counter()
        settled = self._settle(error)
        self._phase("update.settle", time.perf_counter() - settling)
        self._phase("update", time.perf_counter() - began)
        if not settled:
            # the workers that return keep vLLM's update open: the trainer's finish ends it
            self.prepared, self.abandoned = None, True

    def receive_weights(self, update_info: LayoutlangUpdateInfo) -> None:
        """Receive the step's refit, then prepare it (raises when this worker cannot)."""
        session = self.session
        if session is None:
            raise ExecutionError(
                f"rank {self.rank}: the layoutlang weight transfer is not initialized "
                "(init_weight_transfer_engine failed or was not called, or the session's store went away with "
                "the process that served it: the trainer calls it again)",
                rank=self.rank,
            )
        if update_info.step != session.next_step:
            raise ExecutionError(
                f"rank {self.rank}: the trainer refits step {update_info.step}, but this engine's session is at "
                f"step {session.next_step}",
                rank=self.rank,
            )
        session.refit(update_info.step, lambda step, s: {})
        for name, seconds in session.phases.items():
            self._phase(f"step.{name}", seconds)
        assert self.targets is not None
        preparing = time.perf_counter()
        self.prepared, self.staged = self.targets.prepare(session.destinations), update_info.step
        self._phase("prepare", time.perf_counter() - preparing)

    # ------------------------------------------------------------ adapters
    def _update_adapter(self, namespace: str, update_info: dict[str, Any]) -> None:
        """``update_weights`` of an adapter's session: receive and prepare the step (or discard
        it, or take the adapter out of the engine), settled over the engine's workers."""
        error: BaseException | None = None
        adapter = self._current = self.adapters.get(namespace)
        try:
            if adapter is None:
                raise ExecutionError(
                    f"rank {self.rank}: this engine has no refit session '{namespace}' (its adapter was removed, or "
                    "init_weight_transfer_engine with the adapter's init info failed or was not called)",
                    rank=self.rank,
                )
            adapter.prepared = None
            info = self.parse_update_info(update_info)
            if info.remove:
                adapter.abandoned = True  # the finish that follows applies nothing
                del self.adapters[namespace]
                adapter.targets.remove()
                adapter.leave()
            elif info.discard:
                adapter.abandoned = True
                return
            else:
                self._receive_adapter(adapter, info)
        except Exception as err:  # settled whatever it is
            error = err
            if adapter is not None and _store_gone(err, adapter.session):
                self.adapters.pop(namespace, None)
                adapter.session.close()
        if not self._settle(error) and adapter is not None:
            adapter.prepared, adapter.abandoned = None, True

    def _receive_adapter(self, adapter: _AdapterRefit, info: LayoutlangUpdateInfo) -> None:
        session = adapter.session
        if info.step != session.next_step:
            raise ExecutionError(
                f"rank {self.rank}: the trainer refits step {info.step} of adapter '{adapter.spec.lora_name}', but "
                f"this engine's session of it is at step {session.next_step}",
                rank=self.rank,
            )
        session.refit(info.step, lambda step, s: {})
        adapter.prepared, adapter.staged = adapter.targets.prepare(session.destinations), info.step

    def _finish_adapter(self, adapter: _AdapterRefit) -> None:
        """Swap the prepared adapter in on every worker of the engine, or on none."""
        if adapter.abandoned:
            adapter.prepared, adapter.abandoned = None, False
            return
        prepared, adapter.prepared = adapter.prepared, None
        error = None
        if prepared is None:
            error = ExecutionError(
                f"rank {self.rank}: no prepared refit of adapter '{adapter.spec.lora_name}' to apply; the engine "
                "keeps its previous one",
                rank=self.rank,
            )
        if not self._settle(error) or prepared is None:
            return
        applied: BaseException | None = None
        try:
            adapter.targets.apply(prepared)
            adapter.version = adapter.staged
        except Exception as err:
            applied, adapter.version = err, None
        self._settle(applied)

    def finish_weight_update(self) -> None:
        adapter, self._current = self._current, None
        if adapter is not None:
            self._finish_adapter(adapter)
            return
        if self.abandoned:
            # not settled: the worker whose update raised is refused this call by vLLM (its
            # update is over already), so the others end theirs alone
            self.prepared, self.abandoned = None, False
            return
        began = time.perf_counter()
        prepared, self.prepared = self.prepared, None
        error = None
        if prepared is None:
            error = ExecutionError(
                f"rank {self.rank}: no prepared refit to apply; the engine keeps its previous weights", rank=self.rank
            )
        # every worker of the engine applies, or none
        if not self._settle(error) or prepared is None:
            return
        assert self.targets is not None
        applied: BaseException | None = None
        try:
            self.targets.apply(prepared, self.model_config)
            self.version = self.staged
        except Exception as err:  # vLLM's loaders run here: the model may now hold a mix
            applied, self.version = err, None
        for name, seconds in self.targets.last_apply.items():
            self._phase(f"apply.{name}", seconds)
        self._settle(applied)
        self._phase("finish", time.perf_counter() - began)

    def _close(self) -> None:
        """Close the session without leaving it (its store is gone: there is nobody to tell)."""
        session, self.session = self.session, None
        if session is not None:
            session.close()

    def _leave(self) -> None:
        """Leave the session on purpose (the others shrink the engine axis at their next step)."""
        session, self.session = self.session, None
        if session is not None:
            with contextlib.suppress(RuntimeError, RuntimeFailure):  # its store may be gone
                session.leave()
            session.close()
        self.prepared, self.abandoned = None, False

    def shutdown(self) -> None:
        """Leave every session (the base weights' and each adapter's); the engine keeps serving
        its weights and its adapters."""
        self._leave()
        adapters, self.adapters = self.adapters, {}
        for adapter in adapters.values():
            adapter.leave()


def worker_phases(worker: Any) -> list[dict[str, float]]:
    """The phases of a vLLM worker's recent layoutlang refits (for ``collective_rpc``):
    ``start``, ``update`` (the whole call: ``step.begin``, ``step.agree``, ``step.transfer``,
    ``step.commit`` of the session's step, ``prepare``, ``update.settle``) and ``finish`` (the
    whole call: ``apply.direct`` copies, ``apply.loaded`` through load_weights)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return list(engine.phases) if isinstance(engine, LayoutlangWeightTransferEngine) else []


def worker_raw_exchange(worker: Any, repeats: int = 3) -> list[float]:
    """A vLLM worker's part of :meth:`~elastic.ElasticSession.raw_exchange` (for
    ``collective_rpc``; the trainer ranks and every other member call it at once)."""
    engine = worker.weight_transfer_engine
    if not isinstance(engine, LayoutlangWeightTransferEngine) or engine.session is None:
        raise ExecutionError("this worker has no layoutlang refit session", rank=-1)
    return engine.session.raw_exchange(repeats)


class LayoutlangWorkerExtension:
    """Methods vLLM mixes into its workers (``LLM(worker_extension_cls=...)`` with this class's
    qualified name) so that ``collective_rpc`` reaches them by name, with no pickled callable:
    ``layoutlang_phases`` (:func:`worker_phases`) and ``layoutlang_raw_exchange``
    (:func:`worker_raw_exchange`). For benchmarks and profiling."""

    def layoutlang_phases(self) -> list[dict[str, float]]:
        return worker_phases(self)

    def layoutlang_raw_exchange(self, repeats: int = 3) -> list[float]:
        return worker_raw_exchange(self, repeats)


def _store_gone(error: BaseException, session: ElasticSession | None) -> bool:
    """Whether ``error`` (or what caused it) is the session's store going away: torch's
    ``DistNetworkError`` (connection reset, broken pipe, refused), and the store no longer
    answers (a peer's broken connection is not the store's)."""
    import torch.distributed as dist

    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes, bounded
        if seen is None or session is None:
            return False
        if isinstance(seen, dist.DistNetworkError):
            try:
                session.store.check(["layoutlang-probe"])
            except RuntimeError:  # DistNetworkError, DistStoreError: nobody serves it now
                return True
            return False
        seen = seen.__cause__ or seen.__context__
    return False
