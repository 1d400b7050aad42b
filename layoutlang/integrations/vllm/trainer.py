"""The trainer side: layoutlang as a vLLM ``TrainerWeightTransferEngine``.

Every trainer rank calls :meth:`LayoutlangTrainerWeightTransferEngine.trainer_init` with
its own rank and the same program, and :meth:`send_weights` after every optimizer step.
Each rank sends the boxes of its own shards that the plan gives it (its FSDP2 / TP / EP
``to_local()``): no rank gathers a whole tensor. Rank 0 (the sender) also serves the refit
group's store and drives the inference side through the clients, one per engine:
``init_weight_transfer_engine`` with each engine's ``rank_offset``, then per refit
``start_weight_update``, ``update_weights`` (while the trainer ranks send) and, once every
worker of every engine has received everything, ``finish_weight_update``. If anything
fails, no engine applies the refit: each keeps serving its previous weights.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    materialize_full_tensor,
)

from ..._text import rank_ranges
from ...errors import ExecutionError
from ...runtime import Resharder
from ..dtensor import local_storages, state_dict_problems
from ..refit_group import RefitGroup
from .common import BACKEND, RefitProgram, WorkerInitFields, first_of

__all__ = [
    "LayoutlangTrainerInitInfo",
    "LayoutlangTrainerWeightTransferEngine",
    "OfflineLLMClient",
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
    """Trainer-side init info; ``rank`` is this trainer process's rank (program rank)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    program: str
    program_path: str | None = None
    reshard: str | None = None
    #: first program rank of each engine, in the order of the clients; default: the
    #: destination mesh's ranks cut into as many equal runs as there are clients
    engine_rank_offsets: list[int] | None = None
    timeout: float = 300.0
    group_name: str = "layoutlang-refit"
    #: send sources of another dtype (fp32 master weights) as the program declares them
    cast_sources: bool = False
    #: the destination layout names checkpoint tensors (see WorkerInitFields)
    checkpoint_format: bool = False


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
        group: RefitGroup,
        resharder: Resharder,
        cast_sources: bool,
        timeout: float,
        engine_offsets: Sequence[int] = (),
    ):
        super().__init__(client=clients[0] if clients else None, source=source, is_sender=rank == 0)
        self.clients = list(clients)
        self.rank = rank
        self.refit = refit
        self.group = group
        self.resharder = resharder
        self.cast_sources = cast_sources
        self.timeout = timeout
        self.refits = 0
        # each engine's program ranks, for messages
        ranks = sorted(refit.destination.mesh.ranks)
        self.engine_ranks: list[list[int]] = []
        if engine_offsets:
            bounds = [*engine_offsets, ranks[-1] + 1]
            self.engine_ranks = [[r for r in ranks if lo <= r < hi] for lo, hi in itertools.pairwise(bounds)]

    @classmethod
    def trainer_init(
        cls,
        init_info: LayoutlangTrainerInitInfo,
        *,
        client: Any,
        source: WeightSource | torch.nn.Module | Mapping[str, Any] | None = None,
    ) -> LayoutlangTrainerWeightTransferEngine:
        """Join the refit group (rank 0 serves it and initializes every engine), compile and
        agree on the plan. ``client`` is one client per engine (a sequence), or one."""
        if source is None:
            raise ValueError("the layoutlang trainer engine needs the trainer's weights (source=)")
        weights = source if isinstance(source, StateDictSource) else StateDictSource(source)
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        refit = RefitProgram(init_info.program, init_info.program_path, init_info.reshard)
        world = refit.world_size()
        rank = init_info.rank
        offsets: list[int] = []
        if init_info.is_sender:
            offsets = init_info.engine_rank_offsets or _even_offsets(refit.destination.mesh.ranks, len(clients))
            if len(offsets) != len(clients):
                raise ValueError(f"{len(clients)} clients but {len(offsets)} engine_rank_offsets")
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(clients)), thread_name_prefix="layoutlang-init")
        futures = []
        if init_info.is_sender:
            for client_, offset in zip(clients, offsets):
                fields = WorkerInitFields(
                    master_address=init_info.master_address,
                    master_port=init_info.master_port,
                    program=init_info.program,
                    program_path=init_info.program_path,
                    reshard=refit.reshard.name,
                    rank_offset=offset,
                    world_size=world,
                    timeout=init_info.timeout,
                    group_name=init_info.group_name,
                    checkpoint_format=init_info.checkpoint_format,
                )
                futures.append(pool.submit(client_.init_weight_transfer_engine, asdict(fields)))
        try:
            group = RefitGroup(
                init_info.master_address,
                init_info.master_port,
                rank,
                world,
                host_store=init_info.is_sender,
                name=init_info.group_name,
                timeout=init_info.timeout,
            )
            problems = state_dict_problems(refit.source, weights.state_dict(), rank, allow_dtype=init_info.cast_sources)
            problem = first_of(problems)
            resharder = Resharder(
                refit.program,
                refit.reshard.name,
                rank=rank,
                rank_map={r: r for r in range(world)},
                transport=group.transport,
                timeout=init_info.timeout,
                problem=problem,
            )
        finally:
            _raise_first(futures, init_info.timeout)
            pool.shutdown(wait=False)
        return cls(
            clients=clients,
            source=weights,
            rank=rank,
            refit=refit,
            group=group,
            resharder=resharder,
            cast_sources=init_info.cast_sources,
            timeout=init_info.timeout,
            engine_offsets=offsets,
        )

    def _sources(self) -> tuple[dict[str, torch.Tensor], str | None]:
        """This rank's local shards, or what is wrong with them (then every rank stops)."""
        assert isinstance(self.source, StateDictSource)
        weights = self.source.state_dict()
        layout = self.refit.source
        problems = state_dict_problems(layout, weights, self.rank, allow_dtype=self.cast_sources)
        if problems:
            return {}, f"rank {self.rank}'s weights do not match layout '{layout.name}': " + "; ".join(problems[:3])
        return local_storages(layout, weights, self.rank, checked=False), None

    def _control(self, index: int, what: str, call: Any) -> None:
        """One control-plane call to engine ``index``; its failure names the engine."""
        try:
            call()
        except Exception as err:
            ranks = self.engine_ranks[index] if index < len(self.engine_ranks) else []
            raise ExecutionError(
                f"rank {self.rank}: engine {index} (program ranks {rank_ranges(ranks)}) could not {what}: "
                f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} "
                "(its workers may have died); no engine applies this refit",
                rank=self.rank,
                peers=ranks,
            ) from err

    def send_weights(self) -> None:
        """Refit every engine from this rank's current weights (called on every trainer rank)."""
        self.refits += 1
        sources, not_ready = self._sources()
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.clients)), thread_name_prefix="layoutlang-refit")
        futures = []
        error: BaseException | None = None
        try:
            try:
                if self.is_sender:
                    for index, client in enumerate(self.clients):
                        self._control(index, "start the weight update", client.start_weight_update)
                    update = {"refit": self.refits}
                    futures = [pool.submit(client.update_weights, dict(update)) for client in self.clients]
                self.resharder.run(sources, {}, cast_sources=self.cast_sources, not_ready=not_ready)
            except Exception as err:
                # an engine that cannot start the update (dead), or an exchange that failed
                error = err
                # every member's pending exchange with this rank fails now, not at its deadline;
                # the group is spent: trainer_init again to refit after a failure
                self.group.transport.abort()
            # the engines' errors name their ranks; this rank's own comes first
            _raise_first(futures, self.timeout, first=error)
            if self.is_sender:
                for index, client in enumerate(self.clients):
                    self._control(index, "apply the refit", lambda c=client: c.finish_weight_update(str(self.refits)))
        finally:
            pool.shutdown(wait=False)

    def shutdown(self) -> None:
        if self.is_sender:
            for client in self.clients:
                stop = getattr(client, "shutdown_weight_transfer_engine", None)
                if stop is not None:
                    stop()
        self.group.close()


def _even_offsets(ranks: Sequence[int], engines: int) -> list[int]:
    ranks = sorted(ranks)
    if engines < 1 or len(ranks) % engines:
        raise ValueError(f"{len(ranks)} destination ranks cannot be cut into {engines} equal engines")
    per = len(ranks) // engines
    return [ranks[i * per] for i in range(engines)]


def _raise_first(
    futures: Sequence[concurrent.futures.Future[Any]], timeout: float, first: BaseException | None = None
) -> None:
    """Wait for every control-plane call; raise ``first``, else the first call's error."""
    errors = [first] if first is not None else []
    concurrent.futures.wait(futures, timeout=timeout + 30)
    errors += [f.exception() or ExecutionError("an engine did not answer in time") for f in futures if _failed(f)]
    if errors:
        raise errors[0]


def _failed(future: concurrent.futures.Future[Any]) -> bool:
    return not future.done() or future.exception(timeout=0) is not None
