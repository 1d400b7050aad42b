"""The executor: runs one plan on one rank over a transport."""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import itertools
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

from .._text import rank_ranges
from ..errors import ExecutionError, LayoutValueError, closest_name
from ..io.quantize import quantize_into
from ..io.torch_dtypes import torch_dtype
from ..model import Layout
from ..plan import KINDS, Plan
from ..plan.quantized import broadcast_into_quantized
from ..transport import Pending, Transport
from ..transport.base import Buffers
from .agreement import AGREEMENT_TAG, agree
from .delta import DeltaOptions, DeltaRefits, DeltaReport, delta_options
from .schedule import (
    _ASSEMBLY,
    _DESTINATION,
    _SCRATCH,
    _SOURCE,
    Assembly,
    Message,
    Piece,
    Step,
    part_bytes,
    quantized_spans,
    schedule,
)
from .wire_encoding import MIN_DELTA_BYTES

#: intra-op threads of the executor's copies on the CPU (packing staged sends, unpacking
#: receives): ``LAYOUTLANG_COPY_THREADS``, else 1
COPY_THREADS = int(os.environ.get("LAYOUTLANG_COPY_THREADS", "1"))


@contextlib.contextmanager
def copy_threads(device: torch.device) -> Iterator[None]:
    """Run a CPU run's copies on :data:`COPY_THREADS` intra-op threads (this thread's
    setting, restored after). A staging copy is memory-bound and short; a team of OpenMP
    threads for each one waits at its barrier for the slowest, and where a refit's processes
    share the cores (trainer ranks and engine workers on one host, or a busy host) that
    thread is often not scheduled: measured on 2 shared cores, 16 strided copies of 67 MB
    took 70 ms on 2 threads and 12 ms on 1 (benchmarks/bench_vllm_refit.py: the trainer's
    pack of 27 MB fell from 134 ms)."""
    if device.type != "cpu" or COPY_THREADS <= 0 or torch.get_num_threads() == COPY_THREADS:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(COPY_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


#: called with a destination storage's name and tensor once all its bytes have arrived
OnComplete = Callable[[str, torch.Tensor], None]


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
    #: a delta run's encodings and wire bytes (None: a dense run)
    delta: DeltaReport | None = None
    #: of ``received``, the bytes that arrived straight in their storage (a region that is one
    #: run of it, or a large quantized region's values there): no staging copy on this rank
    received_in_place: int = 0

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        if self.delta is None:
            del out["delta"]
        return out


# ----------------------------------------------------------------------- executor


class Executor:
    """Runs one plan on one rank over a transport. Build once, run every step."""

    def __init__(self, plan: Plan, rank: int, transport: Transport, *, timeout: float = 300.0):
        in_meshes = any(rank in layout.mesh for layout in (*plan.sources, plan.destination))
        if not in_meshes or rank in plan.lost:
            raise ExecutionError(
                f"rank {rank} belongs to no mesh of plan '{plan.name}' (source ranks "
                f"{rank_ranges(plan.source.mesh.ranks)}, destination ranks {rank_ranges(plan.destination.mesh.ranks)})"
                if not in_meshes
                else f"rank {rank} is lost in recovery plan '{plan.name}'; it takes no part",
                rank=rank,
            )
        if plan.rank is not None and plan.rank != rank:
            raise ExecutionError(
                f"rank {rank} was given the per-rank plan of rank {plan.rank} ('{plan.name}'): "
                "each rank runs its own part",
                rank=rank,
            )
        broadcast = broadcast_into_quantized(plan.destination, plan.tensors, plan.policies) if (
            plan.quantization is not None
        ) else None
        if broadcast is not None:  # before any byte moves: the whole-tensor baseline plans only
            raise LayoutValueError(
                f"tensor '{broadcast}' is stored quantized in '{plan.destination.name}' and plan '{plan.name}' "
                "moves it by the broadcast policy, which gathers and broadcasts bf16: quantized tensors are "
                "refit by the reshard policy",
                tensor=broadcast,
                rank=rank,
            )
        self.plan = plan
        self.rank = rank
        # A recovery plan's lost ranks hold source storages nobody reads: they are not asked.
        ranks = set(plan.destination.mesh.ranks).union(*(layout.mesh.ranks for layout in plan.sources))
        self.participants = sorted(ranks - plan.lost)
        self.transport = transport
        self.timeout = timeout
        self.steps = schedule(plan, rank)
        #: per step: whether this rank quantizes a region it sends (its sends then stream)
        self._quantizes_sends = [
            any(p.quantized is not None and p.space == _SOURCE for t in step.send_transfers for p in t.pieces)
            for step in self.steps
        ]
        self._shapes = [plan.source.tensors[n].shape for n in plan.tensors]
        # Scratch memory (the broadcast policy's gathered tensors) as the regions moves write.
        self._scratch = _ScratchRegions(self.steps)
        # Storage name -> local shape, per source layout (one, unless this is a recovery plan).
        self.sources_storages: list[dict[str, tuple[int, ...]]] = [
            layout.storages_on(rank) if rank in layout.mesh else {} for layout in plan.sources
        ]
        self.source_storages = self.sources_storages[0]
        # A recovery plan's fallback sources are asked only for the storages it reads here.
        read = {(p.source, p.storage) for step in self.steps for p in step.pieces() if p.space == _SOURCE}
        for k in range(1, len(plan.sources)):
            self.sources_storages[k] = {n: s for n, s in self.sources_storages[k].items() if (k, n) in read}
        self._sources_read = {k for k, _ in read}
        self.destination_storages: dict[str, tuple[int, ...]] = (
            plan.destination.storages_on(rank) if rank in plan.destination.mesh else {}
        )
        # Storages the engine holds in another shape (``as [...]``) are indexed in the shape
        # their parts make: name -> that shape, per source layout and for the destination.
        self._parts_shapes = [
            _parts_shapes(layout, rank, held) for layout, held in zip(plan.sources, self.sources_storages)
        ]
        self._destination_parts_shapes = _parts_shapes(plan.destination, rank, self.destination_storages)
        # The padding of padded storages (``shard(d, pad = m)``) holds no logical element, so no
        # move writes it: it is zeroed in every run, since an engine's buffer may hold anything.
        self._padding = _padding_regions(plan.destination, rank, self.destination_storages)
        # A quantized destination: its scale storages, and the boxes assembled in bf16 (regions
        # that split a block), quantized after their last write (plan/quantized.py).
        quantized = plan.destination.quantized() if plan.quantization is not None else {}
        self._quantized_storages = {
            name: torch_dtype(quantized[part].values)
            for name in self.destination_storages
            if (part := plan.destination.storage(name, rank).parts[0]) in quantized
        }
        self.scale_storages: dict[str, tuple[int, ...]] = (
            plan.destination.scale_storages_on(rank) if quantized and rank in plan.destination.mesh else {}
        )
        self._scale_dtypes = {
            box.storage: torch_dtype(q.scale.dtype)
            for name, q in quantized.items()
            if self.scale_storages
            for box in plan.destination.scale_boxes(name, rank)
            if box.storage is not None
        }
        self._assemblies = _Assemblies(self.steps)
        # A destination storage is complete after its last write and its last read (a relay).
        self._complete_after = self._last_use(_DESTINATION, self.destination_storages)
        # Staging memory, kept between steps and runs: two arenas, step n stages in arena
        # n % 2, so that the next step is packed while this one is in flight. A new buffer
        # at every step cost more than the copies themselves (its pages faulted in anew).
        self._arenas = (_Arena(), _Arena())
        self._deltas: DeltaRefits | None = None  # kept copies and bases of delta runs
        #: seconds of the last run's parts: ``setup`` (staging decided, arenas reserved),
        #: ``pack`` (sends packed, posted; local copies), ``wait`` (the wire), ``unpack``; and
        #: ``steps``, how many steps it ran
        self.timing: dict[str, float] = {}
        self._kept_assemblies: dict[str, torch.Tensor] = {}  # delta runs' assembled boxes (bases)

    def _last_use(self, space: int, names: Iterable[str] = ()) -> dict[int, list[str]]:
        """Step index -> storages of ``space`` that no later step touches (``names`` start
        at -1: storages no step touches are done before the first)."""
        last = dict.fromkeys(names, -1)
        if space == _DESTINATION:
            last.update(dict.fromkeys(self.scale_storages, -1))
        for n, step in enumerate(self.steps):
            for p in step.pieces():
                if p.space == space:
                    last[p.storage] = n
                if space == _DESTINATION and p.quantized is not None and p.quantized.scale_storage is not None:
                    last[p.quantized.scale_storage] = n
        if space == _DESTINATION:  # an assembled box is written into its storages when quantized
            for n, assembly in self._assemblies.flush_storages():
                for name in (assembly.storage, assembly.scale_storage):
                    last[name] = max(last.get(name, -1), n)
        out: dict[int, list[str]] = defaultdict(list)
        for name, n in last.items():
            out[n].append(name)
        return out

    # -- checks
    def reads_source(self, index: int) -> bool:
        """Whether this rank reads anything from source layout ``index`` of the plan."""
        return index in self._sources_read

    def _per_source(
        self, sources: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
    ) -> list[Mapping[str, torch.Tensor]]:
        """One mapping of storages per source layout of the plan."""
        plan, rank = self.plan, self.rank
        if isinstance(sources, Mapping):
            if len(plan.sources) > 1:
                names = ", ".join(repr(layout.name) for layout in plan.sources)
                raise ExecutionError(
                    f"rank {rank}: plan '{plan.name}' reads from {len(plan.sources)} source layouts "
                    f"({names}): pass one mapping of storages per source layout, in that order",
                    rank=rank,
                )
            return [sources]
        per = list(sources)
        if len(per) != len(plan.sources):
            raise ExecutionError(
                f"rank {rank}: {len(per)} mappings of source storages given for the "
                f"{len(plan.sources)} source layouts of plan '{plan.name}'",
                rank=rank,
            )
        return per

    def _check(
        self,
        sources: Sequence[Mapping[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        cast: bool,
        cast_sources: bool = False,
    ) -> None:
        """Every storage this rank moves is given, with its shape and dtype; destinations are contiguous."""
        plan = self.plan
        sides = [
            ("source", wanted, given, layout)
            for wanted, given, layout in zip(self.sources_storages, sources, plan.sources)
        ]
        sides.append(("destination", self.destination_storages, destinations, plan.destination))
        for side, wanted, given, layout in sides:
            for name, shape in wanted.items():
                converts = cast if side == "destination" else cast_sources
                # a missing storage beside a key the plan does not know: most likely its misspelling
                unknown = [key for key in given if key not in wanted]
                self._check_storage(side, name, shape, given.get(name), layout, converts, unknown)
        for name, shape in self.scale_storages.items():  # scales are written as they are: no cast
            tensor = destinations.get(name)
            wanted_dtype = self._scale_dtypes.get(name)
            if tensor is None or tuple(tensor.shape) != tuple(shape) or (
                wanted_dtype is not None and tensor.dtype != wanted_dtype
            ):
                given_as = "is missing" if tensor is None else f"is {list(tensor.shape)} {tensor.dtype}"
                raise ExecutionError(
                    f"rank {self.rank}: the scale storage '{name}' (layout '{plan.destination.name}', "
                    f"{list(shape)} {wanted_dtype}) {given_as}",
                    rank=self.rank,
                )
            if not tensor.is_contiguous():
                raise ExecutionError(f"rank {self.rank}: the scale storage '{name}' is not contiguous", rank=self.rank)

    def _check_storage(
        self, side: str, name: str, shape: tuple[int, ...], tensor: torch.Tensor | None, layout: Layout, cast: bool,
        unknown: Sequence[str] = (),
    ) -> None:
        rank = self.rank
        if tensor is None:
            near = closest_name(name, unknown)
            raise ExecutionError(
                f"rank {rank}: the {side} storage '{name}' (layout '{layout.name}', shape {list(shape)}) is missing"
                + (f"; the {side} storages given hold '{near}', which the plan does not know" if near else ""),
                rank=rank,
                hint=None if near is None else f"rename '{near}' to '{name}'",
            )
        if tuple(tensor.shape) != tuple(shape):
            raise ExecutionError(
                f"rank {rank}: the {side} storage '{name}' has shape {list(tensor.shape)}, "
                f"layout '{layout.name}' needs {list(shape)}",
                rank=rank,
            )
        logical = torch_dtype(layout.tensors[layout.storage(name, rank).parts[0]].dtype)
        if side == "destination" and name in self._quantized_storages:
            logical, cast = self._quantized_storages[name], False  # fp8 values: written, never cast
        # A storage in another dtype is converted by the copies themselves (copy_ casts):
        # a source while it is packed or copied, a destination as it is written.
        if tensor.dtype != logical and not cast:
            advice = (
                " (pass cast=True to convert on arrival)"
                if side == "destination"
                else " (pass cast_sources=True to convert it while packing, as torch's .to() does)"
            )
            if side == "destination" and name in self._quantized_storages:
                advice = " (it stores its tensors quantized: fp8 values here, the scales in their own storages)"
            raise ExecutionError(
                f"rank {rank}: the {side} storage '{name}' is {tensor.dtype}, layout '{layout.name}' "
                f"holds {logical}{advice}",
                rank=rank,
            )
        if side == "destination" and not tensor.is_contiguous():
            raise ExecutionError(f"rank {rank}: the destination storage '{name}' is not contiguous", rank=rank)

    # -- running
    def run(
        self,
        sources: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        *,
        cast: bool = False,
        cast_sources: bool = False,
        on_complete: OnComplete | None = None,
        progress: Callable[[int, int], None] | None = None,
        not_ready: str | None = None,
        delta: bool | str | DeltaOptions = False,
    ) -> RunReport:
        """Move every byte this rank sends or receives; destinations are written in place.

        All ranks first check their storages and agree that every rank is ready, so a bad
        storage on one rank stops every rank before any byte moves. A recovery plan takes
        one mapping of source storages per source layout (``plan.sources``, in order).
        ``cast`` accepts destinations, ``cast_sources`` sources, in another dtype than the
        layout's; values are converted as ``tensor.to(dtype)`` converts them.

        ``delta``: send each message as its changes since the version its receiver holds
        (:mod:`.delta`; every rank must ask for it alike). The first delta run, and every
        message whose receiver holds no version, moves dense. ``True`` or ``"copies"``: this
        rank keeps a copy of what it sends; ``"digests"``: only a digest per 4 KiB block, and
        the blocks that changed travel whole; :class:`~.delta.DeltaOptions`: a budget for the
        copies, or a directory to keep them in.
        """
        options = delta_options(delta)
        if options is not None and not self.transport.variable_length and not_ready is None:
            not_ready = (
                f"delta refits need a transport that delivers a message into a longer receive (gloo); "
                f"{type(self.transport).__name__} on {self.transport.device} does not"
            )
        per_source = self._check_and_agree(sources, destinations, cast, not_ready, cast_sources, options is not None)
        device = device_of([t for given in per_source for t in given.values()] + list(destinations.values()))
        spaces = _Spaces(
            [_as_parts(given, shapes) for given, shapes in zip(per_source, self._parts_shapes)],
            _as_parts(destinations, self._destination_parts_shapes),
            self._scratch,
            device,
        )
        tally = _Tally()
        in_parts = _as_parts(destinations, self._destination_parts_shapes) if self._padding else destinations
        for name, regions in self._padding.items():
            for region in regions:
                in_parts[name][region].zero_()
        self._announce(-1, destinations, on_complete)
        start = time.perf_counter()
        in_place = not _overlapping(per_source, destinations)
        spaces.alias_sources = in_place  # a source region copied into scratch is read where it lies
        # a delta run keeping copies reads a staged source region where it lies (sources only
        # read: not when destinations share their memory)
        reads_in_place = in_place and options is not None and options.keep == "copies"
        staging = self._staging(spaces, in_place=in_place, device=device, encode_in_place=reads_in_place)
        if delta:  # the bf16 boxes assembled for quantized tensors are patched from run to run
            spaces.assembled, spaces.keep_assemblies = self._kept_assemblies, True
        deltas = self._start_deltas(spaces, destinations, options) if options is not None else None
        packed_next: list[tuple[int, torch.Tensor]] | None = None
        clock = time.perf_counter
        timing = self.timing = {
            "setup": clock() - start, "pack": 0.0, "post": 0.0, "local": 0.0, "wait": 0.0, "unpack": 0.0,
        }
        with copy_threads(device):  # the copies around the wire: see copy_threads
            for n, step in enumerate(self.steps):
                mark = clock()
                recvs = self._receive_buffers(n, spaces, staging)
                landing = recvs
                pending: Pending
                if packed_next is None and deltas is None and self._streams(n, device):
                    # the receives first, then each send as soon as it is packed (quantized):
                    # the wire starts with the first region, not after the step's last
                    pending = self._post_streamed(step, self._packing(n, spaces, staging), recvs)
                    posting = clock()
                else:
                    sends = packed_next if packed_next is not None else self._pack(n, spaces, staging)
                    if deltas is not None:
                        sends = deltas.encode_sends(n, sends)
                        recvs = deltas.receive_buffers(n, landing)
                    posting = clock()
                    pending = self._post(step, sends, recvs)
                timing["pack"] += posting - mark
                local = clock()
                timing["post"] += local - posting
                self._copy_locally(step, spaces, tally)
                packed_next = self._pack_ahead(n, spaces, staging)
                waiting = clock()
                timing["local"] += waiting - local
                pending.wait(self.timeout)
                unpacking = clock()
                timing["wait"] += unpacking - waiting
                if deltas is not None:
                    staged = {k for k in range(len(landing)) if (n, "recv", k) not in staging.direct}
                    deltas.decode(n, recvs, landing, staged, lambda sent, place: _gather_base(spaces, sent, place))
                self._unpack(n, landing, spaces, tally, staging)
                timing["unpack"] += clock() - unpacking
                self._copy_out_of_scratch(n, spaces)
                self._assemblies.flush(n, spaces)
                tally.sent_messages(step, self._kind)
                tally.staged(staging.arena_bytes + spaces.scratch_bytes())
                spaces.free(self._scratch.free_after.get(n, ()))
                self._announce(n, destinations, on_complete)
                if progress is not None:
                    progress(n + 1, len(self.steps))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timing["steps"] = len(self.steps)
        report = tally.report(self.rank, time.perf_counter() - start, len(self.steps))
        if deltas is None:
            return report
        assembled = sum(t.numel() * t.element_size() for t in self._kept_assemblies.values())
        return attrs.evolve(report, delta=deltas.report(kept_besides=assembled))

    def _start_deltas(
        self, spaces: _Spaces, destinations: Mapping[str, torch.Tensor], options: DeltaOptions
    ) -> DeltaRefits:
        """This run's deltas: what each receiver holds, exchanged before the first step (a
        sender that changes what it keeps starts again from dense)."""
        if self._deltas is None or self._deltas.options != options:
            self._deltas = DeltaRefits(self.steps, self.rank, options)
        dtypes = {name: tensor.dtype for name, tensor in destinations.items()}
        self._deltas.start(self.transport, self.timeout, lambda transfer: _held(spaces, transfer), dtypes)
        return self._deltas

    def _staging(
        self, spaces: _Spaces, *, in_place: bool, device: torch.device, encode_in_place: bool = False
    ) -> _Staging:
        """Which messages of this run travel in place (a message of one region that is
        contiguous in its storage, in the wire's dtype: sent from, or received into, the
        storage itself) and where the others are staged: arena ``n % 2`` for step ``n``,
        grown (once, not per run) to the largest staged step of its parity. A message's
        transfers (:meth:`~.schedule.Message.transfers`) are decided one by one.

        ``in_place`` is False when destination storages share memory with source storages
        (one buffer handed as both): a receive written in place could then overwrite bytes
        a send of the same step has not read yet, so every message is staged, as before.
        """
        direct: set[tuple[int, str, int]] = set()
        need = [0, 0]
        for n, step in enumerate(self.steps):
            staged = 0
            for way, transfers in (("send", step.send_transfers), ("recv", step.recv_transfers)):
                for k, transfer in enumerate(transfers):
                    if in_place and len(transfer.pieces) == 1 and spaces.contiguous(transfer.pieces[0], transfer.part):
                        direct.add((n, way, k))
                    else:
                        staged += transfer.nbytes
            need[n % 2] = max(need[n % 2], staged)
        # A CPU arena that an NCCL transport copies to the GPU is pinned: the copy then runs at
        # the link's speed and does not stage once more in CUDA's own bounce buffer.
        moved_on = getattr(self.transport, "device", None)
        pin = device.type == "cpu" and moved_on is not None and moved_on.type == "cuda" and torch.cuda.is_available()
        for arena, nbytes in zip(self._arenas, need):
            arena.reserve(nbytes, device, pin)
        return _Staging(self._arenas, direct, encode_in_place)

    def _receive_buffers(self, n: int, spaces: _Spaces, staging: _Staging) -> list[tuple[int, torch.Tensor]]:
        """Where step ``n``'s transfers arrive: the region itself (in place), or the step's
        arena after its staged sends."""
        step = self.steps[n]
        out = []
        offset = sum(t.nbytes for k, t in enumerate(step.send_transfers) if (n, "send", k) not in staging.direct)
        buffer = staging.arena(n)
        for k, transfer in enumerate(step.recv_transfers):
            if (n, "recv", k) in staging.direct:
                out.append((transfer.peer, _wire(spaces.region(transfer.pieces[0]))))
            else:
                out.append((transfer.peer, buffer[offset : offset + transfer.wire_bytes]))
                offset += transfer.nbytes
        return out

    def _check_and_agree(
        self,
        sources: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        cast: bool,
        not_ready: str | None,
        cast_sources: bool = False,
        delta: bool = False,
    ) -> list[Mapping[str, torch.Tensor]]:
        """This rank's source storages per source layout, once every rank has said it is ready.

        A problem found here (or ``not_ready``) is not raised at once: it goes into the
        agreement, so every rank stops with it before any byte moves.
        """
        problem = not_ready
        per_source: list[Mapping[str, torch.Tensor]] = []
        try:
            per_source = self._per_source(sources)
        except ExecutionError as err:
            problem = problem or err.message
        if problem is None:
            try:
                self._check(per_source, destinations, cast, cast_sources)
            except ExecutionError as err:
                problem = err.message
        fingerprint = self.plan.fingerprint
        if delta and fingerprint:  # a rank asking for deltas and one not are told apart here
            fingerprint = hashlib.sha256(f"{fingerprint}/delta".encode()).hexdigest()[: len(fingerprint)]
        agree(
            self.transport, self.rank, self.participants, fingerprint, problem, self.timeout,
            failure="is not ready",
        )
        return per_source

    def _post(self, step: Step, sends: Buffers, recvs: Buffers) -> Pending:
        """Post the step's receives and sends at once (a peer's transfers in order: transports
        match the messages between two ranks with one tag in the order they are posted)."""
        return self.transport.exchange(
            sends,
            recvs,
            tag=(step.bucket * 4 + step.stage) % AGREEMENT_TAG,  # the same on both ends
        )

    def _copy_locally(self, step: Step, spaces: _Spaces, tally: _Tally) -> None:
        """The step's local copies, done while its messages are in flight. A copy out of
        scratch was already done, region by region, in the steps that wrote its regions
        (:meth:`_copy_out_of_scratch`); a copy of a source region into scratch only names
        the source's memory, where it lies, as that scratch region."""
        nbytes = 0
        for read, write in step.copies:
            nbytes += read.nbytes
            if read.space == _SCRATCH:
                continue
            if write.quantized is not None:  # quantized straight into the destination and its scales
                quantize_into(spaces.view(read), spaces.region(write), spaces.scales(write),
                              write.quantized.format, write.quantized.block, write.quantized.convention)
                continue
            value = spaces.view(read)
            aliased = spaces.alias_sources and read.space == _SOURCE and value.dtype == write.dtype
            if write.space == _SCRATCH and aliased:
                spaces.bind(write, value)
                continue
            target = spaces.region(write)
            if not _same_memory(target, value):  # a storage that is its own source stays put
                target.copy_(value)
        tally.sent["local"] += nbytes
        tally.received["local"] += nbytes

    def _copy_out_of_scratch(self, n: int, spaces: _Spaces) -> None:
        """Every local copy out of a scratch region written in step ``n``, as soon as it is
        written: the region is then freed after its last send, instead of living until the
        plan's copy (a gathered tensor's regions arrive over many buckets)."""
        for read, write, region, within in self._scratch.copies_after.get(n, ()):
            spaces.region(write)[_slices(within, read)].copy_(spaces.scratch[region.id][_slices(within, region)])

    def _pack_ahead(self, n: int, spaces: _Spaces, staging: _Staging) -> list[tuple[int, torch.Tensor]] | None:
        """Pipelining: the next step's messages, packed (into the other arena) while step ``n``
        is in flight, when they do not read what step ``n`` is about to receive (None otherwise)."""
        if n + 1 < len(self.steps) and self.steps[n + 1].sends_read_only_sources:
            return self._pack(n + 1, spaces, staging)
        return None

    def _unpack(self, n: int, recvs: Buffers, spaces: _Spaces, tally: _Tally, staging: _Staging) -> None:
        """Copy every staged region out of its transfer into its place (casting on arrival);
        a transfer received in place is already there."""
        for k, (transfer, (peer, buf)) in enumerate(zip(self.steps[n].recv_transfers, recvs)):
            direct = (n, "recv", k) in staging.direct
            tally.in_place += transfer.wire_bytes if direct else 0
            if transfer.part:  # one part of a quantized region: its values (maybe in place), or scales
                if not direct:
                    _copy_bytes(_part_of(spaces, transfer), _part_view(buf, transfer))
                tally.received[self._kind(peer)] += transfer.wire_bytes
                continue
            nbytes = 0
            for piece, offset in zip(transfer.pieces, transfer.offsets):
                if piece.quantized is not None:  # fp8 values and scales, written as they came
                    values, scales = _quantized_views(buf[offset : offset + piece.nbytes], piece)
                    _copy_bytes(spaces.region(piece), values)
                    _copy_bytes(spaces.scales(piece), scales)
                elif not direct:
                    staged = buf[offset : offset + piece.nbytes].view(piece.dtype).view(piece.sizes)
                    spaces.region(piece).copy_(staged)
                nbytes += piece.nbytes
            tally.received[self._kind(peer)] += nbytes

    def _announce(self, step: int, destinations: Mapping[str, torch.Tensor], on_complete: OnComplete | None) -> None:
        """Hand the engine each destination storage complete after ``step`` (-1: before the
        first): after the step of its last write, and of its last read (a relay forwarding
        from it) too."""
        if on_complete is not None:
            for name in self._complete_after.get(step, ()):
                on_complete(name, destinations[name])

    def _kind(self, peer: int) -> str:
        same = self.plan.domain_size and peer // self.plan.domain_size == self.rank // self.plan.domain_size
        return "domain" if same else "network"

    def _pack_part(self, transfer: Message, buf: torch.Tensor, after: torch.Tensor, spaces: _Spaces) -> None:
        """Stage one part of a large quantized region (:meth:`~.schedule.Message.transfers`):
        a source region is quantized once, when its values are packed, with its scales
        written straight into the slot of the next transfer (``after``), which is its scales
        part; a relay forwards what it received, part by part."""
        piece = transfer.pieces[0]
        q = piece.quantized
        assert q is not None
        if piece.space == _SOURCE:
            if transfer.part == "values":
                values = buf.view(q.values).view(piece.sizes)
                scales = after[: part_bytes(piece, "scales")].view(q.scale_dtype).view(q.scale_sizes)
                quantize_into(spaces.view(piece), values, scales, q.format, q.block, q.convention)
            return
        _copy_bytes(_part_view(buf, transfer), _part_of(spaces, transfer, received=False))

    def _streams(self, n: int, device: torch.device) -> bool:
        """Whether step ``n``'s sends are posted one by one as they are packed: where packing
        them is real work (a region quantized by this sender) and the transport's operations
        progress on their own (gloo's, on the CPU; NCCL's of one stream would queue a send
        behind the step's receives)."""
        return device.type == "cpu" and self._quantizes_sends[n]

    def _post_streamed(self, step: Step, sends: Iterable[tuple[int, torch.Tensor]], recvs: Buffers) -> Pending:
        """Post the step's receives, then each send as it comes: a peer's transfers still
        leave in their order, with the step's tag, so they match as :meth:`_post`'s do."""
        posted = [self._post(step, [], recvs)]
        posted.extend(self._post(step, [send], []) for send in sends)  # each packed, then posted
        return _AllPending(posted)

    def _pack(self, n: int, spaces: _Spaces, staging: _Staging) -> list[tuple[int, torch.Tensor]]:
        """Step ``n``'s transfers: the region itself (in place), or its regions copied at their
        offsets into the step's arena."""
        return list(self._packing(n, spaces, staging))

    def _packing(self, n: int, spaces: _Spaces, staging: _Staging) -> Iterator[tuple[int, torch.Tensor]]:
        """:meth:`_pack`, one transfer at a time."""
        buffer = staging.arena(n)
        offset = 0
        for k, transfer in enumerate(self.steps[n].send_transfers):
            if (n, "send", k) in staging.direct:
                yield (transfer.peer, _wire(spaces.view(transfer.pieces[0])))
                continue
            rows = _region_rows(spaces, transfer) if staging.encode_in_place else None
            if rows is not None:  # the delta encoder reads the region where it lies: nothing to pack
                yield (transfer.peer, rows)
                offset += transfer.nbytes
                continue
            buf = buffer[offset : offset + transfer.wire_bytes]
            if transfer.part:
                self._pack_part(transfer, buf, buffer[offset + transfer.nbytes :], spaces)
            else:
                for piece, at in zip(transfer.pieces, transfer.offsets):
                    if piece.quantized is not None:
                        values, scales = _quantized_views(buf[at : at + piece.nbytes], piece)
                        if piece.space == _SOURCE:  # quantized while packing, read where it lies
                            q = piece.quantized
                            quantize_into(spaces.view(piece), values, scales, q.format, q.block, q.convention)
                        else:  # a relay forwards the values and scales it received
                            _copy_bytes(values, spaces.view(piece))
                            _copy_bytes(scales, spaces.scales(piece))
                        continue
                    staged = buf[at : at + piece.nbytes].view(piece.dtype).view(piece.sizes)
                    if piece.space == _SCRATCH:  # from the regions that hold it
                        for where, value in spaces.parts(piece):
                            staged[where].copy_(value)
                    else:
                        staged.copy_(spaces.view(piece))
            yield (transfer.peer, buf)
            offset += transfer.nbytes


class _AllPending(Pending):
    """Exchanges posted one after another for one step, completed together."""

    def __init__(self, parts: Sequence[Pending]):
        first = parts[0]
        super().__init__(first.transport, [x for p in parts for x in p.labels], [x for p in parts for x in p.peers])
        self.parts = list(parts)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for part in self.parts:
            part._wait(max(0.001, deadline - time.monotonic()))


class _Spaces:
    """This rank's storages in a run, by space: the source storages of each source layout,
    the destination storages, and scratch memory: one buffer per region a move writes
    (made on first use, freed after its last read), or the source region it copies."""

    def __init__(
        self,
        sources: Sequence[Mapping[str, torch.Tensor]],
        destinations: Mapping[str, torch.Tensor],
        scratch: _ScratchRegions,
        device: torch.device,
    ):
        self.device = device
        self.regions = scratch
        self.scratch: dict[int, torch.Tensor] = {}  # region id -> its elements, in the tensor's order
        self._bound: set[int] = set()  # regions that are views of a source: they cost nothing
        self.alias_sources = False
        self._storages: dict[tuple[int, int], Mapping[str, torch.Tensor]] = {
            (_SOURCE, k): given for k, given in enumerate(sources)
        }
        self._storages[(_DESTINATION, 0)] = destinations
        self.assembled: dict[str, torch.Tensor] = {}  # assembly key -> its box, in the logical dtype
        self.keep_assemblies = False  # a delta run's: the assembled boxes are the base of the next

    def assembly(self, piece: Piece) -> torch.Tensor:
        """The bf16 buffer of the destination box an assembly piece lands in (made on first use)."""
        box = self.assembled.get(piece.storage)
        if box is None:
            assert piece.assembly is not None
            box = self.assembled[piece.storage] = torch.empty(
                piece.assembly.sizes, dtype=piece.dtype, device=self.device
            )
        return box

    def scales(self, piece: Piece) -> torch.Tensor:
        """The scales of a quantized destination piece, in its rank's scale storage."""
        q = piece.quantized
        assert q is not None and q.scale_storage is not None and q.scale_index is not None
        return self._storages[(_DESTINATION, 0)][q.scale_storage][q.scale_index]

    def destination(self, name: str) -> torch.Tensor:
        return self._storages[(_DESTINATION, 0)][name]

    def view(self, piece: Piece) -> torch.Tensor:
        """The region a piece reads, in the logical tensor's order (a view of its storage)."""
        if piece.space == _ASSEMBLY:
            return self.assembly(piece)[piece.index]
        if piece.space == _SCRATCH:
            parts = self.parts(piece)
            if len(parts) != 1 or parts[0][1].shape != torch.Size(piece.sizes):
                raise AssertionError(f"scratch {piece.storage}{piece.index} is not one region")  # see contiguous()
            return parts[0][1]
        return _oriented(self._storages[piece.key][piece.storage][piece.index], piece)

    def region(self, piece: Piece) -> torch.Tensor:
        """The region a piece writes, in the logical tensor's order (a view of its storage)."""
        if piece.space == _ASSEMBLY:
            return self.assembly(piece)[piece.index]
        if piece.space == _SCRATCH:
            region = self.regions.written[id(piece)]
            if region.id not in self.scratch:
                self.scratch[region.id] = torch.empty(piece.sizes, dtype=piece.dtype, device=self.device)
            return self.scratch[region.id]
        return _oriented(self._storages[piece.key][piece.storage][piece.index], piece)

    def bind(self, piece: Piece, value: torch.Tensor) -> None:
        """Scratch region ``piece`` is ``value`` (a source region it copies: read in place)."""
        region = self.regions.written[id(piece)]
        self.scratch[region.id] = value
        self._bound.add(region.id)

    def parts(self, piece: Piece) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """A scratch read as (where in the piece, the elements) of each region it overlaps."""
        return [
            (_slices(within, piece), self.scratch[region.id][_slices(within, region)])
            for region, within in self.regions.read[id(piece)]
        ]

    def free(self, regions: Iterable[int]) -> None:
        for rid in regions:
            self.scratch.pop(rid, None)
            self._bound.discard(rid)

    def contiguous(self, piece: Piece, part: str = "") -> bool:
        """Whether the piece's region is one run of its storage's memory in the order and
        dtype of the wire, so that it can be sent or received without a staging copy. A
        quantized region's values alone (``part``) travel in place from or into a
        destination storage of fp8 values (a receiver, a relay forwarding them); a sender
        that quantizes them stages them, since that is where it writes them."""
        if piece.quantized is not None and part == "values" and piece.space == _DESTINATION and not piece.transposed:
            storage = self._storages[piece.key][piece.storage]
            return storage.dtype == piece.quantized.values and storage.is_contiguous() and (
                _contiguous_region(tuple(storage.shape), piece.index)
            )
        if piece.transposed or piece.quantized is not None or piece.space == _ASSEMBLY:
            return False  # quantized pieces are staged with their scales; assemblies are apart
        if piece.space == _SCRATCH:
            if id(piece) in self.regions.written:  # a region written: a buffer of its own
                return True
            # a read: in place when it lies in one region, received (a fresh, contiguous
            # buffer) or a source region that is itself contiguous (read where it lies)
            overlaps = self.regions.read[id(piece)]
            if len(overlaps) != 1:
                return False
            region, within = overlaps[0]
            copied = self.regions.copied_from.get(region.id)
            if not region.received and not (self.alias_sources and copied is not None and self.contiguous(copied)):
                return False
            sizes = tuple(stop - start for start, stop in region.box)
            return _contiguous_region(sizes, _slices(within, region))
        storage = self._storages[piece.key][piece.storage]
        if storage.dtype != piece.dtype or not storage.is_contiguous():
            return False
        return _contiguous_region(tuple(storage.shape), piece.index)

    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for rid, t in self.scratch.items() if rid not in self._bound)


_Box = tuple[tuple[int, int], ...]  # one (start, stop) per dim of a logical tensor


def _quantized_views(buf: torch.Tensor, piece: Piece) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized piece's bytes in a message: its fp8 values (the region's shape), then at
    the next 16-byte boundary its scales."""
    q = piece.quantized
    assert q is not None
    (_, nvalues), (start, nscales) = quantized_spans(piece)
    values = buf[:nvalues].view(q.values).view(piece.sizes)
    scales = buf[start : start + nscales].view(q.scale_dtype).view(q.scale_sizes)
    return values, scales


def _part_view(buf: torch.Tensor, transfer: Message) -> torch.Tensor:
    """The bytes of a part transfer as its part: the region's fp8 values, or its scales."""
    piece = transfer.pieces[0]
    q = piece.quantized
    assert q is not None
    if transfer.part == "values":
        return buf[: transfer.wire_bytes].view(q.values).view(piece.sizes)
    return buf[: transfer.wire_bytes].view(q.scale_dtype).view(q.scale_sizes)


def _part_of(spaces: _Spaces, transfer: Message, received: bool = True) -> torch.Tensor:
    """Where a part transfer's region lies on this rank: its values (the region it writes
    where ``received``, else the one it reads), or its scales."""
    piece = transfer.pieces[0]
    if transfer.part == "values":
        return spaces.region(piece) if received else spaces.view(piece)
    return spaces.scales(piece)


def _held(spaces: _Spaces, transfer: Message) -> list[torch.Tensor]:
    """The destination tensors a received transfer lands in: its regions (and their scales)."""
    if transfer.part:
        return [_part_of(spaces, transfer)]
    out = []
    for piece in transfer.pieces:
        out += [spaces.region(piece)] + ([spaces.scales(piece)] if piece.quantized is not None else [])
    return out


def _gather_base(spaces: _Spaces, transfer: Message, place: torch.Tensor) -> None:
    """Write what a received transfer's regions hold into its staged message (the inverse
    of :meth:`Executor._unpack`): the base a delta patches."""
    if transfer.part:
        _copy_bytes(_part_view(place, transfer), _part_of(spaces, transfer))
        return
    for piece, offset in zip(transfer.pieces, transfer.offsets):
        slot = place[offset : offset + piece.nbytes]
        if piece.quantized is not None:
            values, scales = _quantized_views(slot, piece)
            _copy_bytes(values, spaces.region(piece))
            _copy_bytes(scales, spaces.scales(piece))
        else:
            slot.view(piece.dtype).view(piece.sizes).copy_(spaces.region(piece))


def _copy_bytes(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copies fp8 values or scales as bytes (the same dtype on both sides: nothing converts)."""
    if target.dtype != value.dtype:
        raise AssertionError(f"{value.dtype} bytes copied into {target.dtype}")
    target.view(torch.uint8).copy_(value.view(torch.uint8))


class _Assemblies:
    """The destination boxes of quantized tensors this rank assembles in bf16 (their regions
    split blocks at the source), by key: each is quantized into its storages after the step
    of its last write (every block it stores is then whole there), and freed after its last
    use (a relay may forward from it). Only the blocks its assembled regions touch are
    quantized: a region quantized at its sender covers whole blocks of its own."""

    def __init__(self, steps: Sequence[Step]):
        self.of: dict[str, Assembly] = {}
        self.last_write: dict[str, int] = {}
        last_use: dict[str, int] = {}
        self.blocks: dict[str, set[_Box]] = defaultdict(set)
        for n, step in enumerate(steps):
            writes = [w for _, w in step.copies] + [p for m in step.recvs.values() for p in m.pieces]
            for piece in step.pieces():
                if piece.space != _ASSEMBLY or piece.assembly is None:
                    continue
                a = piece.assembly
                self.of[piece.storage] = a
                last_use[piece.storage] = n
            for piece in writes:
                if piece.space != _ASSEMBLY or piece.assembly is None:
                    continue
                self.last_write[piece.storage] = n
                self.blocks[piece.storage].add(_expanded(piece))
        self.flush_after: dict[int, list[str]] = defaultdict(list)
        for key, n in self.last_write.items():
            self.flush_after[n].append(key)
        self.free_after: dict[int, list[str]] = defaultdict(list)
        for key, n in last_use.items():
            self.free_after[max(n, self.last_write.get(key, n))].append(key)

    def flush_storages(self) -> list[tuple[int, Assembly]]:
        return [(n, self.of[key]) for key, n in self.last_write.items()]

    def flush(self, n: int, spaces: _Spaces) -> None:
        """Quantizes the assemblies whose last write was step ``n``, then frees those done with."""
        for key in self.flush_after.get(n, ()):
            a = self.of[key]
            box = spaces.assembled[key]
            values = spaces.destination(a.storage)
            scales = spaces.destination(a.scale_storage)
            lead = len(a.storage_offsets) - len(a.sizes)
            slead = len(a.scale_storage_offsets) - len(a.sizes)
            for local in sorted(self.blocks[key]):
                where = tuple(slice(start, stop) for start, stop in local)
                into: tuple[int | slice, ...] = (
                    *a.storage_offsets[:lead],
                    *(slice(so + start, so + stop) for so, (start, stop) in zip(a.storage_offsets[lead:], local)),
                )
                # the blocks' scales: global block coordinates less the box's first block
                scale_into: tuple[int | slice, ...] = (
                    *a.scale_storage_offsets[:slead],
                    *(
                        slice(so + (o + start) // b - o // b, so + -(-(o + stop) // b) - o // b)
                        for so, o, (start, stop), b in zip(a.scale_storage_offsets[slead:], a.offsets, local, a.block)
                    ),
                )
                quantize_into(box[where], values[into], scales[scale_into], a.format, a.block, a.convention)
        if not spaces.keep_assemblies:
            for key in self.free_after.get(n, ()):
                spaces.assembled.pop(key, None)


def _expanded(piece: Piece) -> _Box:
    """The blocks an assembly piece touches, as a box local to its destination box (block
    boundaries are global: the box starts on one; the tensor's end cuts the last)."""
    a = piece.assembly
    assert a is not None
    out = []
    for item, o, size, b in zip(piece.index, a.offsets, a.sizes, a.block):
        assert isinstance(item, slice)
        start = (o + item.start) // b * b - o
        stop = min(-(-(o + item.stop) // b) * b - o, size)
        out.append((start, stop))
    return tuple(out)


@attrs.frozen
class _Region:
    """A region of a scratch tensor that one move writes, in step ``step``."""

    id: int
    storage: str
    step: int
    box: _Box
    received: bool  # written by a receive (else by a local copy)


class _ScratchRegions:
    """Scratch memory of one rank's schedule as the regions its moves write, rather than
    whole tensors: the broadcast policy gathers a tensor whole on a rank, but most of what a
    rank receives into scratch it only forwards, and a region is freed after its last read.
    Copies out of scratch (into a destination) are done in the step that writes each region.

    Pieces are keyed by identity: the schedule's Piece objects live as long as the Executor.
    """

    def __init__(self, steps: Sequence[Step]):
        self.written: dict[int, _Region] = {}
        self.read: dict[int, list[tuple[_Region, _Box]]] = {}
        self.copies_after: dict[int, list[tuple[Piece, Piece, _Region, _Box]]] = defaultdict(list)
        self.copied_from: dict[int, Piece] = {}  # region id -> the source region a copy writes into it
        by_storage: dict[str, list[_Region]] = defaultdict(list)
        for n, step in enumerate(steps):
            writes = [(w, False) for _, w in step.copies] + [(p, True) for m in step.recvs.values() for p in m.pieces]
            for piece, received in writes:
                if piece.space == _SCRATCH:
                    region = _Region(len(self.written), piece.storage, n, _box_of(piece), received)
                    self.written[id(piece)] = region
                    by_storage[piece.storage].append(region)
            for read, write in step.copies:
                if write.space == _SCRATCH and read.space == _SOURCE:
                    self.copied_from[self.written[id(write)].id] = read
        last = {region.id: region.step for region in self.written.values()}
        for n, step in enumerate(steps):
            reads = [(r, w) for r, w in step.copies] + [(p, None) for m in step.sends.values() for p in m.pieces]
            for piece, copied_to in reads:
                if piece.space != _SCRATCH:
                    continue
                box = _box_of(piece)
                overlaps = [
                    (r, within) for r in by_storage[piece.storage] if (within := _intersect(r.box, box)) is not None
                ]
                self.read[id(piece)] = overlaps
                for region, within in overlaps:
                    if copied_to is not None:
                        self.copies_after[region.step].append((piece, copied_to, region, within))
                    else:
                        last[region.id] = max(last[region.id], n)
        self.free_after: dict[int, list[int]] = defaultdict(list)
        for rid, n in last.items():
            self.free_after[n].append(rid)


def _box_of(piece: Piece) -> _Box:
    """A scratch piece's box: scratch holds whole tensors, so its index is one slice per dim."""
    return tuple((item.start, item.stop) for item in piece.index if isinstance(item, slice))


def _intersect(a: _Box, b: _Box) -> _Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(start < stop for start, stop in box) else None


def _slices(box: _Box, within: _Region | Piece) -> tuple[slice, ...]:
    """``box`` as slices of the elements of ``within`` (a region, or a piece's region)."""
    origin = within.box if isinstance(within, _Region) else _box_of(within)
    return tuple(slice(start - o, stop - o) for (start, stop), (o, _) in zip(box, origin))


@attrs.define
class _Tally:
    """What a run moved: bytes by kind sent and received, messages, peak staging memory."""

    sent: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    received: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(KINDS, 0))
    messages: int = 0
    peak: int = 0
    in_place: int = 0

    def staged(self, live: int) -> None:
        """Staging memory live during a step: both arenas and the scratch buffers."""
        self.peak = max(self.peak, live)

    def sent_messages(self, step: Step, kind: Callable[[int], str]) -> None:
        for peer, message in step.sends.items():
            self.sent[kind(peer)] += sum(p.nbytes for p in message.pieces)
        self.messages += len(step.sends)

    def report(self, rank: int, seconds: float, steps: int) -> RunReport:
        return RunReport(
            rank, seconds, self.sent, self.received, self.messages, steps, self.peak, received_in_place=self.in_place
        )


class _Arena:
    """One staging buffer an Executor keeps: steps take views of it, and it grows only when a
    run stages more than it holds (so after the first run nothing is allocated)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int, device: torch.device, pin: bool) -> None:
        buffer = self.buffer
        if buffer is not None and buffer.numel() >= nbytes and buffer.device == device and buffer.is_pinned() >= pin:
            return
        self.buffer = None  # the old one goes first: both at once could exceed the budget
        if nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


@attrs.frozen
class _Staging:
    """One run's staging: the arenas, and the transfers (step, "send" or "recv", index in the
    step's transfers that way) that travel in place."""

    arenas: tuple[_Arena, _Arena]
    direct: set[tuple[int, str, int]]
    #: a delta run keeping copies: a staged message of one source region is handed to the
    #: encoder as the region's rows (:func:`_region_rows`), not packed
    encode_in_place: bool = False

    def arena(self, n: int) -> torch.Tensor:
        buffer = self.arenas[n % 2].buffer
        return buffer if buffer is not None else _EMPTY

    @property
    def arena_bytes(self) -> int:
        return sum(a.nbytes for a in self.arenas)


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _contiguous_region(shape: Sequence[int], index: Sequence[slice | int]) -> bool:
    """Whether ``storage[index]`` of a contiguous storage of ``shape`` is one run of memory:
    every dim after some dim is whole, and every dim before it holds one index."""
    items = list(index) + [slice(0, n) for n in shape[len(index) :]]
    sizes = [1 if isinstance(item, int) else item.stop - item.start for item in items]
    k = len(shape)  # the dims from k on are whole
    while k > 0 and sizes[k - 1] == shape[k - 1]:
        k -= 1
    return all(size == 1 for size in sizes[: max(0, k - 1)])


def _region_rows(spaces: _Spaces, transfer: Message) -> torch.Tensor | None:
    """A staged message of one source region as 2-D rows of its bytes where they lie (what
    :func:`~.wire_encoding.encode` reads without a packed copy), or None: a message of
    several regions, a quantized or scratch one, one under
    :data:`~.wire_encoding.MIN_DELTA_BYTES`, or a region whose rows are not whole 8-byte
    words of one stride."""
    if len(transfer.pieces) != 1 or transfer.wire_bytes < MIN_DELTA_BYTES:
        return None
    piece = transfer.pieces[0]
    if piece.quantized is not None or piece.space != _SOURCE:
        return None
    region = spaces.view(piece)
    if region.dim() == 0 or region.stride(-1) != 1:
        return None
    try:
        as_bytes = region.view(torch.uint8)
        rows = as_bytes.view(-1, as_bytes.shape[-1])  # fails where the leading dims do not collapse
    except RuntimeError:
        return None
    return rows if rows.shape[1] % 8 == 0 else None


def _wire(region: torch.Tensor) -> torch.Tensor:
    """A contiguous region as the 1-D uint8 buffer a transport moves (the same memory)."""
    # as_strided, not reshape: torch calls a tensor with a dim of size 1 contiguous whatever
    # that dim's stride, and reshape may keep the stride ((1, 1) with strides (1, 6) -> (1,) with 6)
    return region.as_strided((region.numel(),), (1,)).view(torch.uint8)


def _overlapping(
    sources: Sequence[Mapping[str, torch.Tensor]], destinations: Mapping[str, torch.Tensor]
) -> bool:
    """Whether any destination storage shares memory with any source storage (a sweep over
    the sorted spans of their memory: a rank may hold thousands of storages)."""

    def span(t: torch.Tensor) -> tuple[int, int]:  # the bytes a (possibly strided) view can touch
        extent = sum((n - 1) * abs(stride) for n, stride in zip(t.shape, t.stride())) + 1
        return (t.data_ptr(), t.data_ptr() + extent * t.element_size())

    held = sorted(span(t) for given in sources for t in given.values() if t.numel())
    starts = [start for start, _ in held]
    reach = list(itertools.accumulate((stop for _, stop in held), max))  # furthest end so far
    for t in destinations.values():
        if t.numel():
            start, stop = span(t)
            k = bisect.bisect_left(starts, stop)  # the source spans that start before this one ends
            if k and reach[k - 1] > start:
                return True
    return False


def _parts_shapes(layout: Layout, rank: int, held: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The storages of ``held`` whose parts make another shape than the engine's, with that shape."""
    out = {}
    for name, shape in held.items():
        parts = layout.parts_shape(name, rank)
        if parts is not None and parts != shape:
            out[name] = parts
    return out


def _padding_regions(
    layout: Layout, rank: int, held: Mapping[str, tuple[int, ...]]
) -> dict[str, list[tuple[slice, ...]]]:
    """Per padded storage ``rank`` holds, the regions (in its parts' shape) that no box covers:
    its padding, as a few boxes, so that zeroing it writes nothing else."""
    resolved = layout.resolved
    padded = {
        resolved.storage_of[i]
        for i in range(len(resolved.names))
        if any(pad != 1 for pad, _ in resolved.specs[resolved.spec_of[i]])
    }
    out = {}
    for sid in sorted(padded):
        storage = resolved.storages[sid]
        # names may repeat on disjoint ranks: only the storage this rank holds under that name
        if storage.name not in held or layout.storage(storage.name, rank) is not storage:
            continue
        shape = layout.parts_shape(storage.name, rank) or held[storage.name]
        regions = [tuple((0, n) for n in shape)]
        for part in storage.parts:
            for box in layout.boxes(part, rank):
                cut = tuple((s.start, s.stop) for s in box.storage_slices())
                regions = [rest for region in regions for rest in _subtract(region, cut)]
        regions = [r for r in regions if all(stop > start for start, stop in r)]
        if regions:
            out[storage.name] = [tuple(slice(start, stop) for start, stop in r) for r in regions]
    return out


_Extent = tuple[tuple[int, int], ...]  # one (start, stop) per dim


def _subtract(region: _Extent, cut: _Extent) -> list[_Extent]:
    """``region`` less ``cut`` (both one ``(start, stop)`` per dim), as disjoint boxes: per dim,
    the slabs before and after the cut, within the cut's extent along the dims before."""
    if any(stop <= c_start or c_stop <= start for (start, stop), (c_start, c_stop) in zip(region, cut)):
        return [region]
    out = []
    current = list(region)
    for d, ((start, stop), (c_start, c_stop)) in enumerate(zip(region, cut)):
        if start < c_start:
            out.append((*current[:d], (start, c_start), *current[d + 1 :]))
        if c_stop < stop:
            out.append((*current[:d], (c_stop, stop), *current[d + 1 :]))
        current[d] = (max(start, c_start), min(stop, c_stop))
    return out


def _as_parts(given: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, torch.Tensor]:
    """Storages viewed in the shape their parts make (the same memory: destinations are
    contiguous; a source that is not is read through a copy)."""
    if not shapes:
        return given
    return {name: t.reshape(shapes[name]) if name in shapes else t for name, t in given.items()}


def _oriented(region: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A transposed part's region turned back to the logical tensor's order (a view)."""
    return region.transpose(-1, -2) if piece.transposed else region


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ExecutionError(f"storages live on several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")
