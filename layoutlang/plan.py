"""Plans: the moves that turn a source layout into a destination layout.

A :class:`Plan` is pure data compiled by the C++ core (:func:`compile_plan`) and never
changed afterwards. Naming, as everywhere in layoutlang:

- a **region** is a box of one logical tensor that moves as a unit;
- a **move** is one transfer of one region between two ranks: ``local`` (the same rank),
  ``domain`` (the same domain: NVLink) or ``network`` (across domains); a **relay** is a
  domain move that forwards a region its rank received in an earlier stage;
- a **stage** orders moves inside a bucket: relays run after the network stage that feeds
  them; gather-and-broadcast runs gather (0), broadcast (1, 2) and extraction (3);
- a **bucket** is a group of moves executed together; no rank stages more than the
  bucket budget of bytes in one bucket;
- a move reads from and writes to a **space** of its rank: the ``source`` storage, the
  ``destination`` storage, or a ``scratch`` buffer holding a whole tensor (gather-and-broadcast).

Every rank computes the same plan from the same program, without communication; the
plan's :attr:`~Plan.fingerprint` lets ranks compare plans before moving a byte.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs
import numpy as np

from . import _core
from .errors import LayoutError, LayoutNameError, LayoutValueError, did_you_mean
from .loss import check_recoverable
from .model import Layout, Program, Reshard, compile_pattern

__all__ = [
    "KINDS",
    "SPACES",
    "POLICIES",
    "DEFAULT_BUCKET_BYTES",
    "Move",
    "Plan",
    "PlanStats",
    "compile_plan",
    "plan_layouts",
    "plan_recovery",
]

KINDS = ("local", "domain", "network")
SPACES = ("source", "destination", "scratch")
POLICIES = ("reshard", "broadcast")
DEFAULT_BUCKET_BYTES = 256 * 2**20

_MAGIC = b"LAYOUTPLAN\x00\x02"
_COLUMNS = (
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

    @property
    def is_relay(self) -> bool:
        """A domain move forwarding what its rank received over the network: from the
        destination storage (reshard, stage 1) or the scratch buffer (broadcast, stage 2)."""
        return self.kind == "domain" and (
            self.src_space == "destination" or (self.src_space == "scratch" and self.stage == 2)
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


class Plan:
    """The moves that turn ``source`` into ``destination`` (pure data, never changed).

    Build one with :func:`compile_plan`. Columns are read-only numpy arrays (``arrays``);
    :meth:`moves` yields readable :class:`Move` records; :meth:`validate` checks that every
    destination byte is written exactly once and every read lies in what its rank holds.

    A *recovery plan* (:func:`plan_recovery`) reads from several source layouts in order of
    preference, never from a ``lost`` rank: ``sources`` lists them (``source`` is the first)
    and each move's ``source`` says which one it reads.
    """

    __slots__ = (
        "source",
        "sources",
        "lost",
        "destination",
        "name",
        "policies",
        "domain_size",
        "bucket_bytes",
        "arrays",
        "_cache",
    )

    def __init__(
        self,
        source: Layout,
        destination: Layout,
        name: str,
        policies: tuple[str, ...],
        domain_size: int,
        bucket_bytes: int,
        arrays: Any,
        *,
        sources: Sequence[Layout] | None = None,
        lost: Iterable[int] = (),
    ):
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "sources", tuple(sources) if sources is not None else (source,))
        object.__setattr__(self, "lost", frozenset(int(r) for r in lost))
        object.__setattr__(self, "destination", destination)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "policies", policies)
        object.__setattr__(self, "domain_size", domain_size)
        object.__setattr__(self, "bucket_bytes", bucket_bytes)
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Plan is immutable")

    def __repr__(self) -> str:
        return (
            f"Plan({self.name!r}: {self.source.name} -> {self.destination.name}, {self.num_moves} moves "
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
    def _column(self, name: str) -> np.ndarray:
        return np.asarray(getattr(self.arrays, name))

    def region(self, region: int) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        """(tensor, offsets, sizes) of a region."""
        a = self.arrays
        tensor = int(a.region_tensor[region])
        start = int(a.region_dims_start[region])
        ndim = len(self.source.tensors[self.tensors[tensor]].shape)
        offsets = tuple(int(x) for x in a.region_offsets[start : start + ndim])
        sizes = tuple(int(x) for x in a.region_sizes[start : start + ndim])
        return self.tensors[tensor], offsets, sizes

    def move(self, index: int) -> Move:
        a = self.arrays
        region = int(a.move_region[index])
        tensor, offsets, sizes = self.region(region)
        return Move(
            index,
            tensor,
            offsets,
            sizes,
            int(a.move_src[index]),
            int(a.move_dst[index]),
            KINDS[a.move_kind[index]],
            int(a.move_stage[index]),
            int(a.move_bucket[index]),
            SPACES[a.move_src_space[index]],
            SPACES[a.move_dst_space[index]],
            int(a.region_bytes[region]),
            int(a.move_source[index]),
        )

    def moves(self, tensor: str | None = None) -> Iterator[Move]:
        """Every move, or the moves of tensors matching ``tensor`` (a name or a pattern)."""
        if tensor is None:
            indices: Sequence[int] = range(self.num_moves)
        else:
            indices = np.flatnonzero(np.isin(self._move_tensor(), self._tensor_ids(tensor)))
        for i in indices:
            yield self.move(int(i))

    def moves_of_rank(self, rank: int) -> np.ndarray:
        """Indices of the moves that read or write on ``rank``, in plan order."""
        return np.flatnonzero((self._column("move_src") == rank) | (self._column("move_dst") == rank))

    def _move_tensor(self) -> np.ndarray:
        if "move_tensor" not in self._cache:
            self._cache["move_tensor"] = self._column("region_tensor")[self._column("move_region")]
        return self._cache["move_tensor"]

    def _tensor_ids(self, pattern: str) -> list[int]:
        names = self.tensors
        if pattern in self.source.tensors:
            return [self.source.resolved.index[pattern]]
        regex = compile_pattern(pattern)
        found = [i for i, n in enumerate(names) if regex.fullmatch(n)]
        if not found:
            raise LayoutNameError(f"no tensor matches '{pattern}'", hint=did_you_mean(pattern, names))
        return found

    def place(self, move: Move | int) -> tuple[tuple[str, tuple[int, ...]] | None, tuple[str, tuple[int, ...]] | None]:
        """Where a move reads and writes: (storage name, offsets in it) on each side.

        Scratch buffers hold a whole tensor, so their offsets are the region's own offsets
        and their name is the tensor's.
        """
        if isinstance(move, int):
            move = self.move(move)

        def locate(rank: int, space: str):
            if space == "scratch":
                return (move.tensor, move.offsets)
            layout = self.sources[move.source] if space == "source" else self.destination
            index = layout.resolved.index[move.tensor]
            offsets = layout.core.locate(index, rank, list(move.offsets))
            storage = layout.resolved.storages[layout.resolved.storage_of[index]].name
            return (storage, tuple(offsets)) if offsets is not None else None

        return locate(move.src, move.src_space), locate(move.dst, move.dst_space)

    # -- checks
    def validate(self) -> None:
        """Raises LayoutValueError unless every destination byte is written exactly once,
        every read lies in what its rank holds (or received in an earlier stage or bucket),
        and every move's kind matches its ranks' domains."""
        if self.is_recovery:
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
        if "stats" not in self._cache:
            self._cache["stats"] = self._compute_stats()
        return self._cache["stats"]

    def _compute_stats(self) -> PlanStats:
        ranks = sorted(set(self.destination.mesh.ranks).union(*(s.mesh.ranks for s in self.sources)))
        totals = _core.plan_totals(self.arrays, max(ranks) + 1)
        sent = np.asarray(totals["sent"], dtype=np.int64).reshape(-1, 3)
        received = np.asarray(totals["received"], dtype=np.int64).reshape(-1, 3)
        per_rank = {
            r: {
                "sent": {k: int(sent[r, i]) for i, k in enumerate(KINDS)},
                "received": {k: int(received[r, i]) for i, k in enumerate(KINDS)},
            }
            for r in ranks
        }
        network = KINDS.index("network")
        return PlanStats(
            dict(zip(KINDS, totals["bytes"])),
            dict(zip(KINDS, totals["moves"])),
            totals["messages"],
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
                "recovery_source_digests": [_layout_digest(layout) for layout in self.sources],
                "lost": sorted(self.lost),
            }
            if self.is_recovery
            else {}
        )
        return recovery | {
            "format": "layoutlang-plan",
            "version": 1,
            "reshard": self.name,
            "source": self.source.name,
            "destination": self.destination.name,
            "source_digest": _layout_digest(self.source),
            "destination_digest": _layout_digest(self.destination),
            "domain_size": self.domain_size,
            "bucket_bytes": self.bucket_bytes,
            "broadcast_tensors": [i for i, p in enumerate(self.policies) if p == "broadcast"],
            "tensors": [[n, list(self.source.tensors[n].shape), self.source.tensors[n].dtype] for n in self.tensors],
            "num_buckets": self.num_buckets,
            "lower_bound_bytes": int(self.arrays.lower_bound_bytes),
            "broadcast_payload_bytes": int(self.arrays.broadcast_payload_bytes),
        }

    def to_bytes(self) -> bytes:
        """The compact binary form: a JSON header, then every column as little-endian arrays."""
        if "bytes" not in self._cache:
            header = json.dumps(self._header(), sort_keys=True, separators=(",", ":")).encode()
            parts = [_MAGIC, struct.pack("<Q", len(header)), header]
            for name, dtype in _COLUMNS:
                column = np.ascontiguousarray(self._column(name), dtype=np.dtype(dtype).newbyteorder("<"))
                parts.append(struct.pack("<Q", column.size))
                parts.append(column.tobytes())
            self._cache["bytes"] = b"".join(parts)
        return self._cache["bytes"]

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the binary form: equal on every rank that compiled the same plan."""
        if "fingerprint" not in self._cache:
            self._cache["fingerprint"] = hashlib.sha256(self.to_bytes()).hexdigest()
        return self._cache["fingerprint"]

    @classmethod
    def from_bytes(cls, data: bytes, program: Program) -> Plan:
        """Reads a plan written by :meth:`to_bytes` for ``program``; it must describe the
        same layouts (their digests are compared), and it is validated."""
        if not data.startswith(_MAGIC):
            raise LayoutValueError("not a layoutlang plan (bad magic bytes)")
        try:
            pos = len(_MAGIC)
            (length,) = struct.unpack_from("<Q", data, pos)
            pos += 8
            header = json.loads(data[pos : pos + length])
            pos += length
            columns = {}
            for name, dtype in _COLUMNS:
                (count,) = struct.unpack_from("<Q", data, pos)
                pos += 8
                size = count * np.dtype(dtype).itemsize
                if pos + size > len(data):
                    raise ValueError("truncated")
                columns[name] = np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<"), count=count, offset=pos).astype(dtype)
                pos += size
        except (struct.error, ValueError, json.JSONDecodeError) as err:
            raise LayoutValueError(f"the plan file is damaged ({err})") from None
        try:
            return cls._from_header(header, columns, program)
        except (KeyError, TypeError, IndexError) as err:
            raise LayoutValueError(f"the plan file is damaged (its header lacks or garbles {err})") from None

    @classmethod
    def _from_header(cls, header: dict[str, Any], columns: dict[str, np.ndarray], program: Program) -> Plan:
        if "recovery_sources" in header:
            raise LayoutValueError(
                "this is a recovery plan (sources "
                + ", ".join(repr(n) for n in header["recovery_sources"])
                + f", lost ranks {header['lost']}): survivors compile recovery plans themselves "
                "from the agreed layouts; they are not read back from files"
            )
        source = program.layout(header["source"])
        destination = program.layout(header["destination"])
        for side, layout in (("source", source), ("destination", destination)):
            if header[f"{side}_digest"] != _layout_digest(layout):
                raise LayoutValueError(
                    f"the plan was compiled for a different {side} layout '{layout.name}' than {program.path} declares"
                )
        arrays = _core.PlanArrays(
            *(columns[name] for name, _ in _COLUMNS),
            header["num_buckets"],
            header["lower_bound_bytes"],
            header["broadcast_payload_bytes"],
        )
        broadcast = set(header["broadcast_tensors"])
        policies = tuple("broadcast" if i in broadcast else "reshard" for i in range(len(header["tensors"])))
        plan = cls(
            source,
            destination,
            header["reshard"],
            policies,
            header["domain_size"],
            header["bucket_bytes"],
            arrays,
        )
        plan.validate()
        # The header's totals are derived data: recompute them rather than trust them.
        check = plan_layouts(
            source, destination, name=plan.name, domain_size=plan.domain_size, bucket_bytes=plan.bucket_bytes, policies=policies
        )
        for field in ("num_buckets", "lower_bound_bytes", "broadcast_payload_bytes"):
            if header[field] != int(getattr(check.arrays, field)) and field != "num_buckets":
                raise LayoutValueError(f"the plan file is damaged: its {field} does not match the program")
        if header["num_buckets"] != (int(np.max(columns["move_bucket"])) + 1 if columns["move_bucket"].size else 0):
            raise LayoutValueError("the plan file is damaged: its num_buckets does not match its moves")
        return plan

    def to_json(self, moves: bool = True) -> dict[str, Any]:
        """A JSON-ready description: the header, statistics and (optionally) every move."""
        out = self._header()
        out["fingerprint"] = self.fingerprint
        out["stats"] = self.stats.to_json()
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
                for m in self.moves()
            ]
        return out


def _layout_digest(layout: Layout) -> str:
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


def _check_pair(source: Layout, destination: Layout, storages: bool = True) -> None:
    """Both layouts must place the same logical tensors, and (with ``storages``) a rank in
    both meshes must not give one storage name two different meanings."""
    src_names, dst_names = list(source.tensors), list(destination.tensors)
    if source.tensors is destination.tensors:
        pass  # layouts of one program share its tensors
    elif set(src_names) == set(dst_names):
        pass  # the same tensors declared in another order: plan_layouts reorders
    elif src_names != dst_names:
        missing = [n for n in src_names if n not in destination.tensors][:3]
        extra = [n for n in dst_names if n not in source.tensors][:3]
        raise LayoutValueError(
            f"layouts '{source.name}' and '{destination.name}' place different logical tensors"
            + (f"; only in '{source.name}': {', '.join(missing)}" if missing else "")
            + (f"; only in '{destination.name}': {', '.join(extra)}" if extra else ""),
            destination.span,
        )
    for name in src_names if source.tensors is not destination.tensors else ():
        a, b = source.tensors[name], destination.tensors[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise LayoutValueError(
                f"tensor '{name}' is {list(a.shape)} {a.dtype} in layout '{source.name}' but "
                f"{list(b.shape)} {b.dtype} in layout '{destination.name}'",
                destination.span,
            )
    shared = sorted(set(source.mesh.ranks) & set(destination.mesh.ranks)) if storages else []
    if not shared:
        return
    src_storages = {s.name: s for s in source.resolved.storages}
    for storage in destination.resolved.storages:
        other = src_storages.get(storage.name)
        if other is None or other.parts == storage.parts:
            continue
        for rank in shared:
            a = source.storage_shape(storage.name, rank)
            b = destination.storage_shape(storage.name, rank)
            if a is not None and b is not None and (a != b or other.parts != storage.parts):
                raise LayoutValueError(
                    f"rank {rank} is in both meshes and holds conflicting storages named '{storage.name}': "
                    f"in '{source.name}' {list(a)} of {', '.join(other.parts)}, in '{destination.name}' "
                    f"{list(b)} of {', '.join(storage.parts)}",
                    storage.span or destination.span,
                    "give one of them another name with a storage statement",
                )


def plan_layouts(
    source: Layout,
    destination: Layout,
    *,
    name: str | None = None,
    domain_size: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    policies: Sequence[str] | str = "reshard",
) -> Plan:
    """Compile the plan from ``source`` to ``destination`` (layouts of the same tensors).

    ``policies`` is one policy for every tensor or one per tensor (``reshard`` moves only
    the exact overlap; ``broadcast`` gathers the whole tensor on one source rank and sends it
    to every destination rank that holds any of it). ``bucket_bytes`` bounds the staging
    memory of one rank in one bucket; larger regions are cut into slabs.
    """
    _check_pair(source, destination)
    if list(source.tensors) != list(destination.tensors):
        # The core numbers tensors in declaration order: give the destination the source's.
        ordered = {name: destination.tensors[name] for name in source.tensors}
        destination = Layout(
            destination.name, destination.mesh, ordered, destination.rules, destination.storages, destination.span
        )
    names = source.resolved.names
    per_tensor = (policies,) * len(names) if isinstance(policies, str) else tuple(policies)
    if len(per_tensor) != len(names) or any(p not in POLICIES for p in per_tensor):
        raise LayoutValueError(f"policies must be one of {POLICIES} per tensor")
    if bucket_bytes < 1:
        raise LayoutValueError(f"the bucket budget must be at least 1 byte, not {bucket_bytes}")
    if domain_size < 1:
        raise LayoutValueError(f"the domain size must be at least 1, not {domain_size}")
    try:
        arrays = _core.build_plan(
            source.core,
            destination.core,
            [POLICIES.index(p) for p in per_tensor],
            domain_size,
            bucket_bytes,
        )
    except LayoutError as err:
        raise LayoutValueError(_name_tensor(err.message, names), destination.span) from None
    return Plan(
        source,
        destination,
        name or f"{source.name}->{destination.name}",
        per_tensor,
        domain_size,
        bucket_bytes,
        arrays,
    )


def _in_order(layout: Layout, names: Sequence[str]) -> Layout:
    """``layout`` with its tensors in the order of ``names`` (the core numbers tensors by
    declaration order, so every layout of one plan must declare them alike)."""
    if list(layout.tensors) == list(names):
        return layout
    ordered = {name: layout.tensors[name] for name in names}
    return Layout(layout.name, layout.mesh, ordered, layout.rules, layout.storages, layout.span)


def plan_recovery(
    sources: Sequence[Layout],
    destination: Layout,
    lost: Iterable[int],
    *,
    name: str | None = None,
    domain_size: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Plan:
    """Compile a recovery plan: ``destination`` from the surviving ranks of ``sources``.

    Each region of the destination is read from the first layout of ``sources`` that holds
    it on a rank not in ``lost`` (e.g. the inference replicas that survived, then the
    training side), within it as :func:`plan_layouts` would (local copy, then the same
    domain, then the least loaded rank over the network, once per domain). Every tensor
    moves by exact overlap. Source storages are passed apart from destination storages, so
    a rank may hold storages of the same name in a source and in the destination.

    Raises :class:`LayoutValueError` when a lost rank is in ``destination``, and
    :class:`~layoutlang.loss.DataLossError` (a :class:`~layoutlang.errors.LayoutError`) when a
    region has no surviving copy in any source: its message lists every lost tensor and box.

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh infer [dp = 2, tp = 2]
    ... mesh regrown_mesh [dp = 2, tp = 2] on ranks [0, 1, 4, 3]
    ... tensor "w" [8, 4] fp32
    ... layout serve on infer { "w": tp = shard(0) }
    ... layout regrown on regrown_mesh { "w": tp = shard(0) }
    ... ''')
    >>> plan = plan_recovery([p.layouts["serve"]], p.layouts["regrown"], lost={2})
    >>> sorted((m.src, m.dst, m.kind) for m in plan.moves())
    [(0, 0, 'local'), (0, 4, 'network'), (1, 1, 'local'), (3, 3, 'local')]
    """
    sources = list(sources)
    if not sources:
        raise LayoutValueError("a recovery plan needs at least one source layout")
    lost_ranks = sorted({int(r) for r in lost})
    for source in sources:
        _check_pair(source, destination, storages=False)
    in_destination = sorted(set(lost_ranks) & set(destination.mesh.ranks))
    if in_destination:
        raise LayoutValueError(
            f"lost rank{'s' if len(in_destination) > 1 else ''} {', '.join(map(str, in_destination))} "
            f"still belong{'s' if len(in_destination) == 1 else ''} to the destination layout '{destination.name}'",
            destination.span,
            "remesh the destination first (elastic.remesh)",
        )
    check_recoverable(sources, lost_ranks)  # never silent loss: names every lost box
    if bucket_bytes < 1:
        raise LayoutValueError(f"the bucket budget must be at least 1 byte, not {bucket_bytes}")
    if domain_size < 1:
        raise LayoutValueError(f"the domain size must be at least 1, not {domain_size}")
    names = list(sources[0].tensors)
    sources = [_in_order(layout, names) for layout in sources]
    destination = _in_order(destination, names)
    try:
        arrays = _core.build_recovery_plan(
            [layout.core for layout in sources], lost_ranks, destination.core, domain_size, bucket_bytes
        )
    except LayoutError as err:
        raise LayoutValueError(_name_tensor(err.message, sources[0].resolved.names), destination.span) from None
    return Plan(
        sources[0],
        destination,
        name or f"recover {destination.name} from {', '.join(layout.name for layout in sources)}",
        ("reshard",) * len(names),
        domain_size,
        bucket_bytes,
        arrays,
        sources=sources,
        lost=lost_ranks,
    )


def _name_tensor(message: str, names: list[str]) -> str:
    """The core names tensors by index; users know them by name."""
    prefix = "tensor "
    if message.startswith(prefix):
        index, _, rest = message[len(prefix) :].partition(":")
        if index.strip().isdigit() and int(index) < len(names):
            return f"tensor '{names[int(index)]}':{rest}"
    return message


def compile_plan(
    program: Program,
    reshard: str | Reshard | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    policy: str | None = None,
) -> Plan:
    """Compile the plan of a ``reshard`` statement (the only one when ``reshard`` is None).

    Each tensor takes its policy from the statement (``broadcast`` rules); ``policy``
    overrides them all, e.g. ``policy="broadcast"`` for the gather-and-broadcast baseline.
    """
    statement = reshard if isinstance(reshard, Reshard) else program.reshard(reshard)
    source = program.layout(statement.source)
    destination = program.layout(statement.destination)
    if policy is not None:
        if policy not in POLICIES:
            raise LayoutValueError(f"unknown policy '{policy}' (one of: {', '.join(POLICIES)})")
        policies: Sequence[str] | str = policy
    else:
        policies = [statement.policy_for(name) for name in source.resolved.names]
    try:
        return plan_layouts(
            source,
            destination,
            name=statement.name,
            domain_size=program.topology.domain_size,
            bucket_bytes=bucket_bytes,
            policies=policies,
        )
    except LayoutError as err:
        raise err.with_span(statement.span)
