"""LoRA adapters refitted straight into the LoRA slots of live vLLM engines.

An adapter is a refit program of its own: its logical tensors are the adapter's ``lora_A``
and ``lora_B`` weights, named as PEFT's ``save_pretrained`` writes them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, ``[r, in]``;
``...lora_B.weight``, ``[out, r]``); its source layout is the trainer's (FSDP2 shards of the
PEFT model); its destination layout is vLLM's LoRA slicing on every engine (the engine axis
replicating). It runs in a refit session of its own (its own namespace), beside the base
weights' session if there is one: the base weights are neither touched nor moved.

vLLM's LoRA manager transforms what it loads (scaling ``alpha / r`` folded into ``lora_B``,
q/k/v and gate/up packed into the fused modules' slots, ranks padded to ``max_lora_rank``), and
each LoRA layer picks this worker's slice of a whole-shape tensor itself (``slice_lora_a`` /
``slice_lora_b`` of ``vllm/lora/layers/``). So each worker keeps, from the boxes it received,
every adapter tensor at its whole shape holding only its own boxes (zeros elsewhere, never read
by the slicing), and vLLM's LoRA manager builds the adapter from them with its own
``LoRAModel.from_lora_tensors`` (what a load by path runs after reading the file) whenever it
loads it: vLLM 0.32 removes every adapter at the end of any weight update and may evict one
from its LRU cache, and then loads it again by its ``lora_path`` at the next request that names
it. :func:`install_loader` makes a load of ``layoutlang://NAME`` (:func:`adapter_path`) read
this worker's memory instead of a file. Serving requests name the adapter by
``LoRARequest(lora_name, lora_int_id, adapter_path(lora_name))``, without ``load_inplace``
(which would load it again at every request).

The two phases of a base refit hold here too: :meth:`AdapterTargets.prepare` checks the received
storages and builds the ``LoRAModel`` once (vLLM's own validation of the adapter), writing
nothing into the engine; :meth:`AdapterTargets.apply` makes it the adapter the worker serves.

The program is written in the language (``tensors from peft``, ``preset:lora/vllm``; see the
language reference), or made by :func:`adapter_program`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._text import counted
from ...errors import ExecutionError, LayoutValueError
from ...model import Layout
from .targets import received_problems

__all__ = [
    "SCHEME",
    "AdapterSpec",
    "AdapterTargets",
    "adapter_path",
    "adapter_program",
    "adapter_state_dict",
    "install_loader",
    "peft_config_dict",
]

@dataclass(frozen=True)
class AdapterSpec:
    """Which adapter a refit program carries: vLLM's ``lora_int_id`` (> 0) and ``lora_name``,
    and its PEFT configuration (what ``adapter_config.json`` holds: ``r``, ``lora_alpha``,
    ``target_modules``...), plain JSON."""

    lora_int_id: int
    lora_name: str
    config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if int(self.lora_int_id) < 1:
            raise LayoutValueError(f"an adapter's lora_int_id must be at least 1 (vLLM's rule), not {self.lora_int_id}")
        if not self.lora_name:
            raise LayoutValueError("an adapter needs a lora_name")
        for required in ("r", "lora_alpha", "target_modules"):
            if required not in self.config:
                raise LayoutValueError(
                    f"adapter '{self.lora_name}': its PEFT configuration has no '{required}' "
                    "(give peft_config_dict(peft_model.peft_config[name]))"
                )

    def to_json(self) -> dict[str, Any]:
        return {"lora_int_id": int(self.lora_int_id), "lora_name": self.lora_name, "config": self.config}

    @classmethod
    def from_json(cls, value: Mapping[str, Any] | AdapterSpec) -> AdapterSpec:
        if isinstance(value, AdapterSpec):
            return value
        return cls(int(value["lora_int_id"]), str(value["lora_name"]), dict(value.get("config") or {}))


def peft_config_dict(config: Any) -> dict[str, Any]:
    """A PEFT ``LoraConfig`` (or a dict) as plain JSON, as ``adapter_config.json`` holds it
    (its sets become sorted lists)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)

    def plain(value: Any) -> Any:
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if hasattr(value, "value") and not isinstance(value, (str, int, float, bool)):  # enums
            return value.value
        raise TypeError(f"{type(value).__name__} is not JSON")

    return dict(json.loads(json.dumps(raw, default=plain)))


def adapter_state_dict(model: torch.nn.Module, adapter: str = "default") -> dict[str, Any]:
    """The ``lora_A`` / ``lora_B`` weights of ``adapter`` in a PEFT model (DTensors under FSDP2:
    the live parameters, so optimizer steps are seen), under the names ``save_pretrained``
    writes (PEFT drops the adapter's name: ``...q_proj.lora_A.default.weight`` is saved as
    ``...q_proj.lora_A.weight``)."""
    out = {}
    for name, tensor in model.state_dict().items():
        for kind in ("lora_A", "lora_B"):
            marker = f".{kind}.{adapter}."
            if marker in name:
                out[name.replace(marker, f".{kind}.")] = tensor
    if not out:
        raise LayoutValueError(f"the model holds no lora_A / lora_B weights of adapter '{adapter}'")
    return out


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def adapter_program(
    model_config: str | os.PathLike[str],
    adapter_config: str | os.PathLike[str],
    train_layout: str,
    *,
    infer_mesh: str,
    source: str = "train",
    dtype: torch.dtype | None = None,
) -> str:
    """A refit program of an adapter, in the language: the model's constants from its
    ``config.json`` (``tensors from hf_constants``: none of its tensors, so that only the
    adapter moves), every tensor of the adapter from its PEFT ``adapter_config.json``
    (``tensors from peft ... over cfg as lora``; save it with ``LoraConfig.save_pretrained``,
    no weights needed), the training layout (e.g.
    :func:`~layoutlang.integrations.dtensor.layout_from_state_dict` of
    :func:`adapter_state_dict`), the engines' ``mesh infer`` statement (``infer_mesh``: its
    first axis the engines, then ``tp``), vLLM's LoRA slicing (``preset:lora/vllm``, layout
    ``vllm_lora``), and ``reshard refit: source -> vllm_lora``. ``dtype``: the adapter's
    weights as the trainer holds them (default: as the statement reads them: fp32, PEFT's
    default, or the dtypes of an ``adapter_model.safetensors`` beside the config)."""
    paths = []
    for path in (model_config, adapter_config):
        text = os.fspath(path)
        if '"' in text or "\n" in text:
            raise LayoutValueError(f"cannot name {text!r} in a program: a path with a quote or a line break")
        paths.append(text)
    if dtype is not None and dtype not in _DTYPES:
        raise LayoutValueError(f"an adapter of {dtype}: declare fp32, bf16, fp16 or fp64 weights")
    as_dtype = f" dtype {_DTYPES[dtype]}" if dtype is not None else ""
    return (
        f'tensors from hf_constants "{paths[0]}" as cfg\n'
        f'tensors from peft "{paths[1]}" over cfg as lora{as_dtype}\n'
        + train_layout.rstrip("\n") + "\n"
        + infer_mesh.rstrip("\n") + "\n"
        + 'include "preset:lora/vllm"\n'
        + f"reshard refit: {source} -> vllm_lora\n"
    )


# ------------------------------------------------------------------ the worker side

#: the ``lora_path`` of an adapter that layoutlang refits (:func:`adapter_path`)
SCHEME = "layoutlang://"


def adapter_path(lora_name: str) -> str:
    """The ``lora_path`` serving requests give an adapter that layoutlang refits:
    ``LoRARequest(lora_name, lora_int_id, adapter_path(lora_name))``."""
    return SCHEME + lora_name


@dataclass(frozen=True)
class _Live:
    """An adapter as this worker last applied it: its whole-shape tensors (this worker's boxes,
    zeros elsewhere), from which vLLM's loader builds it whenever it loads it."""

    spec: AdapterSpec
    helper: Any
    tensors: dict[str, torch.Tensor]


#: the adapters this process's workers serve from memory, by ``lora_name``
_LIVE: dict[str, _Live] = {}


def _build(manager: Any, live: _Live, lora_id: int) -> Any:
    """vLLM's ``LoRAModel`` of ``live`` for the model-level LoRA ``manager``: what
    ``WorkerLoRAManager._load_adapter`` does after reading a file (vLLM folds the scaling into
    copies of the tensors: the kept ones stay as received)."""
    from vllm.lora.lora_model import LoRAModel

    model = manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id,
        tensors={name: tensor.clone() for name, tensor in live.tensors.items()},
        peft_helper=live.helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    manager._validate_moe_lora_format(lora)
    manager._validate_modules_to_save(lora)
    manager._validate_token_classification_lora(lora)
    return lora


def install_loader() -> None:
    """Let vLLM's worker LoRA manager load ``layoutlang://NAME`` adapters from this process's
    memory (idempotent).

    vLLM 0.32's worker removes every adapter from its LoRA manager at the end of any weight
    update (``Worker.finish_weight_update`` calls ``reset_lora_state``), and its LRU cache may
    evict an adapter: it then loads the adapter again, by its ``lora_path``, when a request
    names it. ``WorkerLoRAManager._load_adapter`` is wrapped so that such a load of a
    ``layoutlang://`` path builds the adapter from what this worker last applied (vLLM's own
    ``LoRAModel.from_lora_tensors``, no file); every other path loads as before."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = WorkerLoRAManager._load_adapter
    if getattr(original, "layoutlang", False):
        return

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = str(getattr(lora_request, "lora_path", "") or "")
        if not path.startswith(SCHEME):
            return original(self, lora_request)
        name = path[len(SCHEME):]
        live = _LIVE.get(name)
        if live is None:
            raise ValueError(
                f"adapter '{name}' ({path}) is not held by this engine: no layoutlang refit of it was applied, "
                "or it was removed"
            )
        if lora_request.lora_int_id != live.spec.lora_int_id:
            raise ValueError(
                f"adapter '{name}' is refitted under lora_int_id {live.spec.lora_int_id}, "
                f"the request names {lora_request.lora_int_id}"
            )
        lora = _build(self._adapter_manager, live, lora_request.lora_int_id)
        lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
        return lora

    _load_adapter.layoutlang = True  # type: ignore[attr-defined]
    WorkerLoRAManager._load_adapter = _load_adapter


@dataclass(frozen=True)
class PreparedAdapter:
    """A received adapter, checked by building it into vLLM's ``LoRAModel``: ready to be served."""

    live: _Live


class AdapterTargets:
    """One worker's adapter storages, resolved against the engine's LoRA manager.

    :attr:`problems` lists what keeps the worker from taking the adapter (an engine started
    without LoRA, a rank above ``max_lora_rank``, a tensor that is no LoRA weight of a module
    vLLM has LoRA slots for, a storage that fuses several tensors); the session's agreement
    refuses the start while any worker has one.
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, rank: int, spec: AdapterSpec, vllm_config: Any):
        self.model = model
        self.layout = layout
        self.rank = rank
        self.spec = spec
        self.problems: list[str] = []
        self.shapes = layout.storages_on(rank)
        self.manager: Any = getattr(model, "lora_manager", None)
        self.helper: Any = None
        if self.manager is None:
            self.problems.append(
                f"the engine has no LoRA manager (rank {rank}): start it with enable_lora=True "
                f"and max_lora_rank >= {spec.config.get('r')}"
            )
            return
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import parse_fine_tuned_lora_name

        install_loader()
        text = vllm_config.model_config.hf_config.get_text_config()
        try:
            self.helper = PEFTHelper.from_dict(
                {**spec.config, "vllm_max_position_embeddings": getattr(text, "max_position_embeddings", None)}
            )
            self.helper.validate_legal(self.manager.lora_config)
        except ValueError as err:
            self.problems.append(f"adapter '{spec.lora_name}' cannot be served by this engine: {err}")
        expected = set()
        for module in self.manager.supported_lora_modules:
            expected.update(self.manager.packed_modules_mapping.get(module, [module]))
        for storage in self.shapes:
            parts = layout.storage(storage, rank).parts
            if list(parts) != [storage]:
                self.problems.append(f"storage '{storage}' fuses {len(parts)} tensors: an adapter's are one each")
                continue
            try:
                module, _ = parse_fine_tuned_lora_name(storage)
            except ValueError as err:
                self.problems.append(f"'{storage}' is not a LoRA weight vLLM reads: {err}")
                continue
            if module.rsplit(".", 1)[-1] not in expected:
                self.problems.append(
                    f"'{storage}': the engine has no LoRA slot for module '{module}' "
                    f"(its LoRA modules: {', '.join(sorted(expected))})"
                )
        held = _LIVE.get(spec.lora_name)
        if held is not None and held.spec.lora_int_id != spec.lora_int_id:
            self.problems.append(
                f"adapter '{spec.lora_name}' is held under lora_int_id {held.spec.lora_int_id} already, "
                f"not {spec.lora_int_id}"
            )

    def whole_tensors(self, received: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every adapter tensor this worker holds boxes of, at its whole shape: its boxes, zeros
        elsewhere (vLLM's slicing reads only the boxes)."""
        out = {}
        for storage, tensor in received.items():
            logical = self.layout.tensors[storage]
            shape = self.layout.parts_shape(storage, self.rank)
            assert shape is not None
            parts = tensor.view(shape)
            whole = torch.zeros(tuple(logical.shape), dtype=tensor.dtype)
            for box in self.layout.boxes(storage, self.rank):
                region = parts[box.storage_index()]
                whole[box.slices()] = region.transpose(-1, -2) if box.transposed else region
            out[storage] = whole
        return out

    def prepare(self, received: Mapping[str, torch.Tensor]) -> PreparedAdapter:
        """Check the received storages and build the adapter as vLLM's ``LoRAModel`` (vLLM's
        validation included); nothing is written into the engine. Raises
        :class:`~layoutlang.errors.ExecutionError` naming every problem."""
        layout = self.layout
        # each adapter tensor is a storage of its own
        found = received_problems(layout, self.shapes, lambda storage: layout.tensors[storage].dtype, received)
        problems = [*self.problems, *found]
        live = None
        if not problems:
            live = _Live(self.spec, self.helper, self.whole_tensors(received))
            try:
                _build(self.manager, live, self.spec.lora_int_id)
            except (ValueError, RuntimeError, KeyError) as err:
                problems.append(f"vLLM refuses adapter '{self.spec.lora_name}': {type(err).__name__}: {err}")
        if problems:
            raise ExecutionError(
                f"rank {self.rank} cannot apply adapter '{self.spec.lora_name}' "
                f"({counted(len(problems), 'problem')}): "
                + "; ".join(problems[:5])
                + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""),
                rank=self.rank,
            )
        assert live is not None
        return PreparedAdapter(live)

    def apply(self, prepared: PreparedAdapter) -> None:
        """Serve the prepared adapter: what vLLM loads for ``adapter_path(lora_name)`` from now
        on; the version in the LoRA manager, if any, is taken out (the next request that names
        it loads this one)."""
        _LIVE[self.spec.lora_name] = prepared.live
        self.manager.remove_adapter(self.spec.lora_int_id)

    def remove(self) -> bool:
        """Take the adapter out of the engine (its LoRA slot, its cache entry, and this worker's memory)."""
        held = _LIVE.pop(self.spec.lora_name, None)
        if self.manager is None:
            return held is not None
        return bool(self.manager.remove_adapter(self.spec.lora_int_id)) or held is not None
