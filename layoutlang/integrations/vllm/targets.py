"""Where each destination storage lands in a live vLLM model, and how it is applied.

For every storage the destination layout gives this worker, the model must hold a
parameter of that name whose shape, as vLLM created it, is the storage's (vLLM records
each parameter's created shape before post-processing; the CPU backend, for one, repacks
linear weights after loading, and ``named_parameters()`` then shows ``[0]``); in an engine
with LoRA enabled, ``X.weight`` is the parameter ``X.base_layer.weight`` of the LoRA layer
wrapping ``X``. Three ways in:

* **direct**: the parameter's module transforms nothing after loading (no quantization
  method, or one whose ``process_weights_after_loading`` is the base class's no-op, and no
  post-processing of its own): the received storage is copied into the parameter as is.
* **repacked** (vLLM's CPU backend): a linear or embedding layer that vLLM loads as is and
  then repacks for its CPU GEMM (``dispatch_cpu_unquantized_gemm``: a oneDNN or sgl-kernel
  handle, the weight itself removed from linear layers). The received storage is the weight
  as created; :meth:`EngineTargets.prepare` packs a copy of it off to the side, as vLLM's own
  post-processing does, and :meth:`EngineTargets.apply` swaps the packed GEMM in (and copies
  the weight of an embedding, which keeps it): no ``load_weights``, no reload lifecycle, and
  the packing runs before the apply, so the apply across engines stays a few pointer swaps.
* **loaded**: anything else. The received boxes are handed to the model's own
  ``load_weights`` under vLLM's layerwise-reload lifecycle
  (``initialize_layerwise_reload`` on the modules concerned, ``finalize_layerwise_reload``
  after), which re-runs the post-processing. ``load_weights`` takes checkpoint-named whole
  tensors and narrows them itself, so each logical tensor is passed as a tensor of its whole
  shape holding this worker's boxes (its other elements are never read by the loader; the
  layout is what says which elements vLLM's loaders read: see the presets). Only the
  boxes cross the network; the whole-shape tensor is a local temporary, one at a time.

The choice is fail-closed: a module not known to keep its weights as loaded goes through
``load_weights``.

A received refit reaches the model in two phases, so that every engine of a fleet applies it
or none does: :meth:`EngineTargets.prepare` does every check that can fail without writing
the model (the received storages against what the model holds *now*: a parameter replaced,
reshaped or cast since the targets were resolved is refused, naming it; the boxes of each
``load_weights`` tensor against the storage they are read from) and returns a
:class:`PreparedRefit`; :meth:`EngineTargets.apply` then only writes: a copy into each direct
parameter, and vLLM's own loader for the others (whose post-processing only vLLM can run, so
it runs at apply; its inputs were checked by the prepare).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..._text import counted
from ...errors import ExecutionError, did_you_mean
from ...io.torch_dtypes import torch_dtype
from ...model import Box, Layout

__all__ = ["EngineTargets", "PreparedRefit", "received_problems"]


def received_problems(
    layout: Layout,
    shapes: Mapping[str, tuple[int, ...]],
    dtype_of: Callable[[str], str],
    received: Mapping[str, torch.Tensor],
) -> list[str]:
    """What is wrong with the storages a worker received against those of ``layout`` it holds
    (``shapes``, each storage's dtype named by ``dtype_of``): one missing, or received in
    another shape or dtype."""
    problems = []
    for storage, shape in shapes.items():
        dtype = torch_dtype(dtype_of(storage))
        tensor = received.get(storage)
        if tensor is None:
            problems.append(f"storage '{storage}' was not received")
        elif tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            problems.append(
                f"storage '{storage}' was received as {list(tensor.shape)} {tensor.dtype}, "
                f"layout '{layout.name}' gives {list(shape)} {dtype}"
            )
    return problems


def _recorded(module: torch.nn.Module, leaf: str) -> torch.Tensor | None:
    """The parameter as vLLM created it, before any post-processing (a meta tensor), when vLLM
    recorded it for reloading; None for parameters that post-processing made, and for the few
    it never reloads (``e_score_correction_bias``)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    return None if info is None else info.restore_metadata[0].get(leaf)


def _prepack_cpu_experts(modules: Iterable[torch.nn.Module]) -> None:
    """Repack MoE experts for the CPU kernel after a weight update, as a first load does.

    vLLM 0.32's ``UnquantizedFusedMoEMethod.process_weights_after_loading`` runs the experts
    kernel's own ``process_weights_after_loading`` only on the first load (``if not
    is_weight_update``); on the CPU that is the VNNI prepack (``cpu_moe.py``:
    ``cpu_prepack_moe_weight``), so after any reload, vLLM's own included, the kernel reads
    the loaded weights as if packed and a MoE model generates other tokens. Found by
    tests/test_vllm_engine.py (a Qwen3-MoE refit against a fresh engine).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in {id(m): m for m in modules}.values():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        process = getattr(getattr(kernel, "fused_experts", None), "process_weights_after_loading", None)
        if process is not None:
            process(module)


def _derived(module: torch.nn.Module, leaf: str) -> bool:
    """Whether post-processing made this parameter (MLA's ``W_UV`` and ``W_UK_T``, from
    ``kv_b_proj``): vLLM records every loaded parameter for reloading, except the few it
    names in ``SKIP_TENSORS`` (biases, ``e_score_correction_bias``), which are loaded too."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    return leaf not in SKIP_TENSORS and _recorded(module, leaf) is None


def _created_shape(module: torch.nn.Module, leaf: str, param: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype vLLM created the parameter with (before any post-processing)."""
    meta = _recorded(module, leaf)
    if meta is not None:
        return tuple(meta.shape), meta.dtype
    return tuple(param.shape), param.dtype


def _cpu_repack(module: torch.nn.Module, leaf: str, created: tuple[int, ...]) -> bool | None:
    """For a weight that vLLM's CPU backend only repacks after loading (its unquantized linear
    and embedding methods, whose post-processing is ``dispatch_cpu_unquantized_gemm`` and no
    more): whether that repack removes the weight (linear layers) or keeps it (embeddings);
    None for anything else (fail-closed: such a weight goes through ``load_weights``)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or leaf != "weight" or len(created) != 2:
        return None
    if "process_weights_after_loading" in type(module).__dict__ or getattr(module, "_cpu_skip_gemm_dispatch", False):
        return None
    if not callable(getattr(module, "cpu_linear", None)):
        return None
    bias = getattr(module, "bias", None)
    if bias is not None and bias.dtype != torch.float32:  # the sgl kernel's repack casts the bias in place
        return None
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = type(getattr(module, "quant_method", None))
    if method is UnquantizedLinearMethod:
        return True
    if method is UnquantizedEmbeddingMethod:
        return False
    return None


class _Packed:
    """What vLLM's CPU GEMM dispatch reads and writes of a layer, off to the side of the live
    one: a weight (the received storage, or a copy of it where the packed GEMM would read the
    tensor itself) and the layer's bias; the dispatch sets ``cpu_linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias
        self.cpu_linear: Callable[..., torch.Tensor] | None = None


def _keeps_weights_as_loaded(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    if "process_weights_after_loading" in type(module).__dict__:
        return False
    method = getattr(module, "quant_method", None)
    if method is None:
        return True
    own = type(method).process_weights_after_loading
    return own is QuantizeMethodBase.process_weights_after_loading


@dataclass(frozen=True)
class PreparedRefit:
    """A received refit, checked against the live model and ready to be written into it.

    ``copies``: (live parameter, received storage) pairs of identical shape and dtype, each
    written by one copy; ``repacks``: (live module, its CPU GEMM packed from the received
    weight) pairs, each swapped in; ``loaded``: the storages handed to the model's ``load_weights``,
    whose boxes were checked against the received storages; ``received``: every received
    storage, by name (kept until applied: the refit's own buffers, not copies).
    """

    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    loaded: tuple[str, ...]
    received: dict[str, torch.Tensor]
    repacks: tuple[tuple[torch.nn.Module, Callable[..., torch.Tensor]], ...] = ()


def _signature(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, torch.device, bool]:
    """What a write into a parameter relies on: its shape, dtype, device and contiguity."""
    return tuple(tensor.shape), tensor.dtype, tensor.device, tensor.is_contiguous()


def _describe(signature: tuple[tuple[int, ...], torch.dtype, torch.device, bool]) -> str:
    shape, dtype, device, contiguous = signature
    return f"{list(shape)} {dtype} on {device}" + ("" if contiguous else " (not contiguous)")


def _lora_base_names(parameters: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A LoRA engine's base weights by the names they have without LoRA: vLLM's LoRA layers
    (``vllm/lora/layers/``) hold the layer they adapt as ``base_layer``, so the model's
    ``X.weight`` is the engine's ``X.base_layer.weight`` there."""
    return {name.replace(".base_layer.", "."): name for name in parameters if ".base_layer." in name}


class EngineTargets:
    """This worker's destination storages, resolved against the live model.

    :attr:`problems` lists every mismatch (a storage the engine lacks, a shape or dtype that
    differs, a parameter the layout does not deliver); nothing is applied while it is not
    empty. :meth:`staging` gives the buffers a refit receives into; :meth:`prepare` checks a
    received refit against the model as it is then, and :meth:`apply` writes a prepared one.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Layout,
        rank: int,
        *,
        engine: str = "the engine",
        checkpoint_format: bool = False,
    ):
        self.model = model
        self.layout = layout
        self.rank = rank
        self.problems: list[str] = []
        self.direct: dict[str, torch.Tensor] = {}  # storage -> live parameter
        self.loaded: dict[str, torch.nn.Module] = {}  # storage -> the module whose loader takes it
        # storage -> (module, whether its repack removes the weight): packed aside, swapped in
        self.repacked: dict[str, tuple[torch.nn.Module, bool]] = {}
        self._owns_copy: dict[str, bool] = {}  # storage -> its packed GEMM owns its weight's copy
        # storage -> the parameter as resolved: a prepare refuses a model changed since
        self._resolved: dict[str, tuple[torch.Tensor, tuple[tuple[int, ...], torch.dtype, torch.device, bool]]] = {}
        #: seconds of the last apply: ``direct`` copies, ``loaded`` (load_weights, post-processing)
        self.last_apply: dict[str, float] = {}
        self.shapes = layout.storages_on(rank)
        if checkpoint_format:
            self._checkpoint_names(engine)
            return
        modules = dict(model.named_modules())
        parameters = dict(model.named_parameters())
        #: storage -> the engine's name of its parameter, where they differ (a LoRA engine's)
        self.parameter_names: dict[str, str] = {}
        wrapped = _lora_base_names(parameters)
        for storage, shape in self.shapes.items():
            name = storage if storage in parameters else wrapped.get(storage, storage)
            param = parameters.get(name)
            if param is None:
                hint = did_you_mean(storage, parameters)
                self.problems.append(
                    f"{engine} has no parameter '{storage}' (rank {rank}'s storage in layout '{layout.name}')"
                    + (f"; {hint}" if hint else "")
                )
                continue
            if name != storage:
                self.parameter_names[storage] = name
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            created, dtype = _created_shape(module, leaf, param)
            want_dtype = torch_dtype(layout.tensors[layout.storage(storage, rank).parts[0]].dtype)
            if created != tuple(shape):
                self.problems.append(
                    f"parameter '{storage}' on rank {rank}: {engine} holds {list(created)}, "
                    f"layout '{layout.name}' delivers {list(shape)}"
                )
            elif dtype != want_dtype:
                self.problems.append(
                    f"parameter '{storage}' on rank {rank}: {engine} holds {dtype}, the program declares "
                    f"{want_dtype} (declare the engine's dtype in the program)"
                )
            elif _keeps_weights_as_loaded(module) and tuple(param.shape) == created and param.is_contiguous():
                self.direct[storage] = param
            elif (removes := _cpu_repack(module, leaf, created)) is not None and (
                tuple(param.shape) != created or param.is_contiguous()
            ):
                self.repacked[storage] = (module, removes)
                if tuple(param.shape) == created:  # kept (an embedding's lookup, the fallback GEMM reads it)
                    self.direct[storage] = param
            else:
                self.loaded[storage] = module
            self._resolved[storage] = (param, _signature(param))
        missing = sorted(set(parameters) - {self.parameter_names.get(storage, storage) for storage in self.shapes})
        for name in missing:
            owner, _, leaf = name.rpartition(".")
            if _derived(modules[owner], leaf):
                continue
            self.problems.append(
                f"parameter '{name}' of {engine} on rank {rank} is not delivered by layout '{layout.name}' "
                "(it would keep its old values)"
            )
        self._index_boxes()

    def _checkpoint_names(self, engine: str) -> None:
        """Every storage is a checkpoint tensor, handed to load_weights (the whole model reloads)."""
        for storage in self.shapes:
            parts = self.layout.storage(storage, self.rank).parts
            if list(parts) != [storage]:
                self.problems.append(
                    f"storage '{storage}' of layout '{self.layout.name}' fuses {len(parts)} tensors: in checkpoint "
                    f"format every storage is one checkpoint tensor, which {engine}'s load_weights takes"
                )
            self.loaded[storage] = self.model
        self._index_boxes()

    def _index_boxes(self) -> None:
        # storage -> the boxes of each logical tensor it holds, for load_weights
        self._boxes: dict[str, dict[str, list[Box]]] = defaultdict(dict)
        for storage in self.loaded:
            for tensor in self.layout.storage(storage, self.rank).parts:
                boxes = [b for b in self.layout.boxes(tensor, self.rank) if b.storage == storage]
                if boxes:
                    self._boxes[storage][tensor] = boxes

    def summary(self) -> str:
        return (
            f"{len(self.direct)} parameters written directly, {len(self.repacked)} repacked for the CPU GEMM, "
            f"{len(self.loaded)} through load_weights"
        )

    def staging(self) -> dict[str, torch.Tensor]:
        """One receive buffer per storage, in the program's dtype (allocated once, reused)."""
        out = {}
        for storage, shape in self.shapes.items():
            dtype = torch_dtype(self.layout.tensors[self.layout.storage(storage, self.rank).parts[0]].dtype)
            out[storage] = torch.empty(shape, dtype=dtype)
        return out

    def _whole_tensors(self, storage: str, received: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """Each logical tensor of ``storage`` at its whole shape, holding this rank's boxes."""
        shape = self.layout.parts_shape(storage, self.rank)
        assert shape is not None  # a storage this rank holds
        parts = received.view(shape)
        for tensor, boxes in self._boxes[storage].items():
            logical = self.layout.tensors[tensor]
            whole = torch.empty(tuple(logical.shape), dtype=received.dtype)
            for box in boxes:
                region = parts[box.storage_index()]
                whole[box.slices()] = region.transpose(-1, -2) if box.transposed else region
            yield tensor, whole

    def prepare(self, received: dict[str, torch.Tensor]) -> PreparedRefit:
        """Check a received refit against the model as it is now, writing nothing; raises
        :class:`~layoutlang.errors.ExecutionError` listing every problem.

        A model can change after its targets were resolved (a parameter replaced, reshaped or
        cast by other code in the engine): a direct copy would then write into a tensor the
        model no longer reads, or cast silently, so every storage's parameter must still be
        the one resolved, with its shape, dtype, device and contiguity."""
        layout, rank = self.layout, self.rank
        problems = received_problems(
            layout, self.shapes, lambda storage: layout.tensors[layout.storage(storage, rank).parts[0]].dtype, received
        )
        live = dict(self.model.named_parameters()) if self._resolved else {}
        for storage, (param, signature) in self._resolved.items():
            now = live.get(self.parameter_names.get(storage, storage))
            if now is None:
                problems.append(f"the model no longer has parameter '{storage}'")
            elif now is not param:
                problems.append(f"parameter '{storage}' was replaced by another tensor since the weight transfer began")
            elif _signature(now) != signature:
                problems.append(
                    f"parameter '{storage}' changed since the weight transfer began: it was "
                    f"{_describe(signature)}, it is {_describe(_signature(now))}"
                )
        if not problems:
            for storage in self.loaded:
                problems.extend(self._box_problems(storage, received[storage]))
        if problems:
            raise ExecutionError(
                f"rank {self.rank} cannot apply the refit ({counted(len(problems), 'problem')}): "
                + "; ".join(problems[:5])
                + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
                rank=self.rank,
            )
        copies = tuple((param, received[storage]) for storage, param in self.direct.items())
        return PreparedRefit(
            copies=copies, loaded=tuple(self.loaded), received=dict(received), repacks=self._repack(received)
        )

    def _repack(self, received: dict[str, torch.Tensor]) -> tuple[tuple[torch.nn.Module, Callable[..., Any]], ...]:
        """Each repacked storage's CPU GEMM, packed as vLLM's post-processing packs it, from the
        received weight (from a copy of it where the GEMM would read that tensor: the receive
        buffers are the next refit's): nothing live is written."""
        if not self.repacked:
            return ()
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        out = []
        for storage, (module, removes) in self.repacked.items():
            weight = received[storage]
            if not self._packs_own_copy(storage, weight, dispatch_cpu_unquantized_gemm):
                weight = weight.clone()
            packed = _Packed(weight, getattr(module, "bias", None))
            dispatch_cpu_unquantized_gemm(cast(torch.nn.Module, packed), remove_weight=removes)
            if packed.cpu_linear is None:
                raise ExecutionError(f"rank {self.rank}: vLLM's CPU GEMM dispatch packed nothing for '{storage}'",
                                     rank=self.rank)
            out.append((module, packed.cpu_linear))
        return tuple(out)

    def _packs_own_copy(self, storage: str, like: torch.Tensor, dispatch: Callable[..., None]) -> bool:
        """Whether the CPU GEMM that vLLM packs for ``storage`` owns a copy of the weight it was
        packed from (oneDNN reorders it, the sgl kernel converts it) rather than reading that
        tensor (zentorch's unpacked path, the fallback ``F.linear``). Found once per storage,
        by packing a zeroed weight, filling it, and calling the GEMM again: when it owns its
        copy the receive buffer is packed from where it lies, else from a copy of it (the
        receive buffers are the next refit's)."""
        owns = self._owns_copy.get(storage)
        if owns is None:
            module, removes = self.repacked[storage]
            bias = getattr(module, "bias", None)
            weight = torch.zeros_like(like)
            probe = _Packed(weight, None if bias is None else torch.zeros_like(bias))
            try:
                dispatch(cast(torch.nn.Module, probe), remove_weight=removes)
                assert probe.cpu_linear is not None
                x = torch.ones(1, like.shape[-1], dtype=like.dtype)
                before = probe.cpu_linear(x, probe.weight, probe.bias).clone()
                weight.fill_(1)  # the tensor it was packed from (a removed weight is another one now)
                owns = bool(torch.equal(probe.cpu_linear(x, probe.weight, probe.bias), before))
            except Exception:  # whatever it is: copy
                owns = False
            self._owns_copy[storage] = owns
        return owns

    def _box_problems(self, storage: str, received: torch.Tensor) -> list[str]:
        """Whether every box of ``storage`` reads from the received storage a region of the
        shape it fills in its logical tensor (checked on meta tensors: nothing is allocated)."""
        shape = self.layout.parts_shape(storage, self.rank)
        if shape is None or received.numel() != torch.Size(shape).numel():
            return [f"storage '{storage}' holds {received.numel()} elements, its parts make {shape}"]
        parts = torch.empty(shape, dtype=received.dtype, device="meta")
        out = []
        for tensor, boxes in self._boxes[storage].items():
            whole = torch.empty(tuple(self.layout.tensors[tensor].shape), dtype=received.dtype, device="meta")
            for box in boxes:
                region = parts[box.storage_index()]
                if box.transposed:
                    region = region.transpose(-1, -2)
                target = whole[box.slices()]
                if region.shape != target.shape:
                    out.append(
                        f"a box of '{tensor}' in storage '{storage}' reads {list(region.shape)}, "
                        f"fills {list(target.shape)}"
                    )
        return out

    def apply(self, prepared: PreparedRefit, model_config: Any) -> None:
        """Write a prepared refit into the model: direct copies (the same shapes and dtypes,
        checked by :meth:`prepare`), then vLLM's ``load_weights`` for the others."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        began = time.perf_counter()
        self.last_apply = {}
        with torch.no_grad():
            for param, value in prepared.copies:
                param.data.copy_(value)
            for module, linear in prepared.repacks:
                setattr(module, "cpu_linear", linear)  # noqa: B010 (a module attribute torch types as a tensor)
            self.last_apply["direct"] = time.perf_counter() - began
            if not prepared.loaded:
                return
            began = time.perf_counter()
            modules = [self.loaded[storage] for storage in prepared.loaded]
            for module in {id(m): m for m in modules}.values():
                initialize_layerwise_reload(module)
            load_weights = cast(Callable[[Iterable[tuple[str, torch.Tensor]]], object], self.model.load_weights)
            for storage in prepared.loaded:
                for name, whole in self._whole_tensors(storage, prepared.received[storage]):
                    load_weights([(name, whole)])
            finalize_layerwise_reload(self.model, model_config)
            _prepack_cpu_experts(modules)
            self.last_apply["loaded"] = time.perf_counter() - began
        # post-processing may register new parameters (vLLM's replace_parameter, the CPU
        # experts' prepack): the model as this apply left it is what the next prepare expects
        live = dict(self.model.named_parameters())
        for storage in prepared.loaded:
            name = self.parameter_names.get(storage, storage)
            if storage in self._resolved and name in live:
                self._resolved[storage] = (live[name], _signature(live[name]))
