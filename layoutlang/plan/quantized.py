"""Plans into quantized destinations (issue 16): where each region is quantized, and its bytes.

A destination layout's ``quantize`` statement stores a tensor as fp8 values plus a scale per
block (:mod:`layoutlang.model.quantization`). Its plan is the plan of the logical bf16
tensor, as for any destination, with slab cuts on block boundaries (the core's ``slabs()``
reads the block, :func:`record_blocks`); this module then decides, region by region, where
the region is quantized:

- **at its sender** (``source``) when the region covers whole blocks (it starts and ends on
  block boundaries along every dim, the tensor's end counting as one): the sender holds
  every element of those blocks, so its amax is the block's, and the region travels as fp8
  values followed by its blocks' scales. A relay forwards values and scales as they arrived.
- **on its destination** (``destination``) otherwise (a source holding that splits a block,
  such as a TP shard of 100 rows beside 128-row blocks): the region travels in the logical
  dtype into a bf16 buffer of the destination box it lands in, and once every region of that
  box has arrived the rank quantizes the blocks it assembled. Destination boxes are whole
  blocks (the language checks it), so every block is assembled whole on each rank that
  stores it: its amax is never split across ranks.

Either way each destination byte equals what quantizing the whole tensor in one process
gives (the rule of ``csrc/quantize.hpp``). A region of a tensor the destination does not
quantize is ``none``.

:func:`check_quantized_plan` refuses, naming the tensor, what plans do not do: a quantized
source (nothing is dequantized), replicated scales on a rank that does not hold the whole
tensor (it would need the amax of blocks it holds none of), recovery plans into a quantized
layout. A tensor moved by the broadcast policy is planned as it is (``none``: bf16 gathered
and broadcast, the baseline ``layoutlang plan`` compares with); the executor refuses to run
such a plan into a quantized tensor (:func:`broadcast_into_quantized`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..core import _core
from ..errors import LayoutValueError
from ..model import Layout, Topology
from ..model.dtypes import DTYPES
from ..model.quantization import Quantization

__all__ = [
    "QUANTIZED_AT",
    "QuantizedRegions",
    "broadcast_into_quantized",
    "check_quantized_plan",
    "quantized_regions",
    "record_blocks",
]

#: where a region is quantized: ``none`` (the tensor is not), at its ``source`` (the sender
#: packs fp8 values and scales), on its ``destination`` (assembled in bf16, quantized there)
QUANTIZED_AT: tuple[str, ...] = ("none", "source", "destination")
_ALIGN = 16  # the scales of a region start 16-byte aligned after its values (as regions in a message)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def record_blocks(layout: Layout) -> None:
    """Gives the core the quantization block of each tensor ``layout`` quantizes, so that a
    plan into it cuts slabs on block boundaries (a slab of whole blocks is quantized by its
    sender). Recording the same blocks again changes nothing."""
    index = layout.resolved.index
    for name, q in layout.quantized().items():
        _core.set_quant_block(layout.core, index[name], list(q.block))


def check_quantized_plan(
    sources: Sequence[Layout], destination: Layout, *, recovery: bool = False
) -> dict[str, Quantization]:
    """The destination's quantized tensors, once what plans cannot do with them is refused
    (a :class:`~layoutlang.errors.LayoutValueError` naming the tensor, before any plan)."""
    for source in sources:
        for name, q in source.quantized().items():
            raise LayoutValueError(
                f"tensor '{name}' is stored quantized ({q.format}) in the source layout '{source.name}': plans "
                "read sources in their logical dtype and dequantize nothing",
                q.rule.span or source.span,
                "refit from the bf16 (training) layout",
                tensor=name,
            )
    found = destination.quantized()
    if not found:
        return found
    if recovery:
        name, q = next(iter(found.items()))
        raise LayoutValueError(
            f"tensor '{name}' is stored quantized in '{destination.name}': recovery plans into a quantized "
            "layout are not planned (they would read fp8 replicas)",
            q.rule.span or destination.span,
            tensor=name,
        )
    for name, q in found.items():
        if not q.replicated:
            continue
        numel = int(np.prod(q.shape))
        for rank in destination.holders(name):
            held = sum(int(np.prod(b.sizes)) for b in destination.boxes(name, rank))
            if held and held != numel:
                raise LayoutValueError(
                    f"tensor '{name}': its scales are replicated in '{destination.name}' but rank {rank} holds "
                    f"{held:,} of its {numel:,} elements; a plan fills replicated scales only where every rank "
                    "holding the weight holds all of it (the others would need the amax of blocks they do not hold)",
                    q.rule.span or destination.span,
                    "quantize this tensor with blocks each holder holds whole, its scales placed like the weight "
                    "(drop 'replicate'; blocks that fit inside each rank's shard, e.g. 128 x 128), or leave it "
                    "unquantized: replicated scales of a sharded weight are not planned yet",
                    tensor=name,
                    rank=rank,
                )
    return found


@attrs.frozen(eq=False)
class QuantizedRegions:
    """Per region of a plan: where it is quantized (an index into :data:`QUANTIZED_AT`), how
    many blocks it covers (0 for a tensor stored as it is), and the bytes it puts on the wire
    (fp8 values, then its scales at the next 16-byte boundary, for a region quantized at its
    sender; its logical bytes otherwise)."""

    at: npt.NDArray[np.uint8]
    blocks: npt.NDArray[np.int64]
    wire_bytes: npt.NDArray[np.int64]
    quantized: dict[str, Quantization]

    def totals(self, arrays: Any) -> dict[str, Any]:
        """What the plan's moves carry, by kind: ``logical_bytes`` (as the plan's statistics
        count them: the tensors' own dtype) and ``wire_bytes`` (after quantization), the moves
        of regions quantized at their sender and on their destination, and the blocks the
        senders quantize (relays forward theirs; a destination's assembled blocks are counted
        by its executor)."""
        region = np.asarray(arrays.move_region)
        kind = np.asarray(arrays.move_kind)
        at = self.at[region]
        logical = np.asarray(arrays.region_bytes)[region]
        wire = self.wire_bytes[region]
        from_source = np.asarray(arrays.move_src_space) == _core.Space.source.value
        out: dict[str, Any] = {"logical_bytes": {}, "wire_bytes": {}, "moves_quantized_at": {}}
        for k in _core.MoveKind:
            mask = kind == k.value
            out["logical_bytes"][k.name] = int(logical[mask].sum())
            out["wire_bytes"][k.name] = int(wire[mask].sum())
        for code, where in enumerate(QUANTIZED_AT[1:], start=1):
            out["moves_quantized_at"][where] = int((at == code).sum())
        quantizing = (at == 1) & from_source
        out["blocks_quantized_by_senders"] = int(self.blocks[region][quantizing].sum())
        net = out["logical_bytes"]["network"]
        out["network_ratio"] = out["wire_bytes"]["network"] / net if net else 1.0
        out["tensors"] = len(self.quantized)
        return out


def broadcast_into_quantized(destination: Layout, tensors: Sequence[str], policies: Sequence[str]) -> str | None:
    """The first tensor a plan moves by the broadcast policy into a quantized tensor of
    ``destination`` (its regions gather and broadcast in bf16: nothing quantizes them), or None."""
    found = destination.quantized()
    return next((n for n, p in zip(tensors, policies) if p != "reshard" and n in found), None)


def quantized_regions(
    source: Layout,
    destination: Layout,
    arrays: Any,
    policies: Sequence[str] | None = None,
    at_destination: bool = False,
) -> QuantizedRegions:
    """Where each region of a plan's ``arrays`` (from ``source`` to ``destination``) is
    quantized, and its bytes on the wire (numpy over all regions: DeepSeek-V3's plans hold
    millions). Tensors whose policy (``policies``, one per tensor) is not ``reshard`` are
    left as they are. A region that keeps whole blocks is quantized by its sender, one that
    splits a block on its destination; ``at_destination``: every region on its destination
    (:func:`choose_quantize_at`)."""
    found = destination.quantized()
    names = source.resolved.names
    tensor_of = np.asarray(arrays.region_tensor, dtype=np.int64)
    starts = np.asarray(arrays.region_dims_start, dtype=np.int64)
    offsets = np.asarray(arrays.region_offsets, dtype=np.int64)
    sizes = np.asarray(arrays.region_sizes, dtype=np.int64)
    logical = np.asarray(arrays.region_bytes, dtype=np.int64)
    count = len(tensor_of)
    at = np.zeros(count, dtype=np.uint8)
    blocks = np.zeros(count, dtype=np.int64)
    wire = logical.copy()
    if not found or not count:
        return QuantizedRegions(at, blocks, wire, found)
    ndims = np.array([len(source.tensors[n].shape) for n in names], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum(ndims)[:-1]])  # each tensor's first dim in the flat arrays
    block_flat = np.ones(int(ndims.sum()), dtype=np.int64)
    shape_flat = np.ones(int(ndims.sum()), dtype=np.int64)
    quantized = np.zeros(len(names), dtype=bool)
    value_size = np.zeros(len(names), dtype=np.int64)
    scale_size = np.zeros(len(names), dtype=np.int64)
    for t, name in enumerate(names):
        shape_flat[first[t] : first[t] + ndims[t]] = source.tensors[name].shape
        q = found.get(name)
        if q is not None and (policies is None or policies[t] == "reshard"):
            quantized[t] = True
            block_flat[first[t] : first[t] + ndims[t]] = q.block
            value_size[t] = DTYPES[q.values][0]
            scale_size[t] = DTYPES[q.scale.dtype][0]
    mine = quantized[tensor_of]
    aligned = mine.copy()
    nblocks = mine.astype(np.int64)
    numel = np.ones(count, dtype=np.int64)
    nd = ndims[tensor_of]
    for d in range(int(nd.max())):
        has = nd > d
        at_dim = starts[has] + d
        o, s = offsets[at_dim], sizes[at_dim]
        flat = first[tensor_of[has]] + d
        b, n = block_flat[flat], shape_flat[flat]
        end = o + s
        aligned[has] &= (o % b == 0) & ((end % b == 0) | (end == n))
        nblocks[has] *= -(-end // b) - o // b
        numel[has] *= s
    at[mine] = np.where(aligned[mine] & (not at_destination), 1, 2)
    blocks[mine] = nblocks[mine]
    sender = at == 1
    values = numel[sender] * value_size[tensor_of[sender]]
    wire[sender] = -(-values // _ALIGN) * _ALIGN + nblocks[sender] * scale_size[tensor_of[sender]]
    return QuantizedRegions(at, blocks, wire, found)


#: where a plan quantizes the regions that keep whole blocks: ``source`` (their senders: fp8
#: crosses the links) or ``destination`` (their receivers: bf16 crosses; what splits a block
#: is quantized on its destination either way); ``auto``: :func:`choose_quantize_at` decides
QUANTIZE_AT: tuple[str, ...] = ("auto", "source", "destination")


@attrs.frozen
class QuantizeChoice:
    """Where a plan quantizes (``at``: ``source`` or ``destination``) and why, in words;
    ``regions``: the plan's :func:`quantized_regions` where the cost model computed them for
    the side it chose (the plan keeps them instead of computing them again)."""

    at: str
    reason: str
    regions: QuantizedRegions | None = attrs.field(default=None, eq=False, repr=False)


def choose_quantize_at(
    source: Layout, destination: Layout, arrays: Any, policies: Sequence[str], topology: Topology
) -> QuantizeChoice:
    """The cost model's choice for a fleet plan into a quantized destination.

    Each rank's time is what its busiest resource takes, as the executor overlaps them: its
    quantizer (``topology.quantize_bandwidth``: bytes of source a rank quantizes per second)
    and each of its links, out and in (``network_bandwidth``, ``domain_bandwidth``), carrying
    the plan's bytes. Quantized by their senders, the regions that keep whole blocks cost the
    sender their quantizing and cross as fp8; quantized on their destinations, they cross in
    bf16 and cost the receiver. The plan takes the side whose slowest rank is faster: the
    destination where links are faster than the senders can quantize what they send (one
    sender feeding many receivers, say), the source otherwise and when the topology does not
    say how fast a rank quantizes."""
    if topology.quantize_bandwidth is None:
        return QuantizeChoice(
            "source", "the senders quantize: the topology gives no quantize_bandwidth to weigh against its links"
        )
    if topology.network_bandwidth is None or (topology.domain_size > 1 and topology.domain_bandwidth is None):
        return QuantizeChoice("source", "the senders quantize: the topology gives no link bandwidths")
    quantize_rate = topology.quantize_bandwidth
    regions = quantized_regions(source, destination, arrays, policies)
    region = np.asarray(arrays.move_region)
    src = np.asarray(arrays.move_src, dtype=np.int64)
    dst = np.asarray(arrays.move_dst, dtype=np.int64)
    kind = np.asarray(arrays.move_kind)
    logical = np.asarray(arrays.region_bytes, dtype=np.int64)[region]
    wire = regions.wire_bytes[region]
    eligible = regions.at[region] == 1
    # who quantizes a move: its sender where it reads the source (a relay forwards what it
    # got), or its receiver where it writes a destination storage (a bystander's scratch
    # only passes it on)
    by_sender = eligible & (np.asarray(arrays.move_src_space) == _core.Space.source.value)
    by_receiver = eligible & (np.asarray(arrays.move_dst_space) == _core.Space.destination.value)
    ranks = int(max(src.max(initial=-1), dst.max(initial=-1))) + 1
    links = {_core.MoveKind.network.value: topology.network_bandwidth}
    if topology.domain_bandwidth is not None:
        links[_core.MoveKind.domain.value] = topology.domain_bandwidth

    def slowest(
        quantizer: npt.NDArray[np.int64], quantized: npt.NDArray[np.bool_], carried: npt.NDArray[np.int64]
    ) -> tuple[float, int, str]:
        """The slowest rank's time, that rank, and its busiest resource, when the ranks in
        ``quantizer`` quantize the ``quantized`` moves and the links carry ``carried``."""
        quantizing = np.bincount(quantizer[quantized], weights=logical[quantized], minlength=ranks)
        busiest = quantizing / quantize_rate
        what = np.zeros(ranks, dtype=np.int64)  # 0: quantizing, 1: a link out, 2: a link in
        for code, bandwidth in links.items():
            on = kind == code
            for way, ends in ((1, src), (2, dst)):
                t = np.bincount(ends[on], weights=carried[on], minlength=ranks) / bandwidth
                what = np.where(t > busiest, way, what)
                busiest = np.maximum(busiest, t)
        rank = int(np.argmax(busiest))
        return float(busiest[rank]), rank, ("quantizing", "sending", "receiving")[int(what[rank])]

    if ranks == 0 or not eligible.any():
        return QuantizeChoice("source", "the senders quantize: no region keeps whole blocks (each splits one)")
    at_source = slowest(src, by_sender, np.where(eligible, wire, logical))
    at_destination = slowest(dst, by_receiver, logical)
    rate = quantize_rate / 1e9
    figures = (
        f"the slowest rank takes {at_source[0]:.3g} s quantizing at the senders (rank {at_source[1]}, "
        f"{at_source[2]}) against {at_destination[0]:.3g} s at the destinations (rank {at_destination[1]}, "
        f"{at_destination[2]}), quantizing {rate:g} GB/s per rank"
    )
    if at_destination[0] < at_source[0]:
        return QuantizeChoice("destination", f"the destinations quantize (cost model): {figures}")
    return QuantizeChoice("source", f"the senders quantize (cost model): {figures}", regions)


def region_wire_bytes(numel: int, nblocks: int, q: Quantization) -> int:
    """The bytes a region of ``numel`` elements covering ``nblocks`` whole blocks of ``q``'s
    tensor puts on the wire when its sender quantizes it (values, then scales aligned)."""
    return _aligned(numel * DTYPES[q.values][0]) + nblocks * DTYPES[q.scale.dtype][0]
