"""Quantized destinations: a tensor stored as FP8 or MXFP8 values plus a tensor of scales.

A layout's ``quantize`` statement (:class:`QuantizeRule`) says that the tensors its pattern
matches are stored quantized on that layout's ranks: in a **format** (``fp8_e4m3``,
``fp8_e5m2``, ``mxfp8``), cut into **blocks** (one size per dim; ``per_channel`` and
``per_tensor`` are block shapes too), with one scale per block in a **scale tensor**: a
logical tensor derived from the weight, named ``<weight>_scale_inv`` (or ``<weight>_scale``)
after its **convention**, of shape ``ceil(shape / block)`` per dim and of the rule's scale
dtype (``fp32``; ``e8m0`` for MXFP8). DeepSeek-V3 keeps ``weight`` ``[N, K]`` in
``float8_e4m3fn`` and ``weight_scale_inv`` ``[ceil(N / 128), ceil(K / 128)]`` in fp32.

The scale tensor is placed **like its weight** (each rank holds the scales of the blocks of
its own boxes, so a rank's boxes must start and end on block boundaries: a block split
between two destination ranks would have a scale that neither rank's elements determine, a
layout engines refuse too, e.g. vLLM's block FP8 with a TP shard that is no multiple of the
block), or **replicated** on every rank holding some of the weight (the whole scale tensor
on each: per-tensor FP8 beside a TP shard, whose one block spans every rank). Its storage
is the weight's storage name with the convention appended (vLLM's
``qkv_proj.weight_scale_inv`` beside ``qkv_proj.weight``), or for replicated scales the
scale tensor's own name, or the one the rule names.

:meth:`Layout.quantized <layoutlang.model.Layout.quantized>` resolves the rules tensor by
tensor and checks every rank's boxes on block boundaries (once per distinct placement, shape,
sub-mesh and storage fusion: tensors alike are checked alike). A reshard into such a layout
is an FP8 refit: :mod:`layoutlang.plan.quantized` decides, move by move, whether the sender
quantizes whole blocks while packing (fp8 values and scales cross the network) or the
destination assembles a split block in bf16 and quantizes it after its last write, and plans
the scale tensors' boxes (:meth:`Layout.scale_boxes <layoutlang.model.Layout.scale_boxes>`)
beside the weights'; the executor quantizes as it packs, and ``layoutlang apply --to`` writes
FP8 checkpoints. The arithmetic of quantization itself is
the C++ core's (``csrc/quantize.hpp``); this module only knows shapes. It imports no torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

import attrs

from ..errors import LayoutValueError, Span, did_you_mean
from .dtypes import DTYPES
from .tensor import Box, LogicalTensor

__all__ = [
    "BLOCKINGS",
    "CONVENTIONS",
    "FORMATS",
    "MX_BLOCK",
    "QUANTIZABLE",
    "Format",
    "Quantization",
    "QuantizeRule",
    "block_cut",
    "scale_box",
    "scale_shape",
]


@attrs.frozen
class Format:
    """A quantized format: the dtype of its values, their largest finite value, the dtypes its
    scales may have."""

    values: str
    fmax: float
    scale_dtypes: tuple[str, ...]


#: the formats a ``quantize`` statement may name
FORMATS: dict[str, Format] = {
    "fp8_e4m3": Format("fp8_e4m3", 448.0, ("fp32",)),
    "fp8_e5m2": Format("fp8_e5m2", 57344.0, ("fp32",)),
    "mxfp8": Format("fp8_e4m3", 448.0, ("e8m0",)),
}

#: ``scale_inv``: the scale tensor holds what dequantizes (value * scale_inv), as DeepSeek-V3
#: and vLLM keep it; ``scale``: its inverse (value / scale)
CONVENTIONS = ("scale_inv", "scale")

#: block shapes by name: ``per_channel`` (one scale per row: 1 along every dim but the last,
#: the reduction dim of a ``[out, in]`` weight), ``per_tensor`` (one scale for the tensor)
BLOCKINGS = ("per_channel", "per_tensor")

#: the OCP MX block: 32 elements along the reduction dim share one power-of-two scale
MX_BLOCK = 32

#: the dtypes a tensor may have to be quantized (what the quantizer reads)
QUANTIZABLE = ("bf16", "fp16", "fp32")


def scale_shape(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """One scale per block, the blocks at the edges partial.

    >>> scale_shape((7168, 2048), (128, 128)), scale_shape((200, 70), (128, 128))
    ((56, 16), (2, 1))
    """
    return tuple(-(-n // b) for n, b in zip(shape, block))


def block_cut(offset: int, size: int, length: int, block: int) -> int | None:
    """Where the region ``[offset, offset + size)`` of a dim of ``length`` elements cuts a block
    of ``block`` elements (the offending boundary), or None when it starts and ends on block
    boundaries (the dim's end counts as one: the last block may be partial).

    >>> block_cut(0, 128, 200, 128), block_cut(128, 72, 200, 128), block_cut(100, 100, 200, 128)
    (None, None, 100)
    """
    if size == 0:
        return None
    if offset % block:
        return offset
    end = offset + size
    if end % block and end != length:
        return end
    return None


def scale_box(box: Box, block: tuple[int, ...], name: str, storage: str | None) -> Box:
    """The scales of a weight's box (aligned on blocks: :func:`block_cut`), at the place the
    box's blocks have in the scale storage (the weight's storage offsets divided by the block;
    a stacked storage's leading dim is kept).

    >>> w = Box("w", (128, 0), (72, 256), "w", (128, 0))
    >>> str(scale_box(w, (128, 128), "w_scale_inv", "w_scale_inv"))
    'w_scale_inv[1:2, 0:2] at w_scale_inv[1:2, 0:2]'
    """
    offsets = tuple(o // b for o, b in zip(box.offsets, block))
    sizes = tuple(-(-(o + s) // b) - o // b for o, s, b in zip(box.offsets, box.sizes, block))
    stored = box.storage_sizes if box.storage_sizes is not None else box.sizes
    lead = len(box.storage_offsets) - len(box.sizes)
    storage_offsets = (*box.storage_offsets[:lead], *(o // b for o, b in zip(box.storage_offsets[lead:], block)))
    storage_sizes = (*stored[:lead], *sizes) if lead else None
    return Box(name, offsets, sizes, storage, storage_offsets, storage_sizes)


@attrs.frozen
class QuantizeRule:
    """The tensors matching ``pattern`` are stored quantized in ``format``.

    ``block``: the block's sizes along the last dims of a tensor (leading dims take 1), or a
    name of :data:`BLOCKINGS`. ``storage``: the name of the storage receiving the scales, a
    template of the pattern's captures (``storage_fn`` computes it); None: the weight's
    storage name followed by ``_`` and the convention. ``storage_shape``: the local shape that
    storage must have on every rank holding it (None: whatever the blocks make).
    """

    pattern: str
    format: str
    block: tuple[int, ...] | str
    convention: str = "scale_inv"
    scale_dtype: str = "fp32"
    replicated: bool = False
    storage: str | None = None
    storage_shape: tuple[int, ...] | None = None
    storage_fn: Callable[[Mapping[str, int]], str] | None = attrs.field(default=None, eq=False, repr=False)
    span: Span | None = attrs.field(default=None, eq=False, repr=False)
    #: the tensors it quantizes, by name, instead of those ``pattern`` matches (``quantize from
    #: cfg``: what a checkpoint's config names); any pattern of the layout takes precedence
    tensors: frozenset[str] | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        where = f'"{self.pattern}"'
        if self.format not in FORMATS:
            raise LayoutValueError(
                f"quantize {where}: unsupported format '{self.format}' (formats: {', '.join(FORMATS)})",
                self.span,
                did_you_mean(self.format, FORMATS),
            )
        if self.convention not in CONVENTIONS:
            raise LayoutValueError(
                f"quantize {where}: unknown scale convention '{self.convention}' ({' or '.join(CONVENTIONS)})",
                self.span,
                did_you_mean(self.convention, CONVENTIONS),
            )
        allowed = FORMATS[self.format].scale_dtypes
        if self.scale_dtype not in allowed:
            raise LayoutValueError(
                f"quantize {where}: {self.format} keeps its scales in {' or '.join(allowed)}, not '{self.scale_dtype}'",
                self.span,
            )
        if isinstance(self.block, str):
            if self.block not in BLOCKINGS:
                raise LayoutValueError(
                    f"quantize {where}: unknown block shape '{self.block}' (blocks A x B, {', '.join(BLOCKINGS)})",
                    self.span,
                    did_you_mean(self.block, BLOCKINGS),
                )
        elif not self.block or any(b < 1 for b in self.block):
            raise LayoutValueError(f"quantize {where}: block sizes must be at least 1", self.span)
        if self.format == "mxfp8" and self.block != (1, MX_BLOCK) and self.block != (MX_BLOCK,):
            raise LayoutValueError(
                f"quantize {where}: mxfp8 shares one scale per {MX_BLOCK} elements along the reduction dim "
                f"(OCP MX), so its block is 1 x {MX_BLOCK}",
                self.span,
            )

    @property
    def specificity(self) -> int:
        """Number of literal characters; the most specific matching rule wins, as for placements
        (a rule naming its tensors comes after every pattern, as a default rule does)."""
        if self.tensors is not None:
            return -1
        return len(re.sub(r"\{[^}]*\}|\*", "", self.pattern))

    def block_for(self, tensor: LogicalTensor) -> tuple[int, ...]:
        """The block's size along every dim of ``tensor``."""
        shape = tensor.shape
        if not shape:
            raise LayoutValueError(
                f"tensor '{tensor.name}' is a scalar: quantize \"{self.pattern}\" needs a tensor of at least 1 dim",
                self.span,
                tensor=tensor.name,
            )
        if self.block == "per_tensor":
            return tuple(max(1, n) for n in shape)
        if self.block == "per_channel":
            return (*([1] * (len(shape) - 1)), max(1, shape[-1]))
        assert not isinstance(self.block, str)
        if len(self.block) > len(shape):
            raise LayoutValueError(
                f"tensor '{tensor.name}' has {len(shape)} dims but quantize \"{self.pattern}\" gives a block of "
                f"{len(self.block)}",
                self.span,
                tensor=tensor.name,
            )
        return (*([1] * (len(shape) - len(self.block))), *self.block)

    def storage_name(self, captures: Mapping[str, int]) -> str | None:
        if self.storage is None:
            return None
        return self.storage_fn(captures) if self.storage_fn is not None else self.storage


@attrs.frozen
class Quantization:
    """How one tensor of a layout is stored: what :meth:`Layout.quantized
    <layoutlang.model.Layout.quantized>` resolves from the most specific matching
    :class:`QuantizeRule`.

    ``values``: the dtype of the stored values (``fp8_e4m3`` for MXFP8 too); ``scale``: the
    derived scale tensor; ``scale_storage``: the storage the rule names for the scales (None:
    derived from the weight's storage on each rank, :meth:`scale_storage_of`).
    """

    tensor: str
    shape: tuple[int, ...]
    format: str
    block: tuple[int, ...]
    convention: str
    scale: LogicalTensor
    replicated: bool
    rule: QuantizeRule
    scale_storage: str | None = None

    @property
    def values(self) -> str:
        return FORMATS[self.format].values

    @property
    def fmax(self) -> float:
        return FORMATS[self.format].fmax

    def scale_storage_of(self, weight_storage: str | None) -> str:
        """The storage receiving the scales, beside the weight's ``weight_storage``."""
        if self.scale_storage is not None:
            return self.scale_storage
        return f"{weight_storage or self.tensor}_{self.convention}"

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized values and of the scales, together."""
        return math.prod(self.shape) * DTYPES[self.values][0] + self.scale.nbytes
