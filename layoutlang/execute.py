"""Running plans: the executor, its transports, and the Resharder an RL framework calls.

The executor only reads a :class:`~layoutlang.plan.Plan`. On each rank it turns the plan
into a *schedule*: for every bucket and stage, the local copies, and for every peer one
message to send and one to receive, each the concatenation of the regions exchanged with
that peer (16-byte aligned). Running a step packs the messages into staging buffers, posts
all receives and sends at once, performs the local copies while they fly, waits, and
unpacks into the destination storages (casting on arrival when a destination storage has
another dtype). The next step's messages are packed while the current ones are in flight
when they read only source storages, so buckets are pipelined; relays (stage 1) run after
the network stage that feeds them.

Transports only move buffers: :class:`TorchTransport` uses torch.distributed point-to-point
operations (``batch_isend_irecv``; gloo on CPU, NCCL on GPU). Before the first byte moves,
every rank of the plan sends its plan fingerprint to the lowest rank, which answers with a
verdict: a mismatch (different programs, versions or options on different ranks) stops every
rank with an error naming the ranks that differ, and nothing is transferred.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from .dtypes import DTYPES
from .errors import LayoutError
from .model import Program
from .plan import DEFAULT_BUCKET_BYTES, KINDS, SPACES, Plan, compile_plan

__all__ = [
    "ExecutionError",
    "AgreementError",
    "Transport",
    "TorchTransport",
    "Executor",
    "RunReport",
    "Resharder",
    "torch_dtype",
]

log = logging.getLogger(__name__)

_AGREEMENT_TAG = 2**31 - 1  # message tags of steps stay below it
_ALIGN = 16  # bytes: every region starts aligned in a message, so typed views are legal
_SOURCE, _DESTINATION, _SCRATCH = (SPACES.index(s) for s in ("source", "destination", "scratch"))


class ExecutionError(LayoutError):
    """Running a plan failed: bad storages, a peer that died or hung, a transport error."""

    kind = "execution"


class AgreementError(ExecutionError):
    """Ranks compiled different plans (or some could not compile one); nothing was moved."""

    kind = "agreement"


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a short dtype name (``bf16`` -> ``torch.bfloat16``)."""
    return getattr(torch, DTYPES[dtype][1])


# --------------------------------------------------------------------- transports


class Pending(Protocol):
    def wait(self, timeout: float) -> None: ...


class Transport(Protocol):
    """Moves buffers between program ranks; knows nothing about plans or layouts."""

    rank: int

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int) -> Pending:
        """Post every receive and send at once; the returned handle's ``wait`` completes them."""
        ...


class _TorchPending:
    def __init__(self, rank: int, works: list, labels: list[str]):
        self.rank, self.works, self.labels = rank, works, labels

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for work, label in zip(self.works, self.labels):
            remaining = max(0.001, deadline - time.monotonic())
            try:
                completed = work.wait(timedelta(seconds=remaining))
            except RuntimeError as err:
                raise ExecutionError(
                    f"rank {self.rank}: {label} failed or did not complete within {timeout:g} s "
                    f"(the peer may have died or hung): {str(err).splitlines()[0]}"
                ) from None
            if completed is False:
                raise ExecutionError(f"rank {self.rank}: {label} did not complete within {timeout:g} s")


class TorchTransport:
    """Point-to-point over torch.distributed (gloo on CPU, NCCL on GPU).

    ``rank_map`` maps program ranks to ranks of ``group`` (default: the same numbers), so a
    program whose ranks are sparse can run on a compact process group.
    """

    def __init__(
        self, rank: int, rank_map: Mapping[int, int] | None = None, group: Any = None, device: Any = None
    ):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ExecutionError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self.rank = rank
        self.group = group
        self._map = dict(rank_map) if rank_map is not None else None
        if device is None:  # NCCL moves only GPU memory: small control messages go there too
            backend = dist.get_backend(group)
            device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(backend) else torch.device("cpu")
        self.device = torch.device(device)

    def _peer(self, rank: int) -> int:
        return self._map[rank] if self._map is not None else rank

    def exchange(self, sends, recvs, tag):
        dist = self._dist
        ops, labels = [], []
        for peer, buf in recvs:
            ops.append(dist.P2POp(dist.irecv, buf, self._peer(peer), self.group, tag))
            labels.append(f"receiving {buf.numel()} bytes from rank {peer}")
        for peer, buf in sends:
            ops.append(dist.P2POp(dist.isend, buf, self._peer(peer), self.group, tag))
            labels.append(f"sending {buf.numel()} bytes to rank {peer}")
        works = dist.batch_isend_irecv(ops) if ops else []
        return _TorchPending(self.rank, list(works), labels)


# ----------------------------------------------------------------------- schedule


@attrs.frozen
class _Piece:
    """One region in one of this rank's spaces."""

    space: int
    storage: str
    index: tuple[slice, ...]
    tensor: int
    dtype: torch.dtype  # the logical dtype: what travels on the wire
    numel: int
    source: int = 0  # which source layout, for pieces of the source space

    @property
    def key(self) -> tuple[int, int]:
        return (self.space, self.source)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@attrs.define
class _Message:
    peer: int
    pieces: list[_Piece] = attrs.field(factory=list)
    offsets: list[int] = attrs.field(factory=list)
    nbytes: int = 0

    def add(self, piece: _Piece) -> None:
        self.pieces.append(piece)
        self.offsets.append(self.nbytes)
        self.nbytes += -(-piece.nbytes // _ALIGN) * _ALIGN


@attrs.define
class _Step:
    bucket: int
    stage: int
    copies: list[tuple[_Piece, _Piece]] = attrs.field(factory=list)
    sends: dict[int, _Message] = attrs.field(factory=dict)
    recvs: dict[int, _Message] = attrs.field(factory=dict)

    def pieces(self) -> Iterable[_Piece]:
        """Every piece this step reads or writes."""
        for pair in self.copies:
            yield from pair
        for message in list(self.sends.values()) + list(self.recvs.values()):
            yield from message.pieces

    @property
    def sends_read_only_sources(self) -> bool:
        return all(p.space == _SOURCE for m in self.sends.values() for p in m.pieces)


@attrs.frozen
class RunReport:
    """What one rank did in one run: bytes by kind, messages, time, peak staging memory."""

    rank: int
    seconds: float
    sent: dict[str, int]
    received: dict[str, int]
    messages_sent: int
    steps: int
    peak_staging_bytes: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _schedule(plan: Plan, rank: int) -> list[_Step]:
    """The steps this rank takes, in plan order (the same order on every rank)."""
    a = plan.arrays
    names = plan.tensors
    dtypes = [torch_dtype(plan.source.tensors[n].dtype) for n in names]
    steps: dict[tuple[int, int], _Step] = {}
    src_cols = np.asarray(a.move_src)
    dst_cols = np.asarray(a.move_dst)
    for i in plan.moves_of_rank(rank):
        i = int(i)
        move = plan.move(i)
        key = (move.bucket, move.stage)
        step = steps.get(key)
        if step is None:
            step = steps[key] = _Step(move.bucket, move.stage)
        read, write = plan.place(move)
        tensor = plan.source.resolved.index[move.tensor]
        numel = int(np.prod(move.sizes)) if move.sizes else 1

        def piece(space: str, place) -> _Piece:
            storage, offsets = place
            index = tuple(slice(o, o + s) for o, s in zip(offsets, move.sizes))
            source = move.source if space == "source" else 0
            return _Piece(SPACES.index(space), storage, index, tensor, dtypes[tensor], numel, source)

        src, dst = int(src_cols[i]), int(dst_cols[i])
        if src == dst:
            step.copies.append((piece(move.src_space, read), piece(move.dst_space, write)))
        elif src == rank:
            step.sends.setdefault(dst, _Message(dst)).add(piece(move.src_space, read))
        else:
            step.recvs.setdefault(src, _Message(src)).add(piece(move.dst_space, write))
    return [steps[k] for k in sorted(steps)]


# ----------------------------------------------------------------------- executor


class Executor:
    """Runs one plan on one rank over a transport. Build once, run every step."""

    def __init__(self, plan: Plan, rank: int, transport: Transport, *, timeout: float = 300.0):
        in_meshes = any(rank in layout.mesh for layout in (*plan.sources, plan.destination))
        if not in_meshes or rank in plan.lost:
            raise ExecutionError(
                f"rank {rank} belongs to no mesh of plan '{plan.name}' (source ranks "
                f"{_ranges(plan.source.mesh.ranks)}, destination ranks {_ranges(plan.destination.mesh.ranks)})"
                if not in_meshes
                else f"rank {rank} is lost in recovery plan '{plan.name}'; it takes no part"
            )
        self.plan = plan
        self.rank = rank
        # A recovery plan's lost ranks hold source storages nobody reads: they are not asked.
        ranks = set(plan.destination.mesh.ranks).union(*(layout.mesh.ranks for layout in plan.sources))
        self.participants = sorted(ranks - plan.lost)
        self.transport = transport
        self.timeout = timeout
        self.steps = _schedule(plan, rank)
        self._shapes = [plan.source.tensors[n].shape for n in plan.tensors]
        # Scratch buffers (whole tensors) are freed after their last use.
        self._scratch_last_use = self._last_use(_SCRATCH)
        self.sources_storages = [
            layout.storages_on(rank) if rank in layout.mesh else {} for layout in plan.sources
        ]  # per source layout (one, unless this is a recovery plan)
        self.source_storages = self.sources_storages[0]
        # A recovery plan's fallback sources are asked only for the storages it reads here.
        read = {(p.source, p.storage) for step in self.steps for p in step.pieces() if p.space == _SOURCE}
        for k in range(1, len(plan.sources)):
            self.sources_storages[k] = {n: s for n, s in self.sources_storages[k].items() if (k, n) in read}
        self._sources_read = {k for k, _ in read}
        self.destination_storages = plan.destination.storages_on(rank) if rank in plan.destination.mesh else {}
        # A destination storage is complete after its last write and its last read (a relay).
        self._complete_after = self._last_use(_DESTINATION, self.destination_storages)

    def _last_use(self, space: int, names: Iterable[str] = ()) -> dict[int, list[str]]:
        """Step index -> storages of ``space`` that no later step touches (``names`` start
        at -1: storages no step touches are done before the first)."""
        last = {name: -1 for name in names}
        for n, step in enumerate(self.steps):
            for p in step.pieces():
                if p.space == space:
                    last[p.storage] = n
        out: dict[int, list[str]] = defaultdict(list)
        for name, n in last.items():
            out[n].append(name)
        return out

    # -- checks
    def reads_source(self, index: int) -> bool:
        """Whether this rank reads anything from source layout ``index`` of the plan."""
        return index in self._sources_read

    def _per_source(self, sources: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]) -> list:
        """One mapping of storages per source layout of the plan."""
        if isinstance(sources, Mapping):
            if len(self.plan.sources) > 1:
                raise ExecutionError(
                    f"rank {self.rank}: plan '{self.plan.name}' reads from {len(self.plan.sources)} source layouts "
                    f"({', '.join(repr(l.name) for l in self.plan.sources)}): pass one mapping of storages per "
                    "source layout, in that order"
                )
            return [sources]
        per = list(sources)
        if len(per) != len(self.plan.sources):
            raise ExecutionError(
                f"rank {self.rank}: {len(per)} mappings of source storages given for the "
                f"{len(self.plan.sources)} source layouts of plan '{self.plan.name}'"
            )
        return per

    def _check(self, sources: Sequence[Mapping[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor], cast: bool) -> None:
        plan, rank = self.plan, self.rank
        sides = [("source", wanted, given, layout) for wanted, given, layout in zip(self.sources_storages, sources, plan.sources)]
        sides.append(("destination", self.destination_storages, destinations, plan.destination))
        for side, wanted, given, layout in sides:
            for name, shape in wanted.items():
                if name not in given:
                    raise ExecutionError(
                        f"rank {rank}: the {side} storage '{name}' (layout '{layout.name}', shape {list(shape)}) is missing"
                    )
                tensor = given[name]
                if tuple(tensor.shape) != tuple(shape):
                    raise ExecutionError(
                        f"rank {rank}: the {side} storage '{name}' has shape {list(tensor.shape)}, "
                        f"layout '{layout.name}' needs {list(shape)}"
                    )
                logical = torch_dtype(layout.tensors[layout.storage(name, rank).parts[0]].dtype)
                if tensor.dtype != logical and not (side == "destination" and cast):
                    raise ExecutionError(
                        f"rank {rank}: the {side} storage '{name}' is {tensor.dtype}, layout '{layout.name}' "
                        f"holds {logical}" + (" (pass cast=True to convert on arrival)" if side == "destination" else "")
                    )
                if side == "destination" and not tensor.is_contiguous():
                    raise ExecutionError(f"rank {rank}: the destination storage '{name}' is not contiguous")

    # -- running
    def run(
        self,
        sources: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        *,
        cast: bool = False,
        on_complete: Callable[[str, torch.Tensor], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        not_ready: str | None = None,
    ) -> RunReport:
        """Move every byte this rank sends or receives; destinations are written in place.

        All ranks first check their storages and agree that every rank is ready, so a bad
        storage on one rank stops every rank before any byte moves. A recovery plan takes
        one mapping of source storages per source layout (``plan.sources``, in order).
        """
        problem = not_ready
        per_source: list[Mapping[str, torch.Tensor]] = []
        try:
            per_source = self._per_source(sources)
        except ExecutionError as err:
            problem = problem or err.message
        if problem is None:
            try:
                self._check(per_source, destinations, cast)
            except ExecutionError as err:
                problem = err.message
        agree(self.transport, self.rank, self.participants, self.plan.fingerprint, problem, self.timeout,
              failure="is not ready")
        device = _device_of([t for given in per_source for t in given.values()] + list(destinations.values()))
        spaces = {(_SOURCE, k): given for k, given in enumerate(per_source)}
        spaces[(_DESTINATION, 0)] = destinations
        spaces[(_SCRATCH, 0)] = {}
        # A destination storage is complete after the step of its last write, and free for the
        # engine after the step of its last read (a relay forwarding from it) too.
        def announce(step: int) -> None:
            if on_complete is not None:
                for name in self._complete_after.get(step, ()):
                    on_complete(name, destinations[name])

        announce(-1)

        sent = dict.fromkeys(KINDS, 0)
        received = dict.fromkeys(KINDS, 0)
        messages = 0
        live = peak = 0
        start = time.perf_counter()
        packed_next: dict[int, torch.Tensor] | None = None
        for n, step in enumerate(self.steps):
            sends = packed_next if packed_next is not None else self._pack(step, spaces, device)
            recvs = {peer: torch.empty(m.nbytes, dtype=torch.uint8, device=device) for peer, m in step.recvs.items()}
            live = sum(b.numel() for b in sends.values()) + sum(b.numel() for b in recvs.values())
            pending = self.transport.exchange(
                [(peer, buf) for peer, buf in sends.items()],
                [(peer, buf) for peer, buf in recvs.items()],
                tag=(step.bucket * 4 + step.stage) % _AGREEMENT_TAG,  # the same on both ends
            )
            for read, write in step.copies:
                target, value = self._target(spaces, write, device)[write.index], _view(spaces, read)
                if not _same_memory(target, value):  # a storage that is its own source stays put
                    target.copy_(value)
                sent["local"] += read.nbytes
                received["local"] += read.nbytes
            # Pipelining: pack the next step while this one is in flight, when it does not
            # read what this step is about to receive.
            packed_next = None
            if n + 1 < len(self.steps) and self.steps[n + 1].sends_read_only_sources:
                packed_next = self._pack(self.steps[n + 1], spaces, device)
                live += sum(b.numel() for b in packed_next.values())
            peak = max(peak, live)
            pending.wait(self.timeout)
            for peer, message in step.recvs.items():
                buf = recvs[peer]
                for piece, offset in zip(message.pieces, message.offsets):
                    staged = buf[offset : offset + piece.nbytes].view(piece.dtype).view(_sizes(piece))
                    self._target(spaces, piece, device)[piece.index].copy_(staged)
                    received[self._kind(peer)] += piece.nbytes
            for peer, message in step.sends.items():
                sent[self._kind(peer)] += sum(p.nbytes for p in message.pieces)
            messages += len(step.sends)
            for name in self._scratch_last_use.get(n, ()):
                spaces[(_SCRATCH, 0)].pop(name, None)
            announce(n)
            if progress is not None:
                progress(n + 1, len(self.steps))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return RunReport(self.rank, time.perf_counter() - start, sent, received, messages, len(self.steps), peak)

    def _target(self, spaces, piece: _Piece, device) -> torch.Tensor:
        """The tensor a piece is written into; scratch buffers (whole tensors) appear on first use."""
        space = spaces[piece.key]
        if piece.space == _SCRATCH and piece.storage not in space:
            space[piece.storage] = torch.empty(self._shapes[piece.tensor], dtype=piece.dtype, device=device)
        return space[piece.storage]

    def _kind(self, peer: int) -> str:
        same = self.plan.domain_size and peer // self.plan.domain_size == self.rank // self.plan.domain_size
        return "domain" if same else "network"

    def _pack(self, step: _Step, spaces, device) -> dict[int, torch.Tensor]:
        out = {}
        for peer, message in step.sends.items():
            buf = torch.empty(message.nbytes, dtype=torch.uint8, device=device)
            for piece, offset in zip(message.pieces, message.offsets):
                buf[offset : offset + piece.nbytes].view(piece.dtype).view(_sizes(piece)).copy_(_view(spaces, piece))
            out[peer] = buf
        return out


def _sizes(piece: _Piece) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in piece.index)


def _view(spaces, piece: _Piece) -> torch.Tensor:
    return spaces[piece.key][piece.storage][piece.index]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ExecutionError(f"storages live on several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2]`` -> ``0..2``; ``[3]`` -> ``3``; otherwise a list."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}..{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _ranks_phrase(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_ranges(ranks)}"


# ---------------------------------------------------------------------- agreement

_AGREE_BYTES = 288  # status, digest, message
_VERDICT_BYTES = 1024


def _encode(status: bytes, digest: bytes, message: str, size: int) -> torch.Tensor:
    text = message.encode("utf-8")[: size - 40]
    payload = status[:2].ljust(2, b" ") + digest[:32].ljust(32, b"\0") + len(text).to_bytes(2, "little") + text
    return torch.frombuffer(bytearray(payload.ljust(size, b"\0")), dtype=torch.uint8)


def _decode(buf: torch.Tensor) -> tuple[bytes, bytes, str]:
    raw = bytes(buf.cpu().numpy().tobytes())
    length = int.from_bytes(raw[34:36], "little")
    return raw[:2], raw[2:34], raw[36 : 36 + length].decode("utf-8", errors="replace")


def agree(
    transport: Transport,
    rank: int,
    participants: Sequence[int],
    fingerprint: str | None,
    error: str | None,
    timeout: float,
    failure: str = "could not compile the plan",
) -> None:
    """Every participant learns whether all compiled the same plan; raises AgreementError if not.

    Each rank sends (status, plan fingerprint, error message) to the lowest participant, which
    compares them and sends every rank the same verdict. Nothing else moves before it.
    """
    leader = min(participants)
    device = getattr(transport, "device", torch.device("cpu"))
    digest = bytes.fromhex(fingerprint) if fingerprint else b""
    mine = _encode(b"ER" if error else b"OK", digest, error or "", _AGREE_BYTES).to(device)
    if rank != leader:
        verdict = torch.empty(_VERDICT_BYTES, dtype=torch.uint8, device=device)
        transport.exchange([(leader, mine)], [(leader, verdict)], tag=_AGREEMENT_TAG).wait(timeout)
        status, _, message = _decode(verdict)
        if status != b"OK":
            raise AgreementError(message)
        return
    others = [r for r in participants if r != rank]
    inboxes = {r: torch.empty(_AGREE_BYTES, dtype=torch.uint8, device=device) for r in others}
    transport.exchange([], list(inboxes.items()), tag=_AGREEMENT_TAG).wait(timeout)
    seen: dict[tuple[bytes, bytes], list[int]] = defaultdict(list)
    errors: dict[int, str] = {}
    seen[(mine[:2].cpu().numpy().tobytes(), digest)].append(rank)
    if error:
        errors[rank] = error
    for r, buf in inboxes.items():
        status, fp, message = _decode(buf)
        seen[(status, fp)].append(r)
        if status != b"OK":
            errors[r] = message
    if errors:
        first = min(errors)
        text = f"rank {first} {failure}: {errors[first]}"
        if len(errors) > 1:
            text += f" ({_ranks_phrase(sorted(errors))} failed); nothing was moved"
        else:
            text += "; nothing was moved"
    elif len(seen) > 1:
        groups = sorted(seen.values(), key=lambda g: (-len(g), g))
        described = "; ".join(
            f"{_ranks_phrase(sorted(g))} compiled plan {fp.hex()[:12]}"
            for (_, fp), g in sorted(seen.items(), key=lambda kv: min(kv[1]))
        )
        differing = sorted(r for g in groups[1:] for r in g)
        text = (
            f"{_ranks_phrase(differing)} compiled a different plan from the others ({described}): "
            "different programs, versions or options on different ranks; nothing was moved"
        )
    else:
        text = ""
    verdict = _encode(b"ER" if text else b"OK", b"", text, _VERDICT_BYTES).to(device)
    transport.exchange([(r, verdict) for r in others], [], tag=_AGREEMENT_TAG).wait(timeout)
    if text:
        raise AgreementError(text)


# ---------------------------------------------------------------------- resharder


class Resharder:
    """Reshards one program's weights at every refit: build once, call :meth:`run` each step.

    >>> resharder = Resharder(program, reshard="refit")           # on every rank  # doctest: +SKIP
    >>> resharder.run(sources={"w": my_shard}, destinations={"w": engine_param})  # doctest: +SKIP

    ``sources`` and ``destinations`` map storage names to this rank's tensors (the shapes
    ``layout.storages_on(rank)`` gives). Destinations are written in place; without them,
    :meth:`run` allocates and returns them. Every rank of both meshes must build the
    Resharder with the same program and options: their plans' fingerprints are compared
    before any byte moves.

    ``memory_budget`` bounds this rank's staging memory: plans are cut into buckets of half
    of it, since the executor keeps at most two buckets' messages in flight.
    """

    def __init__(
        self,
        program: Program | str,
        reshard: str | None = None,
        *,
        rank: int | None = None,
        rank_map: Mapping[int, int] | None = None,
        group: Any = None,
        transport: Transport | None = None,
        memory_budget: int = 2 * DEFAULT_BUCKET_BYTES,
        policy: str | None = None,
        timeout: float = 300.0,
    ):
        from .elaborate import load

        if rank is None:
            import torch.distributed as dist

            process_rank = dist.get_rank()
            inverse = {v: k for k, v in (rank_map or {}).items()}
            rank = inverse.get(process_rank, process_rank)
        self.rank = rank
        self.timeout = timeout
        error = None
        plan = None
        try:
            if not isinstance(program, Program):
                program = load(program)
            plan = compile_plan(program, reshard, bucket_bytes=max(1, memory_budget // 2), policy=policy)
        except LayoutError as err:
            # Still take part in the agreement, so every rank learns why instead of waiting.
            error = str(err)
        self.program = program if isinstance(program, Program) else None
        if plan is not None:
            participants = sorted(set(plan.source.mesh.ranks) | set(plan.destination.mesh.ranks))
        else:
            participants = _participants_of(self.program, reshard, rank_map, group)
        if rank not in participants:
            raise ExecutionError(
                f"rank {rank} belongs to no mesh of the reshard (its ranks: {_ranges(participants)})"
            )
        if rank_map is not None and not set(participants) <= set(rank_map):
            missing = sorted(set(participants) - set(rank_map))
            raise ExecutionError(
                f"{_ranks_phrase(missing)} of the reshard {'has' if len(missing) == 1 else 'have'} "
                "no process in this job (rank_map)"
            )
        self.transport = transport if transport is not None else TorchTransport(rank, rank_map, group)
        agree(self.transport, rank, participants, plan.fingerprint if plan else None, error, timeout)
        self.plan = plan
        self.executor = Executor(plan, rank, self.transport, timeout=timeout)
        self.last_report: RunReport | None = None

    @property
    def source_storages(self) -> dict[str, tuple[int, ...]]:
        """Storage name -> local shape of the sources this rank must provide."""
        return dict(self.executor.source_storages)

    @property
    def destination_storages(self) -> dict[str, tuple[int, ...]]:
        """Storage name -> local shape of the destinations this rank receives."""
        return dict(self.executor.destination_storages)

    def allocate(self, side: str = "destination", *, dtype: torch.dtype | None = None, device: Any = "cpu") -> dict[str, torch.Tensor]:
        """Zero-filled storages for ``side`` ("source" or "destination"), in the logical dtype
        unless ``dtype`` is given."""
        layout = self.plan.source if side == "source" else self.plan.destination
        shapes = self.source_storages if side == "source" else self.destination_storages
        out = {}
        for name, shape in shapes.items():
            logical = torch_dtype(layout.tensors[layout.storage(name, self.rank).parts[0]].dtype)
            out[name] = torch.zeros(shape, dtype=dtype or logical, device=device)
        return out

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        destinations: Mapping[str, torch.Tensor] | None = None,
        *,
        cast: bool = False,
        on_complete: Callable[[str, torch.Tensor], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
        not_ready: str | None = None,
    ) -> dict[str, torch.Tensor]:
        """Move this rank's part of the plan; returns the destination storages.

        ``on_complete(name, tensor)`` is called for each destination storage as soon as all its
        bytes have arrived; ``cast=True`` accepts destinations in another dtype (converted on
        arrival, e.g. fp32 master weights into bf16 inference weights). ``not_ready`` reports a
        problem this rank found before running (e.g. reading its weights): every rank stops
        with it and nothing moves.
        """
        if destinations is None:
            device = _device_of(list(sources.values())) if sources else torch.device("cpu")
            destinations = self.allocate("destination", device=device)
        self.last_report = self.executor.run(
            sources, destinations, cast=cast, on_complete=on_complete, progress=progress, not_ready=not_ready
        )
        return dict(destinations)


def _participants_of(program: Program | None, reshard: str | None, rank_map, group) -> list[int]:
    """The ranks that take part when this rank could not compile the plan itself."""
    if rank_map:
        return sorted(rank_map)
    try:
        statement = program.reshard(reshard)
        ranks = set(program.layout(statement.source).mesh.ranks) | set(program.layout(statement.destination).mesh.ranks)
        return sorted(ranks)
    except (AttributeError, LayoutError):
        import torch.distributed as dist

        return list(range(dist.get_world_size(group)))
