"""Logical tensors of a Hugging Face model, read from its ``config.json``.

:func:`tensors_from_hf_config` reads only the config (never weights) and lists every
weight tensor that the family's Hugging Face checkpoint (``model.safetensors``) stores:
its name, global shape and dtype, in checkpoint order (embedding, layers in order, final
norm, ``lm_head``). :func:`hf_config_constants` hands a layout file the config's integer
entries (``num_hidden_layers``, ``num_key_value_heads``...) to use as constants.

Limits:

* Only the families in :data:`SUPPORTED_MODEL_TYPES` are known; their tensor names are
  written out here, so a family that renames a module needs a change here.
* Shapes follow the config alone; a checkpoint edited by hand (pruned heads, extra
  adapters) is not described. Read its safetensors header instead
  (:mod:`layoutlang.io.safetensors`).
* Quantized checkpoints: only block-wise FP8 (``quant_method: "fp8"`` with a
  ``weight_block_size``, as DeepSeek-V3 and the Qwen3 FP8 releases ship) is described:
  each quantized projection weight is stored as fp8 with an fp32 ``weight_scale_inv`` of
  one element per block. Passing ``dtype=`` describes the unquantized checkpoint instead.
* From the config alone, every tensor shares the model's dtype, except the FP8 case above and
  DeepSeek's router ``e_score_correction_bias`` (V3, and V2 configs with ``topk_method:
  noaux_tc``), which the published checkpoints keep in fp32. A checkpoint written by
  transformers' ``save_pretrained`` keeps more in fp32 (DeepSeek's router ``gate.weight``
  too): pass ``checkpoint=`` and each tensor takes the dtype its safetensors header records,
  the header also confirming every name and shape.

Config keys are read as the transformers versions in use write them: transformers 5 writes
``dtype`` (4.x ``torch_dtype``) and a Qwen3-MoE config's expert count as
``num_local_experts`` (4.x ``num_experts``); either spelling is read.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import ModelDescriptionError
from ..model.dtypes import DTYPES, canonical_dtype
from ._files import TensorEntry, read_json_object
from .safetensors import checkpoint_file, confined_checkpoint_file, tensors_from_safetensors

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Fp8Scheme",
    "TensorEntry",
    "checkpoint_beside",
    "fp8_scheme",
    "hf_config_constants",
    "read_config",
    "tensors_from_hf_config",
]

_DEFAULT_DTYPE = "bf16"
#: dtype of the per-block dequantization scales of FP8 checkpoints
_SCALE_DTYPE = "fp32"
_FP8_FORMATS = {"e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}


def _config_file(path: str | os.PathLike[str]) -> Path:
    """The ``config.json`` itself, also when given the model's folder."""
    file = Path(path)
    return file / "config.json" if file.is_dir() else file


def read_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path`` (a file, or a model folder holding one)."""
    return read_json_object(_config_file(path), "Hugging Face config")


def checkpoint_beside(path: str | os.PathLike[str]) -> Path | None:
    """The safetensors checkpoint in the folder of the ``config.json`` at ``path``, if it has one:
    its ``model.safetensors.index.json``, else its ``model.safetensors``; None for a config alone.
    A file of that name that is a symbolic link leaving the folder is refused
    (:func:`~layoutlang.io.safetensors.confined_checkpoint_file`)."""
    file = confined_checkpoint_file(_config_file(path).parent)
    return file if file.is_file() else None


def hf_config_constants(config: dict[str, Any]) -> dict[str, int]:
    """The integer-valued top-level entries of a config, for a layout file to use as constants.

    Booleans are left out although Python counts them as ints: ``true`` is not a size.
    """
    return {key: value for key, value in config.items() if type(value) is int}


def tensors_from_hf_config(
    path: str | os.PathLike[str],
    dtype: str | None = None,
    *,
    include_mtp: bool = False,
    checkpoint: str | os.PathLike[str] | None = None,
    allow_outside_paths: bool = False,
) -> list[TensorEntry]:
    """Every weight tensor of the model described by the ``config.json`` at ``path``.

    ``dtype`` (any spelling :func:`~layoutlang.model.dtypes.canonical_dtype` knows) overrides the
    config's ``torch_dtype`` and describes an unquantized checkpoint; without it the config's
    ``torch_dtype`` (or ``dtype``) is used, else bf16. ``include_mtp`` adds DeepSeek-V3's
    multi-token-prediction layers (``num_nextn_predict_layers``), which the model proper does
    not use. ``checkpoint`` (a ``.safetensors`` file, an index or a folder, e.g.
    :func:`checkpoint_beside`) must hold every tensor the config describes, in the same shape;
    without ``dtype`` each tensor then takes the dtype the checkpoint's header records (tensors
    transformers keeps in fp32 in a bf16 model). The checkpoint's headers are validated and the
    files of its index confined to its folder unless ``allow_outside_paths``, as
    :func:`~layoutlang.io.safetensors.tensors_from_safetensors` does. Raises
    :class:`ModelDescriptionError` naming the file for any problem.
    """
    file = _config_file(path)
    config = read_config(file)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in _BUILDERS:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        if model_type is None:
            raise ModelDescriptionError(f"{file}: config has no 'model_type' (supported: {supported})")
        raise ModelDescriptionError(f"{file}: unsupported model_type {model_type!r} (supported: {supported})")
    builder = _BUILDERS[model_type]
    reader = _ConfigReader(config, model_type, file)
    out = _TensorList(reader, _model_dtype(reader, dtype), explicit_dtype=dtype is not None)
    builder(reader, out, include_mtp)
    if checkpoint is None:
        return out.tensors
    return _as_stored(
        out.tensors, file, checkpoint, keep_dtype=dtype is not None, allow_outside_paths=allow_outside_paths
    )


class Fp8Scheme(NamedTuple):
    """How a block-wise FP8 checkpoint is quantized, read from its config's ``quantization_config``
    (the field names of transformers' ``FineGrainedFP8Config``, and DeepSeek-V3's ``fmt``)."""

    #: the values' dtype: ``fp8_e4m3`` (``fmt: e4m3``, the default) or ``fp8_e5m2``
    format: str
    #: ``weight_block_size``: rows x columns of one block of a ``[out, in]`` weight
    block: tuple[int, int]
    #: ``activation_scheme`` (only ``dynamic``: static schemes add ``input_scale`` tensors)
    activation_scheme: str
    #: ``modules_to_not_convert``: modules left unquantized (a substring of the module's name)
    modules_to_not_convert: tuple[str, ...]
    #: the weights the checkpoint stores quantized (each beside its ``weight_scale_inv``), in order
    weights: tuple[str, ...]


def fp8_scheme(path: str | os.PathLike[str], *, include_mtp: bool = False) -> Fp8Scheme | None:
    """The FP8 scheme of the model whose ``config.json`` is at ``path``, None when the config has
    no ``quantization_config``; an unsupported scheme is a :class:`ModelDescriptionError`.

    ``weights`` are the tensors :func:`tensors_from_hf_config` describes as fp8 with a
    ``weight_scale_inv`` beside them: what a serving layout stores quantized when it follows
    the model's own config (``quantize from cfg`` in a layout).
    """
    file = _config_file(path)
    config = read_config(file)
    model_type = config.get("model_type")
    reader = _ConfigReader(config, str(model_type), file)
    blocks = _Fp8Blocks.from_config(reader)
    if blocks is None:
        return None
    quant = config["quantization_config"]
    stored = tensors_from_hf_config(file, include_mtp=include_mtp)
    weights = tuple(name.removesuffix("_scale_inv") for name, _, _ in stored if name.endswith(".weight_scale_inv"))
    return Fp8Scheme(
        blocks.dtype,
        blocks.block,
        quant.get("activation_scheme", "dynamic"),
        tuple(blocks.modules_to_not_convert),
        weights,
    )


def _as_stored(
    tensors: list[TensorEntry],
    config: Path,
    checkpoint: str | os.PathLike[str],
    *,
    keep_dtype: bool,
    allow_outside_paths: bool = False,
) -> list[TensorEntry]:
    """The config's tensors with the checkpoint's dtypes, once the checkpoint confirms names and shapes."""
    found = tensors_from_safetensors(checkpoint, allow_outside_paths=allow_outside_paths)
    stored = {name: (shape, dtype) for name, shape, dtype in found}
    where = checkpoint_file(checkpoint)
    missing = [name for name, _, _ in tensors if name not in stored]
    if missing:
        shown = ", ".join(f"'{name}'" for name in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelDescriptionError(
            f"{config}: the config describes {len(missing)} tensors that the checkpoint {where} lacks:"
            f" {shown}{more}; is it this model's checkpoint?"
        )
    for name, shape, _ in tensors:
        if stored[name][0] != shape:
            raise ModelDescriptionError(
                f"{config}: the config gives tensor '{name}' shape {list(shape)}, the checkpoint {where}"
                f" stores {list(stored[name][0])}"
            )
    if keep_dtype:
        return tensors
    return [(name, shape, stored[name][1]) for name, shape, _ in tensors]


class _ConfigReader:
    """Typed access to config entries; every failure names the key, the model type and the file."""

    def __init__(self, config: dict[str, Any], model_type: str, file: Path):
        self.config = config
        self.model_type = model_type
        self.file = file

    def error(self, message: str) -> ModelDescriptionError:
        return ModelDescriptionError(f"{self.file}: {message}")

    def size(self, key: str, minimum: int = 1) -> int:
        """A required integer entry of at least ``minimum``."""
        if self.config.get(key) is None:
            raise self.error(f"model_type {self.model_type!r} needs key {key!r}, which is missing")
        return self._check_int(key, self.config[key], minimum)

    def optional_size(self, key: str, default: int, minimum: int = 0) -> int:
        """An integer entry that may be absent or null (then ``default``)."""
        value = self.config.get(key)
        return default if value is None else self._check_int(key, value, minimum)

    def size_of_any(self, keys: tuple[str, ...]) -> int:
        """A required integer that versions of transformers spell differently: the first key present."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.size(key)
        spellings = " or ".join(repr(key) for key in keys)
        raise self.error(f"model_type {self.model_type!r} needs key {spellings}, which is missing")

    def flag(self, key: str) -> bool:
        """A boolean entry; absent or null means false, as in every supported family."""
        value = self.config.get(key)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.error(f"{key!r} must be true or false, not {value!r}")
        return value

    def int_list(self, key: str) -> list[int]:
        """A list of integers (e.g. layer indices); absent or null means empty."""
        value = self.config.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(f"{key!r} must be a list of integers, not {value!r}")
        return [self._check_int(key, item, 0) for item in value]

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        # bool is an int subclass in Python, but `true` is no size
        if type(value) is not int:
            raise self.error(f"{key!r} must be an integer, not {value!r}")
        if value < minimum:
            raise self.error(f"{key!r} must be at least {minimum}, not {value}")
        return value


def _model_dtype(reader: _ConfigReader, dtype: str | None) -> str:
    """The dtype argument, else the config's ``torch_dtype``/``dtype``, else bf16."""
    spelling: object
    if dtype is not None:
        source, spelling = "dtype argument", dtype
    else:
        key = "torch_dtype" if reader.config.get("torch_dtype") is not None else "dtype"
        spelling = reader.config.get(key)
        if spelling is None:
            return _DEFAULT_DTYPE
        source = f"config {key!r}"
    short = canonical_dtype(spelling) if isinstance(spelling, str) else None
    if short is None:
        raise reader.error(f"unknown {source} {spelling!r} (known: {', '.join(DTYPES)})")
    return short


class _Fp8Blocks:
    """How a block-wise FP8 checkpoint stores its projection weights."""

    def __init__(self, dtype: str, block: tuple[int, int], modules_to_not_convert: list[str]):
        self.dtype = dtype
        self.block = block
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, reader: _ConfigReader) -> _Fp8Blocks | None:
        """The config's FP8 scheme, None for an unquantized checkpoint; other schemes are errors."""
        quant = reader.config.get("quantization_config")
        if quant is None:
            return None
        if not isinstance(quant, dict):
            raise reader.error(f"'quantization_config' must be an object, not {quant!r}")
        method = quant.get("quant_method")
        block = quant.get("weight_block_size")
        fmt = quant.get("fmt", "e4m3")
        not_converted = quant.get("modules_to_not_convert") or []
        unquantized_hint = "pass dtype= to describe the unquantized checkpoint"
        if method != "fp8":
            raise reader.error(f"quantization method {method!r} is not supported; {unquantized_hint}")
        # static activation scales add `input_scale` tensors this module does not name
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise reader.error(
                f"FP8 activation_scheme {quant.get('activation_scheme')!r} is not supported; {unquantized_hint}"
            )
        if not (isinstance(block, list) and len(block) == 2 and all(type(side) is int and side > 0 for side in block)):
            raise reader.error(
                f"FP8 'weight_block_size' must be two positive integers, not {block!r}; {unquantized_hint}"
            )
        # transformers 5 writes it null; a list restricts what is quantized, which is not read here
        if quant.get("modules_to_convert"):
            raise reader.error(f"FP8 'modules_to_convert' is not supported; {unquantized_hint}")
        scale_fmt = quant.get("scale_fmt", "float")
        if scale_fmt not in (None, "float"):
            raise reader.error(f"FP8 'scale_fmt' {scale_fmt!r} is not supported (float); {unquantized_hint}")
        if fmt not in _FP8_FORMATS:
            raise reader.error(f"unknown FP8 'fmt' {fmt!r} (known: {', '.join(_FP8_FORMATS)})")
        if not (isinstance(not_converted, list) and all(isinstance(name, str) for name in not_converted)):
            raise reader.error(f"'modules_to_not_convert' must be a list of module names, not {not_converted!r}")
        return cls(_FP8_FORMATS[fmt], (block[0], block[1]), not_converted)

    def quantizes(self, module: str) -> bool:
        # substring match, as transformers applies `modules_to_not_convert`
        return not any(excluded in module for excluded in self.modules_to_not_convert)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (math.ceil(out_features / self.block[0]), math.ceil(in_features / self.block[1]))


class _TensorList:
    """Collects logical tensors in checkpoint order, applying the checkpoint's dtypes."""

    def __init__(self, reader: _ConfigReader, dtype: str, *, explicit_dtype: bool):
        self.dtype = dtype
        # an explicit dtype describes a plain checkpoint in that dtype, with no scales
        self.explicit_dtype = explicit_dtype
        self.fp8 = None if explicit_dtype else _Fp8Blocks.from_config(reader)
        self.tensors: list[TensorEntry] = []

    def add(self, name: str, *shape: int, dtype: str | None = None) -> None:
        self.tensors.append((name, shape, dtype or self.dtype))

    def add_fp32_buffer(self, name: str, *shape: int) -> None:
        """A tensor the published checkpoint keeps in fp32 whatever the model dtype."""
        self.add(name, *shape, dtype=self.dtype if self.explicit_dtype else "fp32")

    def linear(self, module: str, out_features: int, in_features: int, *, bias: bool = False) -> None:
        """A projection inside a decoder layer: the ones FP8 checkpoints quantize."""
        if self.fp8 is not None and self.fp8.quantizes(module):
            self.add(f"{module}.weight", out_features, in_features, dtype=self.fp8.dtype)
            self.add(f"{module}.weight_scale_inv", *self.fp8.scale_shape(out_features, in_features), dtype=_SCALE_DTYPE)
        else:
            self.add(f"{module}.weight", out_features, in_features)
        if bias:
            self.add(f"{module}.bias", out_features)

    def gated_mlp(self, module: str, hidden: int, intermediate: int, *, bias: bool = False) -> None:
        """SwiGLU feed-forward: gate, up and down projections."""
        self.linear(f"{module}.gate_proj", intermediate, hidden, bias=bias)
        self.linear(f"{module}.up_proj", intermediate, hidden, bias=bias)
        self.linear(f"{module}.down_proj", hidden, intermediate, bias=bias)


def _head_dim(reader: _ConfigReader, hidden: int, heads: int) -> int:
    """``head_dim`` when the config sets it (Qwen3 does), else hidden_size / num_attention_heads."""
    if reader.config.get("head_dim") is not None:
        return reader.size("head_dim")
    if hidden % heads:
        raise reader.error(
            f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no 'head_dim' is given"
        )
    return hidden // heads


def _grouped_query_model(
    reader: _ConfigReader,
    out: _TensorList,
    *,
    qkv_bias: bool,
    o_bias: bool,
    qk_norm: bool,
    mlp_bias: bool,
    moe_layer: Callable[[int], bool] | None,
    moe: Callable[[str, int], None] | None = None,
) -> None:
    """Llama-style decoder: GQA attention, SwiGLU MLP or MoE, RMSNorms, optional tied head.

    ``moe(prefix, hidden)`` adds the sparse block of a layer ``moe_layer`` picks (default: Qwen's)."""
    hidden = reader.size("hidden_size")
    vocab = reader.size("vocab_size")
    layers = reader.size("num_hidden_layers")
    heads = reader.size("num_attention_heads")
    kv_heads = reader.optional_size("num_key_value_heads", default=heads, minimum=1)
    head_dim = _head_dim(reader, hidden, heads)
    sparse = moe if moe is not None or moe_layer is None else _qwen_moe(reader, out)

    out.add("model.embed_tokens.weight", vocab, hidden)
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        attn = f"{prefix}.self_attn"
        out.linear(f"{attn}.q_proj", heads * head_dim, hidden, bias=qkv_bias)
        out.linear(f"{attn}.k_proj", kv_heads * head_dim, hidden, bias=qkv_bias)
        out.linear(f"{attn}.v_proj", kv_heads * head_dim, hidden, bias=qkv_bias)
        out.linear(f"{attn}.o_proj", hidden, heads * head_dim, bias=o_bias)
        if qk_norm:
            out.add(f"{attn}.q_norm.weight", head_dim)
            out.add(f"{attn}.k_norm.weight", head_dim)
        if sparse is not None and moe_layer is not None and moe_layer(layer):
            sparse(prefix, hidden)
        else:
            out.gated_mlp(f"{prefix}.mlp", hidden, reader.size("intermediate_size"), bias=mlp_bias)
        out.add(f"{prefix}.input_layernorm.weight", hidden)
        out.add(f"{prefix}.post_attention_layernorm.weight", hidden)
    out.add("model.norm.weight", hidden)
    if not reader.flag("tie_word_embeddings"):
        out.add("lm_head.weight", vocab, hidden)


def _qwen_moe(reader: _ConfigReader, out: _TensorList) -> Callable[[str, int], None]:
    """Qwen-MoE's sparse block: ``mlp.gate`` (the router) and ``mlp.experts.{e}`` gated MLPs."""
    # transformers 5 writes the expert count as num_local_experts, 4.x as num_experts
    experts = reader.size_of_any(("num_experts", "num_local_experts"))
    expert_intermediate = reader.size("moe_intermediate_size")

    def block(prefix: str, hidden: int) -> None:
        # the router is a plain linear layer that FP8 checkpoints keep unquantized
        out.add(f"{prefix}.mlp.gate.weight", experts, hidden)
        for expert in range(experts):
            out.gated_mlp(f"{prefix}.mlp.experts.{expert}", hidden, expert_intermediate)

    return block


def _mixtral_moe(reader: _ConfigReader, out: _TensorList) -> Callable[[str, int], None]:
    """Mixtral's sparse block: ``block_sparse_moe.gate`` and experts named w1 (gate), w2 (down), w3 (up)."""
    experts = reader.size("num_local_experts")
    intermediate = reader.size("intermediate_size")

    def block(prefix: str, hidden: int) -> None:
        moe = f"{prefix}.block_sparse_moe"
        out.add(f"{moe}.gate.weight", experts, hidden)
        for expert in range(experts):
            out.linear(f"{moe}.experts.{expert}.w1", intermediate, hidden)
            out.linear(f"{moe}.experts.{expert}.w2", hidden, intermediate)
            out.linear(f"{moe}.experts.{expert}.w3", intermediate, hidden)

    return block


def _mixtral(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    # every Mixtral layer is sparse, and its attention has no biases
    _grouped_query_model(
        reader,
        out,
        qkv_bias=False,
        o_bias=False,
        qk_norm=False,
        mlp_bias=False,
        moe_layer=lambda layer: True,
        moe=_mixtral_moe(reader, out),
    )


def _llama(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    bias = reader.flag("attention_bias")
    _grouped_query_model(
        reader, out, qkv_bias=bias, o_bias=bias, qk_norm=False, mlp_bias=reader.flag("mlp_bias"), moe_layer=None
    )


def _qwen2(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    # Qwen2 always has q/k/v biases and never an o_proj bias; its config has no switch for them
    _grouped_query_model(reader, out, qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False, moe_layer=None)


def _qwen3(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    bias = reader.flag("attention_bias")
    _grouped_query_model(reader, out, qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, moe_layer=None)


def _qwen3_moe(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    sparse_step = reader.optional_size("decoder_sparse_step", default=1, minimum=1)
    dense_layers = set(reader.int_list("mlp_only_layers"))

    def moe_layer(layer: int) -> bool:
        # the rule of transformers' Qwen3MoeDecoderLayer
        return layer not in dense_layers and (layer + 1) % sparse_step == 0

    bias = reader.flag("attention_bias")
    _grouped_query_model(reader, out, qkv_bias=bias, o_bias=bias, qk_norm=True, mlp_bias=False, moe_layer=moe_layer)


def _deepseek_v2(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    """DeepSeek-V2 (and V2-Lite, V2.5): the V3 architecture with a softmax router. Its
    ``topk_method`` is ``greedy`` or ``group_limited_greedy``, and only ``noaux_tc`` (V3's)
    adds the router's ``e_score_correction_bias``, as in vLLM's deepseek_v2.py (transformers'
    DeepseekV2TopkRouter never has one); V2 has no multi-token-prediction layers."""
    _deepseek(reader, out, include_mtp=False, correction_bias=_topk_method(reader) == "noaux_tc")


def _deepseek_v3(reader: _ConfigReader, out: _TensorList, include_mtp: bool) -> None:
    """DeepSeek-V3: every router has its ``e_score_correction_bias`` (transformers'
    DeepseekV3TopkRouter always makes the buffer; every published V3 config says noaux_tc)."""
    _deepseek(reader, out, include_mtp=include_mtp, correction_bias=True)


def _topk_method(reader: _ConfigReader) -> str:
    """``topk_method``; transformers' DeepseekV2Config defaults it to ``greedy``."""
    value = reader.config.get("topk_method")
    if value is None:
        return "greedy"
    if not isinstance(value, str):
        raise reader.error(f"'topk_method' must be a string, not {value!r}")
    return value


def _deepseek(reader: _ConfigReader, out: _TensorList, *, include_mtp: bool, correction_bias: bool) -> None:
    """DeepSeek-V2/V3: MLA attention, dense first layers, then routed + shared experts."""
    hidden = reader.size("hidden_size")
    vocab = reader.size("vocab_size")
    layers = reader.size("num_hidden_layers")
    first_dense = reader.size("first_k_dense_replace", minimum=0)
    moe_every = reader.optional_size("moe_layer_freq", default=1, minimum=1)
    mtp_layers = reader.optional_size("num_nextn_predict_layers", default=0) if include_mtp else 0

    def decoder_layer(prefix: str, layer: int) -> None:
        _mla_attention(reader, out, f"{prefix}.self_attn", hidden)
        if layer >= first_dense and layer % moe_every == 0:
            _deepseek_moe(reader, out, f"{prefix}.mlp", hidden, correction_bias=correction_bias)
        else:
            out.gated_mlp(f"{prefix}.mlp", hidden, reader.size("intermediate_size"))
        out.add(f"{prefix}.input_layernorm.weight", hidden)
        out.add(f"{prefix}.post_attention_layernorm.weight", hidden)

    out.add("model.embed_tokens.weight", vocab, hidden)
    for layer in range(layers):
        decoder_layer(f"model.layers.{layer}", layer)
    # multi-token prediction layers follow the model's layers in the checkpoint, each with its
    # own embedding, input norms, projection of [embedding; hidden state] and output head
    for layer in range(layers, layers + mtp_layers):
        prefix = f"model.layers.{layer}"
        out.add(f"{prefix}.embed_tokens.weight", vocab, hidden)
        out.add(f"{prefix}.enorm.weight", hidden)
        out.add(f"{prefix}.hnorm.weight", hidden)
        # eh_proj sits outside the decoder block and stays unquantized in FP8 checkpoints
        out.add(f"{prefix}.eh_proj.weight", hidden, 2 * hidden)
        decoder_layer(prefix, layer)
        out.add(f"{prefix}.shared_head.norm.weight", hidden)
        out.add(f"{prefix}.shared_head.head.weight", vocab, hidden)
    out.add("model.norm.weight", hidden)
    if not reader.flag("tie_word_embeddings"):
        out.add("lm_head.weight", vocab, hidden)


def _mla_attention(reader: _ConfigReader, out: _TensorList, attn: str, hidden: int) -> None:
    """Multi-head latent attention: low-rank query (optional) and compressed key/value."""
    heads = reader.size("num_attention_heads")
    kv_rank = reader.size("kv_lora_rank")
    nope_dim = reader.size("qk_nope_head_dim", minimum=0)
    rope_dim = reader.size("qk_rope_head_dim", minimum=0)
    v_dim = reader.size("v_head_dim")
    q_rank = reader.optional_size("q_lora_rank", default=0)
    bias = reader.flag("attention_bias")
    q_head_dim = nope_dim + rope_dim
    if q_rank:
        out.linear(f"{attn}.q_a_proj", q_rank, hidden, bias=bias)
        out.add(f"{attn}.q_a_layernorm.weight", q_rank)
        out.linear(f"{attn}.q_b_proj", heads * q_head_dim, q_rank)
    else:
        out.linear(f"{attn}.q_proj", heads * q_head_dim, hidden)
    # one projection yields the compressed KV latent and the shared rotary key
    out.linear(f"{attn}.kv_a_proj_with_mqa", kv_rank + rope_dim, hidden, bias=bias)
    out.add(f"{attn}.kv_a_layernorm.weight", kv_rank)
    out.linear(f"{attn}.kv_b_proj", heads * (nope_dim + v_dim), kv_rank)
    out.linear(f"{attn}.o_proj", hidden, heads * v_dim, bias=bias)


def _deepseek_moe(reader: _ConfigReader, out: _TensorList, mlp: str, hidden: int, *, correction_bias: bool) -> None:
    """Routed experts, the router (V3's sigmoid router with its load-balancing bias), and shared experts."""
    experts = reader.size("n_routed_experts")
    expert_intermediate = reader.size("moe_intermediate_size")
    shared = reader.optional_size("n_shared_experts", default=0)
    for expert in range(experts):
        out.gated_mlp(f"{mlp}.experts.{expert}", hidden, expert_intermediate)
    out.add(f"{mlp}.gate.weight", experts, hidden)
    if correction_bias:
        out.add_fp32_buffer(f"{mlp}.gate.e_score_correction_bias", experts)
    if shared:
        # the shared experts are stored fused as one MLP, shared times as wide
        out.gated_mlp(f"{mlp}.shared_experts", hidden, expert_intermediate * shared)


_BUILDERS: dict[str, Callable[[_ConfigReader, _TensorList, bool], None]] = {
    "llama": _llama,
    "mistral": _llama,
    "mixtral": _mixtral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": _deepseek_v2,
    "deepseek_v3": _deepseek_v3,
}

#: ``model_type`` values this module knows the checkpoint layout of
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_BUILDERS)
