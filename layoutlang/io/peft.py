"""Logical tensors of a PEFT LoRA adapter, read from its ``adapter_config.json``.

:func:`read_lora_adapter` reads the adapter's config and the ``config.json`` of the model it
adapts (never weights) and lists every tensor PEFT's ``save_pretrained`` writes into
``adapter_model.safetensors``, and vLLM's ``LoRAModel.from_lora_tensors`` reads: for every
adapted linear layer ``MODULE`` of the model (``model.layers.3.self_attn.q_proj``),

* ``base_model.model.MODULE.lora_A.weight`` of shape ``[r, in_features]``,
* ``base_model.model.MODULE.lora_B.weight`` of shape ``[out_features, r]``,

in the model's module order, A before B. The adapted layers are those PEFT's
``check_target_module_exists`` picks (peft 0.21): ``target_modules`` as a list (a module
whose name is an entry, or ends with ``.`` and an entry), as a regular expression (matched
against the whole module name), or ``"all-linear"`` (every linear layer but the output
head); then ``exclude_modules`` (list or expression) and, for a list, ``layers_to_transform``
with ``layers_pattern``. ``r`` is per module when ``rank_pattern`` gives one (PEFT's
``get_pattern_key``: the first key ``K`` for which ``(.*\\.)?(K)$`` matches the module name);
``lora_alpha`` and ``alpha_pattern`` scale the product and shape nothing.

Dtypes: an adapter config has none. PEFT writes fp32 adapter weights by default, whatever the
model's dtype (``get_peft_model(..., autocast_adapter_dtype=True)`` upcasts the weights of a
bf16 or fp16 model), so fp32 is the default; ``dtype`` overrides it (an adapter made with
``autocast_adapter_dtype=False`` has the model's dtype). When the config's folder also holds
``adapter_model.safetensors``, each tensor takes the dtype its header records, and the header
must hold exactly the tensors described, in the same shapes.

Refused, each with an error naming the file and the key: another ``peft_type`` than LORA,
``use_dora``, ``bias`` other than ``"none"``, ``lora_bias``, ``modules_to_save``,
``trainable_token_indices``, ``layer_replication``, ``use_qalora``, ``use_bdlora``,
``target_parameters`` (how PEFT adapts fused MoE experts), a target that is not a linear
layer of a decoder layer (the embedding, the output head, a norm, a block), a target that
matches no module, and the MLP of a mixture-of-experts model (PEFT turns those targets into
``target_parameters`` of the fused experts).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ModelDescriptionError, closest_name
from ..model.dtypes import DTYPES, canonical_dtype
from ._files import TensorEntry, read_json_object
from .hf import hf_config_constants, tensors_from_hf_config
from .safetensors import _hub_blobs, _leaves_folder, tensors_from_safetensors

__all__ = ["ADAPTER_CHECKPOINT", "LoraAdapter", "adapter_checkpoint_beside", "read_lora_adapter"]

#: the file PEFT's save_pretrained writes the adapter's weights into, beside adapter_config.json
ADAPTER_CHECKPOINT = "adapter_model.safetensors"
#: the prefix PEFT's saved names carry before the model's own module names
_PREFIX = "base_model.model."
#: the dtype PEFT writes adapter weights in by default (autocast_adapter_dtype=True)
_DEFAULT_DTYPE = "fp32"
_ALL_LINEAR = "all-linear"


class LoraAdapter(NamedTuple):
    """What an adapter config declares: its tensors and its constants."""

    #: (name, shape, dtype) of every tensor of ``adapter_model.safetensors``
    tensors: list[TensorEntry]
    #: the integer entries of the config (``r``, ``lora_alpha`` when an integer...) and
    #: ``max_rank``, the largest rank of ``r`` and ``rank_pattern`` (what vLLM compares with
    #: its ``max_lora_rank``)
    constants: dict[str, int]
    #: the adapted modules, in order, each with its rank
    modules: list[tuple[str, int]]


def _config_file(path: str | os.PathLike[str]) -> Path:
    file = Path(path)
    return file / "adapter_config.json" if file.is_dir() else file


def adapter_checkpoint_beside(path: str | os.PathLike[str]) -> Path | None:
    """The ``adapter_model.safetensors`` beside the adapter config at ``path``, None when there is
    none. A symbolic link leaving the folder is refused, as a model folder's checkpoint is."""
    folder = _config_file(path).parent
    file = folder / ADAPTER_CHECKPOINT
    if not file.is_file():
        return None
    root = folder.resolve()
    reason = _leaves_folder(file.name, file, root, _hub_blobs(root))
    if reason is not None:
        raise ModelDescriptionError(
            f"{file}: the adapter's {file.name} {reason}; the files of an adapter folder must lie inside it"
        )
    return file


class _Module(NamedTuple):
    name: str
    #: linear (adaptable), embedding, head, norm, expert, router, moe_mlp (a dense MLP of an MoE
    #: model) or block (a module holding others)
    kind: str
    out_features: int = 0
    in_features: int = 0


_WHY_NOT = {
    "embedding": "is the token embedding (PEFT's lora_embedding_A/B), which is not supported",
    "head": "is the output head, which is not supported",
    "norm": "is a norm, not a linear layer",
    "block": "is a block of modules, not a linear layer",
    "expert": "is an expert of a mixture-of-experts layer; expert LoRA (PEFT's target_parameters on the"
    " fused experts) is not supported",
    "router": "is the router of a mixture-of-experts layer, which is not supported",
    "moe_mlp": "is an MLP projection of a mixture-of-experts model, which PEFT turns into expert LoRA"
    " (target_parameters on the fused experts); that is not supported",
}


def _modules(model_config: Path) -> list[_Module]:
    """Every module of the model that a target may name, in the model's order."""
    found = tensors_from_hf_config(model_config, dtype="fp32")
    names = [name for name, _, _ in found]
    has_experts = any(".experts." in name for name in names)
    modules: dict[str, _Module] = {}
    for name, shape, _ in found:
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module in modules:
            continue
        parts = module.split(".")
        if module == "model.embed_tokens" or parts[-1] == "embed_tokens":
            kind = "embedding"
        elif module == "lm_head" or parts[-1] == "head":
            kind = "head"
        elif len(shape) != 2:
            kind = "norm"
        elif "experts" in parts:
            kind = "expert"
        elif parts[-1] == "gate" and len(parts) >= 2 and parts[-2] in ("mlp", "block_sparse_moe"):
            kind = "router"
        elif has_experts and "mlp" in parts:
            kind = "moe_mlp"
        else:
            kind = "linear"
        out_features, in_features = (shape[0], shape[1]) if len(shape) == 2 else (0, 0)
        modules[module] = _Module(module, kind, out_features, in_features)
    # the blocks holding them (model.layers.0.self_attn, ...): a target may name one, to no avail
    blocks: dict[str, _Module] = {}
    for module in modules:
        parts = module.split(".")
        for end in range(1, len(parts)):
            block = ".".join(parts[:end])
            if block not in modules:
                blocks.setdefault(block, _Module(block, "block"))
    return [*blocks.values(), *modules.values()]


class _Reader:
    """The adapter config, with errors that name its file and the key at fault."""

    def __init__(self, file: Path, config: dict[str, Any]) -> None:
        self.file = file
        self.config = config

    def error(self, key: str, message: str, hint: str | None = None) -> ModelDescriptionError:
        return ModelDescriptionError(f"{self.file}: {key!r}: {message}", hint=hint)

    def refuse_set(self, key: str, what: str) -> None:
        """``key`` must be absent, null, false or empty: the adapter uses ``what`` otherwise."""
        value = self.config.get(key)
        if value not in (None, False, [], {}, ""):
            raise self.error(key, f"{what} is not supported (it is {json.dumps(value)})")

    def positive_int(self, key: str, value: Any) -> int:
        if type(value) is not int or value < 1:
            raise self.error(key, f"must be a positive integer, not {value!r}")
        return value

    def regex(self, key: str, pattern: Any) -> re.Pattern[str]:
        if not isinstance(pattern, str):
            raise self.error(key, f"must be a string (a regular expression), not {pattern!r}")
        try:
            return re.compile(pattern)
        except re.error as exc:
            raise self.error(key, f"{pattern!r} is not a regular expression: {exc}") from None

    def names(self, key: str) -> list[str] | re.Pattern[str] | None:
        """A list of module names, a regular expression, or None (absent or null)."""
        value = self.config.get(key)
        if value is None:
            return None
        if isinstance(value, str):
            return self.regex(key, value)
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        raise self.error(key, f"must be a list of module names or a regular expression, not {value!r}")


def read_lora_adapter(
    path: str | os.PathLike[str],
    model_config: str | os.PathLike[str],
    dtype: str | None = None,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
) -> LoraAdapter:
    """The tensors and constants of the LoRA adapter whose ``adapter_config.json`` is at ``path``
    (a file, or a folder holding one), for the model whose ``config.json`` is at ``model_config``.

    ``dtype`` (any spelling :func:`~layoutlang.model.dtypes.canonical_dtype` knows) is the dtype of
    every tensor; without it, fp32 (PEFT's default), or, with ``checkpoint`` (an
    ``adapter_model.safetensors``, e.g. :func:`adapter_checkpoint_beside`), the dtypes its header
    records; the checkpoint must hold exactly the tensors described, in the same shapes. Raises
    :class:`ModelDescriptionError` naming the file (and the key) for any problem.
    """
    file = _config_file(path)
    reader = _Reader(file, read_json_object(file, "PEFT adapter config"))
    element = _DEFAULT_DTYPE
    if dtype is not None:
        short = canonical_dtype(dtype)
        if short is None:
            raise ModelDescriptionError(f"{file}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        element = short
    _refuse_unsupported(reader)
    r = reader.positive_int("r", reader.config.get("r"))
    alpha = reader.config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise reader.error("lora_alpha", f"must be a number, not {alpha!r}")
    ranks = _patterns(reader, "rank_pattern", ranks=True)
    _patterns(reader, "alpha_pattern", ranks=False)
    modules = _modules(Path(model_config))
    chosen = _targets(reader, modules)
    adapted: list[tuple[str, int]] = []
    tensors: list[TensorEntry] = []
    for module in chosen:
        rank = next((value for regex, value in ranks if regex.match(module.name)), r)
        adapted.append((module.name, rank))
        tensors.append((f"{_PREFIX}{module.name}.lora_A.weight", (rank, module.in_features), element))
        tensors.append((f"{_PREFIX}{module.name}.lora_B.weight", (module.out_features, rank), element))
    constants = hf_config_constants(reader.config)
    constants["max_rank"] = max([r, *(value for _, value in ranks)])
    if checkpoint is not None:
        tensors = _as_stored(tensors, file, Path(checkpoint), keep_dtype=dtype is not None)
    return LoraAdapter(tensors, constants, adapted)


def _refuse_unsupported(reader: _Reader) -> None:
    peft_type = reader.config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise reader.error("peft_type", f"only LoRA adapters (LORA) are supported, not {peft_type!r}")
    reader.refuse_set("use_dora", "DoRA (its lora_magnitude_vector tensors)")
    bias = reader.config.get("bias", "none")
    if bias not in (None, "none"):
        raise reader.error("bias", f"only 'none' is supported (the adapter saves the model's biases with {bias!r})")
    reader.refuse_set("lora_bias", "a bias on lora_B")
    reader.refuse_set("modules_to_save", "saving whole modules beside the adapter")
    reader.refuse_set("trainable_token_indices", "training token embeddings")
    reader.refuse_set("layer_replication", "layer replication")
    reader.refuse_set("use_qalora", "QALoRA (its pooled lora_A)")
    reader.refuse_set("use_bdlora", "block-diagonal LoRA")
    reader.refuse_set(
        "target_parameters",
        "LoRA on parameters (how PEFT adapts the fused experts of a mixture-of-experts model)",
    )


def _patterns(reader: _Reader, key: str, *, ranks: bool) -> list[tuple[re.Pattern[str], int]]:
    """``rank_pattern`` / ``alpha_pattern``: each key a regular expression matched as PEFT's
    get_pattern_key matches it; the ranks, in the config's order (the first match wins)."""
    value = reader.config.get(key)
    if value is None:
        return []
    if not isinstance(value, dict):
        raise reader.error(key, f"must be an object from module patterns to values, not {value!r}")
    out = []
    for pattern, setting in value.items():
        if ranks:
            if type(setting) is not int or setting < 1:
                raise reader.error(key, f"the rank of {pattern!r} must be a positive integer, not {setting!r}")
        elif isinstance(setting, bool) or not isinstance(setting, (int, float)):
            raise reader.error(key, f"the alpha of {pattern!r} must be a number, not {setting!r}")
        try:
            regex = re.compile(rf"(.*\.)?({pattern})$")
        except re.error as exc:
            raise reader.error(key, f"{pattern!r} is not a regular expression: {exc}") from None
        out.append((regex, setting if ranks else 0))
    return out


def _targets(reader: _Reader, modules: list[_Module]) -> list[_Module]:
    """The modules the adapter adapts, in the model's order; a target that is not an adaptable
    linear layer, or names nothing, is an error."""
    target = reader.config.get("target_modules")
    excluded = reader.names("exclude_modules")
    if target is None:
        raise reader.error("target_modules", "is missing: the adapter names no module to adapt")
    everything = [m for m in modules if m.kind != "block"]
    if isinstance(target, str) and reader.config.get("layers_to_transform") not in (None, []):
        # LoraConfig.__post_init__ refuses it too
        raise reader.error(
            "layers_to_transform", "cannot be used when target_modules is a string (an expression or 'all-linear')"
        )
    if isinstance(target, str) and target.lower() == _ALL_LINEAR:
        # PEFT's _maybe_include_all_linear_layers: every nn.Linear but the output embeddings
        picked = [m for m in everything if m.kind not in ("embedding", "head", "norm")]
    elif isinstance(target, str):
        regex = reader.regex("target_modules", target)
        picked = [m for m in modules if regex.fullmatch(m.name)]
        if not picked:
            raise reader.error(
                "target_modules",
                f"the expression {target!r} matches no module of the model",
                _suggestion(everything),
            )
    elif isinstance(target, list) and all(isinstance(item, str) for item in target):
        picked = []
        for entry in target:
            hits = [m for m in modules if m.name == entry or m.name.endswith(f".{entry}")]
            if not hits:
                raise reader.error(
                    "target_modules", f"{entry!r} names no module of the model", _suggestion(everything, entry)
                )
            picked.extend(hits)
        picked = _in_layers(reader, picked)
    else:
        raise reader.error(
            "target_modules", f"must be a list of module names, a regular expression or 'all-linear', not {target!r}"
        )
    if excluded is not None:
        picked = [m for m in picked if not _named(m.name, excluded)]
    chosen = {m.name for m in picked}
    for module in modules:  # the model's order, each once
        if module.name in chosen and module.kind != "linear":
            raise reader.error(
                "target_modules",
                f"module '{module.name}' {_WHY_NOT[module.kind]}",
                "adapt only the attention's and the MLP's linear layers (of an MoE model, the attention's)",
            )
    out = [m for m in modules if m.name in chosen]
    if not out:
        raise reader.error("target_modules", "adapts no module of the model (every target is excluded)")
    return out


def _named(name: str, names: list[str] | re.Pattern[str]) -> bool:
    if isinstance(names, re.Pattern):
        return names.fullmatch(name) is not None
    return name in names or any(name.endswith(f".{entry}") for entry in names)


def _in_layers(reader: _Reader, picked: list[_Module]) -> list[_Module]:
    """``layers_to_transform`` and ``layers_pattern`` as PEFT applies them to a list of targets."""
    indexes = reader.config.get("layers_to_transform")
    if indexes is None or indexes == []:
        return picked
    if type(indexes) is int:
        wanted = {indexes}
    elif isinstance(indexes, list) and all(type(i) is int for i in indexes):
        wanted = set(indexes)
    else:
        raise reader.error("layers_to_transform", f"must be a layer index or a list of them, not {indexes!r}")
    patterns = reader.config.get("layers_pattern")
    if patterns in (None, "", []):
        regexes = [re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")]
    else:
        listed = [patterns] if isinstance(patterns, str) else patterns
        if not (isinstance(listed, list) and all(isinstance(p, str) for p in listed)):
            raise reader.error("layers_pattern", f"must be a name or a list of names, not {patterns!r}")
        regexes = [reader.regex("layers_pattern", rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.") for p in listed]
    out = []
    for module in picked:
        match = next((m for m in (regex.match(module.name) for regex in regexes) if m is not None), None)
        if match is not None and int(match.group("idx")) in wanted:
            out.append(module)
    return out


def _suggestion(modules: Iterable[_Module], entry: str | None = None) -> str:
    leaves = list(dict.fromkeys(m.name.rpartition(".")[2] for m in modules if m.kind == "linear"))
    listed = f"the model's linear layers: {', '.join(leaves)}"
    guess = closest_name(entry, leaves) if entry is not None else None
    return f"did you mean '{guess}'? ({listed})" if guess is not None else listed


def _as_stored(tensors: list[TensorEntry], config: Path, checkpoint: Path, *, keep_dtype: bool) -> list[TensorEntry]:
    """The described tensors with the checkpoint's dtypes, once it confirms names and shapes."""
    stored = {name: (shape, dtype) for name, shape, dtype in tensors_from_safetensors(checkpoint)}
    described = {name for name, _, _ in tensors}
    missing = [name for name, _, _ in tensors if name not in stored]
    extra = [name for name in stored if name not in described]
    for what, names, where in (
        ("lacks", missing, "the config describes"),
        ("holds", extra, "the config does not describe"),
    ):
        if names:
            shown = ", ".join(f"'{name}'" for name in names[:3])
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise ModelDescriptionError(
                f"{config}: the adapter's checkpoint {checkpoint} {what} {len(names)} tensors {where}: {shown}{more}"
            )
    for name, shape, _ in tensors:
        if stored[name][0] != shape:
            raise ModelDescriptionError(
                f"{config}: the adapter config gives tensor '{name}' shape {list(shape)}, its checkpoint"
                f" {checkpoint} stores {list(stored[name][0])}"
            )
    if keep_dtype:
        return tensors
    return [(name, shape, stored[name][1]) for name, shape, _ in tensors]
