"""The plan as data: its columns, moves, statistics and serialized form (:class:`Plan`)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from ..core import _core
from ..errors import LayoutNameError, LayoutValueError, core_errors, did_you_mean
from ..model import Layout, compile_pattern
from .quantized import QUANTIZED_AT, QuantizedRegions, quantized_regions

# The public spelling of the core's enums, as moves, reports and JSON write them.
KINDS: tuple[str, ...] = tuple(kind.name for kind in _core.MoveKind)  # local, domain, network
SPACES: tuple[str, ...] = tuple(space.name for space in _core.Space)  # source, destination, scratch
POLICIES: tuple[str, ...] = tuple(policy.name for policy in _core.Policy)  # reshard, broadcast
DEFAULT_BUCKET_BYTES = 256 * 2**20
#: How a plan chooses: ``fleet`` balances holders, landing ranks and buckets by fleet-wide
#: loads (the whole fleet's plan only); ``pairwise`` makes every choice a function of what
#: both ends of a move know (a hash of tensor, box and domain; buckets per pair of ranks),
#: so that one rank can compile its own part alone (``rank=``). See :func:`plan_layouts`.
PLAN_MODES: tuple[str, ...] = ("fleet", "pairwise")

_MAGIC = b"LAYOUTPLAN\x00\x02"
_COLUMNS: tuple[tuple[str, type[np.integer[Any]]], ...] = (
    ("region_tensor", np.int32),
    ("region_dims_start", np.int64),
    ("region_offsets", np.int64),
    ("region_sizes", np.int64),
    ("region_bytes", np.int64),
    ("move_region", np.int32),
    ("move_src", np.int32),
    ("move_dst", np.int32),
    ("move_bucket", np.int32),
    ("move_kind", np.uint8),
    ("move_stage", np.uint8),
    ("move_src_space", np.uint8),
    ("move_dst_space", np.uint8),
    ("move_source", np.uint8),
)

#: Header fields that differ between the parts of one pairwise program (left out of its fingerprint).
_PER_RANK_FIELDS = frozenset({"rank", "num_buckets", "lower_bound_bytes", "broadcast_payload_bytes"})

#: A place a move reads or writes: (storage name, offsets in the storage), None when not held.
Place = tuple[str, tuple[int, ...]] | None


def plan_arrays(
    columns: Mapping[str, npt.ArrayLike], *, num_buckets: int, lower_bound_bytes: int, broadcast_payload_bytes: int
) -> _core.PlanArrays:
    """The core's :class:`PlanArrays` from named columns, each made a contiguous array of its dtype."""
    c = {name: np.ascontiguousarray(columns[name], dtype=dtype) for name, dtype in _COLUMNS}
    return _core.PlanArrays(
        region_tensor=c["region_tensor"],
        region_dims_start=c["region_dims_start"],
        region_offsets=c["region_offsets"],
        region_sizes=c["region_sizes"],
        region_bytes=c["region_bytes"],
        move_region=c["move_region"],
        move_src=c["move_src"],
        move_dst=c["move_dst"],
        move_bucket=c["move_bucket"],
        move_kind=c["move_kind"],
        move_stage=c["move_stage"],
        move_src_space=c["move_src_space"],
        move_dst_space=c["move_dst_space"],
        move_source=c["move_source"],
        num_buckets=num_buckets,
        lower_bound_bytes=lower_bound_bytes,
        broadcast_payload_bytes=broadcast_payload_bytes,
    )


def layout_digest(layout: Layout) -> str:
    """A digest of everything that decides boxes and places: mesh, specs, sub-meshes, storages."""
    resolved = layout.resolved
    h = hashlib.sha256()
    h.update(repr((layout.name, layout.mesh.axes, layout.mesh.ranks)).encode())
    h.update(repr(resolved.specs).encode())
    h.update(repr([(layout.tensors[n].shape, layout.tensors[n].dtype) for n in resolved.names]).encode())
    h.update(np.asarray(resolved.spec_of, dtype=np.int64).tobytes())
    h.update(repr(resolved.submesh_of).encode())
    h.update(repr([(s.name, s.parts, s.dim, s.blocks) for s in resolved.storages]).encode())
    return h.hexdigest()


@attrs.frozen
class Move:
    """One move of a plan, as a readable record."""

    index: int
    tensor: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src: int
    dst: int
    kind: str
    stage: int
    bucket: int
    src_space: str
    dst_space: str
    nbytes: int
    source: int = 0  # which source layout a "source" read uses (recovery plans have several)
    #: into a quantized destination: where its region is quantized (``source``: its sender packs
    #: fp8 values and scales; ``destination``: assembled in bf16 there), else ``none``
    quantized: str = "none"
    wire_bytes: int | None = None  # the bytes it carries after quantization (None: nbytes)

    @property
    def is_relay(self) -> bool:
        """A domain move forwarding what its rank received over the network: from the
        destination storage or a bystander's scratch into a destination storage (reshard,
        stage 1), or from scratch to scratch (broadcast, stage 2)."""
        return self.kind == "domain" and (
            self.src_space == "destination"
            or (self.src_space == "scratch" and (self.stage == 2 or self.dst_space == "destination"))
        )

    def __str__(self) -> str:
        region = ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes))
        notes = [f"bucket {self.bucket}", f"stage {self.stage}"]
        if self.source and self.src_space == "source":
            notes.append(f"source {self.source}")
        if self.is_relay:
            notes.append("relay")
        if "scratch" in (self.src_space, self.dst_space):
            notes.append(f"{self.src_space} -> {self.dst_space}")
        if self.quantized == "source":
            verb = "quantized by its sender" if self.src_space == "source" else "forwarded quantized"
            notes.append(f"{verb}: {self.wire_bytes:,} B for {self.nbytes:,} B")
        elif self.quantized == "destination":
            notes.append("quantized on the destination")
        return f"{self.tensor}[{region}] r{self.src} -> r{self.dst} {self.kind} ({', '.join(notes)})"


@attrs.frozen
class PlanStats:
    """What a plan moves, in total and per rank.

    ``bytes`` maps a kind to the bytes moved by moves of that kind; ``messages`` counts the
    messages (all moves between one pair of ranks in one bucket and stage travel as one);
    ``per_rank`` maps each rank to its sent and received bytes by kind. ``lower_bound`` is
    what no plan can avoid: the bytes each destination rank holds and does not already hold
    as a source. ``moved`` (domain + network bytes) equals it for a pure reshard plan.
    """

    bytes: dict[str, int]
    moves: dict[str, int]
    messages: int
    buckets: int
    lower_bound: int
    broadcast_payload: int
    largest_network_send: tuple[int, int]  # (bytes, rank)
    largest_network_receive: tuple[int, int]
    per_rank: dict[int, dict[str, dict[str, int]]]

    @property
    def moved(self) -> int:
        """Bytes that leave their rank: domain plus network."""
        return self.bytes["domain"] + self.bytes["network"]

    @property
    def ratio_to_lower_bound(self) -> float:
        if not self.lower_bound:
            return 1.0 if not self.moved else float("inf")
        return self.moved / self.lower_bound

    def to_json(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "moved_bytes": self.moved,
            "moves": self.moves,
            "messages": self.messages,
            "buckets": self.buckets,
            "lower_bound_bytes": self.lower_bound,
            "ratio_to_lower_bound": self.ratio_to_lower_bound,
            "broadcast_payload_bytes": self.broadcast_payload,
            "largest_network_send": {"bytes": self.largest_network_send[0], "rank": self.largest_network_send[1]},
            "largest_network_receive": {
                "bytes": self.largest_network_receive[0],
                "rank": self.largest_network_receive[1],
            },
            "per_rank": {str(r): v for r, v in self.per_rank.items()},
        }


# Converters of Plan's fields, typed (mypy's attrs plugin cannot type the generic builtins).
def _policies(policies: Iterable[str]) -> tuple[str, ...]:
    return tuple(policies)


def _layouts(layouts: Iterable[Layout]) -> tuple[Layout, ...]:
    return tuple(layouts)


def _ranks(ranks: Iterable[int]) -> frozenset[int]:
    return frozenset(int(r) for r in ranks)


@attrs.define
class _Derived:
    """What a plan computes from its columns on first use, kept for later uses. (A frozen,
    slotted class caches in a field of its own: functools.cached_property would turn each
    value into a slot and lose its docstring.)"""

    move_tensor: npt.NDArray[np.int32] | None = None
    stats: PlanStats | None = None
    binary: bytes | None = None
    fingerprint: str | None = None
    quantization: list[QuantizedRegions | None] | None = None


@attrs.frozen(eq=False)
class Plan:
    """The moves that turn ``source`` into ``destination`` (pure data, never changed).

    Build one with :func:`compile_plan`. Columns are read-only numpy arrays (``arrays``);
    :meth:`moves` yields readable :class:`Move` records; :meth:`validate` checks that every
    destination byte is written exactly once and every read lies in what its rank holds.

    A *recovery plan* (:func:`plan_recovery`) reads from several source layouts in order of
    preference, never from a ``lost`` rank: ``sources`` lists them (``source`` is the first)
    and each move's ``source`` says which one it reads.

    Derived values (statistics, the binary form, the fingerprint) are computed once, on
    first use. Plans compare by identity: two plans are the same plan when their
    fingerprints are equal.
    """

    source: Layout
    destination: Layout
    name: str
    policies: tuple[str, ...] = attrs.field(converter=_policies)
    domain_size: int
    bucket_bytes: int
    arrays: _core.PlanArrays
    sources: tuple[Layout, ...] = attrs.field(
        kw_only=True, converter=_layouts, default=attrs.Factory(lambda plan: (plan.source,), takes_self=True)
    )
    lost: frozenset[int] = attrs.field(kw_only=True, converter=_ranks, default=frozenset())
    #: ``fleet`` or ``pairwise`` (:data:`PLAN_MODES`)
    mode: str = attrs.field(kw_only=True, default="fleet")
    #: the rank whose moves the plan holds (a per-rank plan, always pairwise); None: every rank's
    rank: int | None = attrs.field(kw_only=True, default=None)
    #: into a quantized layout: where the regions that keep whole blocks are quantized,
    #: ``source`` (their senders) or ``destination`` (:data:`~layoutlang.plan.quantized.QUANTIZE_AT`)
    quantize_at: str = attrs.field(kw_only=True, default="source")
    #: why, in words (the cost model's figures; empty for a plan read from a file)
    quantize_reason: str = attrs.field(kw_only=True, default="")
    _derived: _Derived = attrs.field(init=False, factory=_Derived, repr=False)

    def __repr__(self) -> str:
        of = f" of rank {self.rank}" if self.rank is not None else ""
        return (
            f"Plan({self.name!r}{of}: {self.source.name} -> {self.destination.name}, {self.num_moves} moves "
            f"in {self.num_buckets} buckets, fingerprint {self.fingerprint[:12]})"
        )

    @property
    def is_recovery(self) -> bool:
        """Whether the plan reads from several source layouts or avoids lost ranks."""
        return len(self.sources) > 1 or bool(self.lost)

    # -- sizes
    @property
    def tensors(self) -> list[str]:
        return self.source.resolved.names

    @property
    def num_moves(self) -> int:
        return len(self.arrays.move_region)

    @property
    def num_buckets(self) -> int:
        return int(self.arrays.num_buckets)

    # -- reading moves
    def _column(self, name: str) -> npt.NDArray[Any]:
        return np.asarray(getattr(self.arrays, name))

    def region(self, region: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(tensor, offsets, sizes) of a region."""
        a = self.arrays
        tensor = self.tensors[int(a.region_tensor[region])]
        start = int(a.region_dims_start[region])
        ndim = len(self.source.tensors[tensor].shape)
        offsets = tuple(int(x) for x in a.region_offsets[start : start + ndim])
        sizes = tuple(int(x) for x in a.region_sizes[start : start + ndim])
        return tensor, offsets, sizes

    @property
    def quantization(self) -> QuantizedRegions | None:
        """Where each region is quantized and what it carries, for a plan into a layout that
        stores tensors quantized (None otherwise): :mod:`layoutlang.plan.quantized`."""
        if self._derived.quantization is None:
            found = self.destination.quantized() if not self.is_recovery else {}
            self._derived.quantization = [
                quantized_regions(
                    self.source, self.destination, self.arrays, self.policies, self.quantize_at == "destination"
                )
                if found
                else None
            ]
        return self._derived.quantization[0]

    def move(self, index: int) -> Move:
        a = self.arrays
        region = int(a.move_region[index])
        tensor, offsets, sizes = self.region(region)
        q = self.quantization
        quantized, wire = ("none", None) if q is None else (QUANTIZED_AT[int(q.at[region])], int(q.wire_bytes[region]))
        return Move(
            index,
            tensor,
            offsets,
            sizes,
            int(a.move_src[index]),
            int(a.move_dst[index]),
            _core.MoveKind(int(a.move_kind[index])).name,
            int(a.move_stage[index]),
            int(a.move_bucket[index]),
            _core.Space(int(a.move_src_space[index])).name,
            _core.Space(int(a.move_dst_space[index])).name,
            int(a.region_bytes[region]),
            int(a.move_source[index]),
            quantized,
            wire,
        )

    def moves_at(self, indices: npt.ArrayLike) -> list[Move]:
        """The moves at ``indices``, as :meth:`move` gives them one by one, read from the
        columns at once (what a rank's schedule reads of its part of a plan)."""
        at = np.asarray(indices, dtype=np.intp)
        if not len(at):
            return []
        column = self._column
        region = column("move_region")[at]
        tensor = column("region_tensor")[region]
        start = column("region_dims_start")[region]
        names = self.tensors
        ndims = np.asarray([len(self.source.tensors[n].shape) for n in names], dtype=np.intp)[tensor]
        width = max(1, int(ndims.max()))
        dims = np.minimum(start[:, None] + np.arange(width), max(0, len(column("region_offsets")) - 1))
        offsets = column("region_offsets")[dims].tolist() if len(column("region_offsets")) else [[]] * len(at)
        sizes = column("region_sizes")[dims].tolist() if len(column("region_sizes")) else [[]] * len(at)
        q = self.quantization
        quantized = ["none"] * len(at) if q is None else [QUANTIZED_AT[k] for k in np.asarray(q.at)[region].tolist()]
        wire = [None] * len(at) if q is None else np.asarray(q.wire_bytes)[region].tolist()
        return [
            Move(i, names[t], tuple(o[:n]), tuple(z[:n]), src, dst, KINDS[k], stage, bucket, SPACES[a], SPACES[b],
                 nbytes, source, qz, w)
            for i, t, o, z, n, src, dst, k, stage, bucket, a, b, nbytes, source, qz, w in zip(
                at.tolist(), tensor.tolist(), offsets, sizes, ndims.tolist(), column("move_src")[at].tolist(),
                column("move_dst")[at].tolist(), column("move_kind")[at].tolist(), column("move_stage")[at].tolist(),
                column("move_bucket")[at].tolist(), column("move_src_space")[at].tolist(),
                column("move_dst_space")[at].tolist(), column("region_bytes")[region].tolist(),
                column("move_source")[at].tolist(), quantized, wire,
            )
        ]

    def moves(self, tensor: str | None = None) -> Iterator[Move]:
        """Every move, or the moves of tensors matching ``tensor`` (a name or a pattern)."""
        indices: Iterable[int]
        if tensor is None:
            indices = range(self.num_moves)
        else:
            indices = np.flatnonzero(np.isin(self._move_tensor(), self._tensor_ids(tensor)))
        for i in indices:
            yield self.move(int(i))

    def bytes_between_ranks_by_source(self) -> list[int]:
        """For each source layout of the plan (one, or several for a recovery plan), the bytes
        its moves read there and carry to another rank (domain and network moves out of a
        source storage; relays forward them and are not counted again)."""
        region_bytes = self._column("region_bytes")[self._column("move_region")]
        read = (self._column("move_src_space") == int(_core.Space.source)) & (
            self._column("move_kind") != int(_core.MoveKind.local)
        )
        source = self._column("move_source")
        return [int(region_bytes[read & (source == k)].sum()) for k in range(len(self.sources))]

    def moves_of_rank(self, rank: int) -> npt.NDArray[np.intp]:
        """Indices of the moves that read or write on ``rank``, in plan order."""
        return np.flatnonzero((self._column("move_src") == rank) | (self._column("move_dst") == rank))

    def _move_tensor(self) -> npt.NDArray[np.int32]:
        """The tensor of every move."""
        if self._derived.move_tensor is None:
            self._derived.move_tensor = self._column("region_tensor")[self._column("move_region")]
        return self._derived.move_tensor

    def _tensor_ids(self, pattern: str) -> list[int]:
        names = self.tensors
        if pattern in self.source.tensors:
            return [self.source.resolved.index[pattern]]
        regex = compile_pattern(pattern)
        found = [i for i, n in enumerate(names) if regex.fullmatch(n)]
        if not found:
            raise LayoutNameError(f"no tensor matches '{pattern}'", hint=did_you_mean(pattern, names))
        return found

    def place(self, move: Move | int) -> tuple[Place, Place]:
        """Where a move reads and writes: (storage name, offsets in it) on each side.

        Scratch buffers hold a whole tensor, so their offsets are the region's own offsets
        and their name is the tensor's.
        """
        record = self.move(move) if isinstance(move, int) else move
        return self._locate(record, record.src, record.src_space), self._locate(record, record.dst, record.dst_space)

    def _locate(self, move: Move, rank: int, space: str) -> Place:
        if space == "scratch":
            return (move.tensor, move.offsets)
        layout = self.sources[move.source] if space == "source" else self.destination
        resolved = layout.resolved
        index = resolved.index[move.tensor]
        with core_errors(resolved.names):
            offsets = layout.core.locate(index, rank, list(move.offsets))
        storage = resolved.storages[resolved.storage_of[index]].name
        return (storage, tuple(offsets)) if offsets is not None else None

    # -- checks
    def validate(self) -> None:
        """Raises LayoutValueError unless every destination byte is written exactly once,
        every read lies in what its rank holds (or received in an earlier stage or bucket),
        and every move's kind matches its ranks' domains.

        A per-rank plan (``rank`` set) checks that rank's part: every move sends or receives
        on it, every byte it holds in the destination is written exactly once, what it sends
        lies in what it holds or received in an earlier stage, and no message carries more
        than ``bucket_bytes``."""
        with core_errors(self.tensors):
            if self.mode == "pairwise":
                problems = _core.validate_pairwise_plan(
                    self.arrays,
                    self.source.core,
                    self.destination.core,
                    self.domain_size,
                    self.bucket_bytes,
                    -1 if self.rank is None else self.rank,
                )
            elif self.is_recovery:
                problems = _core.validate_recovery_plan(
                    self.arrays,
                    [layout.core for layout in self.sources],
                    sorted(self.lost),
                    self.destination.core,
                    self.domain_size,
                    self.bucket_bytes,
                )
            else:
                problems = _core.validate_plan(
                    self.arrays, self.source.core, self.destination.core, self.domain_size, self.bucket_bytes
                )
        if problems:
            raise LayoutValueError(f"plan '{self.name}' is invalid: " + "; ".join(problems))

    # -- statistics
    @property
    def stats(self) -> PlanStats:
        """Bytes, moves and messages by kind, in total and per rank (computed once)."""
        if self._derived.stats is None:
            self._derived.stats = self._compute_stats()
        return self._derived.stats

    def _compute_stats(self) -> PlanStats:
        """The totals of the plan's moves; a per-rank plan's are that rank's (what it sends
        and receives), and ``per_rank`` holds that rank alone."""
        ranks = sorted(set(self.destination.mesh.ranks).union(*(s.mesh.ranks for s in self.sources)))
        with core_errors(self.tensors):
            totals = _core.plan_totals(self.arrays, max(ranks) + 1)
        if self.rank is not None:
            ranks = [self.rank]
        sent, received = np.asarray(totals.sent), np.asarray(totals.received)
        per_rank = {
            r: {
                "sent": {kind.name: int(sent[r, kind]) for kind in _core.MoveKind},
                "received": {kind.name: int(received[r, kind]) for kind in _core.MoveKind},
            }
            for r in ranks
        }
        network = _core.MoveKind.network
        return PlanStats(
            {kind.name: totals.bytes[kind] for kind in _core.MoveKind},
            {kind.name: totals.moves[kind] for kind in _core.MoveKind},
            totals.messages,
            self.num_buckets,
            int(self.arrays.lower_bound_bytes),
            int(self.arrays.broadcast_payload_bytes),
            (int(sent[:, network].max()), int(sent[:, network].argmax())),
            (int(received[:, network].max()), int(received[:, network].argmax())),
            per_rank,
        )

    # -- serialization
    def _header(self) -> dict[str, Any]:
        recovery = (
            {
                "recovery_sources": [layout.name for layout in self.sources],
                "recovery_source_digests": [layout_digest(layout) for layout in self.sources],
                "lost": sorted(self.lost),
            }
            if self.is_recovery
            else {}
        )
        # A pairwise plan says so (and, per rank, whose part it is); a fleet plan's header is as before.
        mode: dict[str, Any] = {} if self.mode == "fleet" else {"mode": self.mode}
        if self.rank is not None:
            mode["rank"] = self.rank
        return recovery | mode | {
            "format": "layoutlang-plan",
            "version": 1,
            "reshard": self.name,
            "source": self.source.name,
            "destination": self.destination.name,
            "source_digest": layout_digest(self.source),
            "destination_digest": layout_digest(self.destination),
            "domain_size": self.domain_size,
            "bucket_bytes": self.bucket_bytes,
            "broadcast_tensors": [i for i, p in enumerate(self.policies) if p == "broadcast"],
            "tensors": [[n, list(self.source.tensors[n].shape), self.source.tensors[n].dtype] for n in self.tensors],
            "num_buckets": self.num_buckets,
            "lower_bound_bytes": int(self.arrays.lower_bound_bytes),
            "broadcast_payload_bytes": int(self.arrays.broadcast_payload_bytes),
        } | self._quantized_header()

    def _quantized_header(self) -> dict[str, Any]:
        """How the destination stores its quantized tensors (absent when it stores none): a
        plan into fp8 differs from the plan into bf16 of the same boxes."""
        found = self.destination.quantized() if not self.is_recovery else {}
        if not found:
            return {}
        at = {"quantize_at": self.quantize_at} if self.quantize_at != "source" else {}  # as before when source
        return at | {
            "quantized": [
                [name, q.format, list(q.block), q.convention, q.scale.dtype, q.replicated]
                for name, q in found.items()
            ]
        }

    def to_bytes(self) -> bytes:
        """The compact binary form: a JSON header, then every column as little-endian arrays."""
        if self._derived.binary is None:
            self._derived.binary = b"".join(self._binary_parts())
        return self._derived.binary

    def _binary_parts(self) -> Iterator[bytes | memoryview]:
        """The pieces of :meth:`to_bytes` in order, each column as a view where it is already
        little-endian and contiguous: the fingerprint digests them without a copy of the plan
        (a whole fleet's plan is gigabytes)."""
        header = json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode()
        yield from (_MAGIC, struct.pack("<Q", len(header)), header)
        for name, dtype in _COLUMNS:
            column = np.ascontiguousarray(self._column(name), dtype=np.dtype(dtype).newbyteorder("<"))
            yield struct.pack("<Q", column.size)
            yield column.data.cast("B")

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the binary form: equal on every rank that compiled the same plan.

        A pairwise plan is a function of its program alone, and each rank of a per-rank plan
        holds another part of it: its fingerprint is a digest of the program (both layouts'
        :func:`layout_digest`, the policies, the tensors, the options and the mode), equal on
        every rank of the same program, whole or per rank, and different when any of them
        differs."""
        if self._derived.fingerprint is None:
            if self.mode == "pairwise":
                program = {k: v for k, v in self._header().items() if k not in _PER_RANK_FIELDS}
                digest = json.dumps(program, sort_keys=True, separators=(",", ":")).encode()
                self._derived.fingerprint = hashlib.sha256(digest).hexdigest()
            else:
                plan_hash = hashlib.sha256()
                for part in self._binary_parts() if self._derived.binary is None else (self._derived.binary,):
                    plan_hash.update(part)
                self._derived.fingerprint = plan_hash.hexdigest()
        return self._derived.fingerprint

    def to_json(self, moves: bool = True) -> dict[str, Any]:
        """A JSON-ready description: the header, statistics and (optionally) every move."""
        out = self._header()
        out["fingerprint"] = self.fingerprint
        out["stats"] = self.stats.to_json()
        if self.quantization is not None:
            out["stats"]["quantization"] = self.quantization.totals(self.arrays)
        if moves:
            out["moves"] = [
                {
                    "tensor": m.tensor,
                    "offsets": list(m.offsets),
                    "sizes": list(m.sizes),
                    "src": m.src,
                    "dst": m.dst,
                    "kind": m.kind,
                    "stage": m.stage,
                    "bucket": m.bucket,
                    "src_space": m.src_space,
                    "dst_space": m.dst_space,
                    "bytes": m.nbytes,
                }
                | ({"source": self.sources[m.source].name} if self.is_recovery else {})
                | ({"quantized": m.quantized, "wire_bytes": m.wire_bytes} if m.wire_bytes is not None else {})
                for m in self.moves()
            ]
        return out
