"""The inference side: layoutlang as a vLLM ``WeightTransferEngine``.

vLLM builds one per worker when the engine is started with
``weight_transfer_config={"backend": "layoutlang"}`` (the plugin registered by the
``vllm.general_plugins`` entry point of this package). Its lifecycle is vLLM's:

``init_transfer_engine``
    joins the refit group, compiles the program, resolves every destination storage
    against the worker's own model (:class:`~.targets.EngineTargets`) and takes part in the
    plan agreement: a mismatch on any worker fails the init on every rank of the refit,
    naming the parameter and the rank, before a byte moves.
``start_weight_update``
    forgets any incomplete refit.
``update_weights``
    receives this worker's boxes into staging buffers (allocated once).
``finish_weight_update``
    applies them: direct copies into parameters vLLM keeps as loaded, vLLM's own
    ``load_weights`` (layerwise reload, post-processing included) for the others.

A refit that fails while bytes move leaves the model untouched: nothing is applied before
``finish_weight_update``, which the trainer calls only after every worker of every engine
received everything. The engine then serves the previous weights, bit for bit, and the
trainer has the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ...errors import AgreementError, ExecutionError, LayoutError, LayoutValueError
from ...lang import loads
from ...runtime import Resharder
from ..refit_group import RefitGroup
from .common import RefitProgram, WorkerInitFields, first_of
from .targets import EngineTargets

__all__ = ["LayoutlangInitInfo", "LayoutlangUpdateInfo", "LayoutlangWeightTransferEngine"]


@dataclass(kw_only=True)
class LayoutlangInitInfo(WorkerInitFields, WeightTransferInitInfo):
    """Worker-side init info (see :class:`~.common.WorkerInitFields`)."""


@dataclass
class LayoutlangUpdateInfo(WeightTransferUpdateInfo):
    """Per-refit info: its number, for messages (the plan was fixed at init)."""

    refit: int = 0


class LayoutlangWeightTransferEngine(WeightTransferEngine[LayoutlangInitInfo, LayoutlangUpdateInfo]):
    """One vLLM worker's side of a layoutlang refit."""

    init_info_cls = LayoutlangInitInfo
    update_info_cls = LayoutlangUpdateInfo
    # the plan is resolved against the model it was built for
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: RefitGroup | None = None
        self.resharder: Resharder | None = None
        self.targets: EngineTargets | None = None
        self.received: dict[str, torch.Tensor] = {}
        self.complete = False
        self.rank = -1

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

    def _problems(self, refit: RefitProgram, tp_rank: int, checkpoint_format: bool) -> list[str]:
        layout = refit.destination
        if self.rank not in layout.mesh.ranks:
            return [f"rank {self.rank} (this worker) is not in mesh '{layout.mesh.name}' of layout '{layout.name}'"]
        coords = layout.mesh.coords(self.rank)
        tp = self.parallel_config.tensor_parallel_size
        sizes = dict(layout.mesh.axes)
        if "tp" in coords and (coords["tp"] != tp_rank or sizes["tp"] != tp):
            return [
                (
                    f"rank {self.rank} is tp {coords['tp']} of {sizes['tp']} in mesh '{layout.mesh.name}', "
                    f"but tensor-parallel rank {tp_rank} of {tp} in the engine (check rank_offset)"
                )
            ]
        engine = f"vLLM's {type(self.model).__name__}"
        self.targets = EngineTargets(self.model, layout, self.rank, engine=engine, checkpoint_format=checkpoint_format)
        return self.targets.problems

    def _settle(self, error: BaseException | None) -> None:
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
            return
        self.complete = False
        if group.rank_in_group != group.world_size - 1:
            return
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
        except (LayoutError, ExecutionError, AgreementError) as err:
            error = err
        self._settle(error)

    def _init(self, init_info: LayoutlangInitInfo) -> None:
        self.rank, tp_rank = self._program_rank(init_info.rank_offset)
        self.shutdown()  # a group of an earlier init (failed or replaced) is left first
        self.group = RefitGroup(
            init_info.master_address,
            init_info.master_port,
            self.rank,
            init_info.world_size,
            host_store=False,
            name=init_info.group_name,
            timeout=init_info.timeout,
        )
        problems: list[str] = []
        refit: RefitProgram | None = None
        try:
            refit = RefitProgram(init_info.program, init_info.program_path, init_info.reshard)
            problems = self._problems(refit, tp_rank, init_info.checkpoint_format)
        except LayoutError as err:
            problems = [str(err)]
        try:
            self.resharder = Resharder(
                refit.program if refit is not None else loads(""),
                init_info.reshard,
                rank=self.rank,
                rank_map={r: r for r in range(init_info.world_size)},
                transport=self.group.transport,
                timeout=init_info.timeout,
                problem=first_of(problems),
            )
        except AgreementError:
            if problems:  # this worker's own list, whole
                raise LayoutValueError(
                    f"rank {self.rank}: the engine does not match the destination layout "
                    f"({len(problems)} problems):\n  " + "\n  ".join(problems)
                ) from None
            raise
        assert self.targets is not None
        self.received = self.targets.staging()

    def start_weight_update(self) -> None:
        self.complete = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # received bytes are on the CPU (gloo) and applied at finish: nothing to synchronize
        error: BaseException | None = None
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except (LayoutError, ExecutionError, ValueError) as err:
            error = err
        self._settle(error)

    def receive_weights(self, update_info: LayoutlangUpdateInfo) -> None:
        if self.resharder is None:
            raise ExecutionError(
                f"rank {self.rank}: the layoutlang weight transfer is not initialized "
                "(init_weight_transfer_engine failed or was not called)",
                rank=self.rank,
            )
        self.complete = False
        try:
            self.resharder.run({}, self.received)
        except (ExecutionError, LayoutError):
            assert self.group is not None
            self.group.transport.abort()  # the group is spent: the trainer initializes again
            raise
        self.complete = True

    def finish_weight_update(self) -> None:
        # every worker of the engine applies, or none: a worker without a complete refit
        # stops them all (the settled outcome of update_weights already says so)
        error = None
        if not self.complete:
            error = ExecutionError(
                f"rank {self.rank}: no complete refit to apply; the engine keeps its previous weights", rank=self.rank
            )
        self._settle(error)
        if error is None and self.complete:
            assert self.targets is not None
            self.targets.apply(self.received, self.model_config)
        self.complete = False

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None
        self.resharder = None
        self.complete = False
