"""The executor: runs one plan on one rank over a transport."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from .._text import rank_ranges
from ..errors import ExecutionError
from ..io.torch_dtypes import torch_dtype
from ..plan import KINDS, Plan
from ..transport import Transport
from .agreement import AGREEMENT_TAG, agree
from .schedule import _DESTINATION, _SCRATCH, _SOURCE, Piece, Step, schedule


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
                else f"rank {rank} is lost in recovery plan '{plan.name}'; it takes no part"
            )
        self.plan = plan
        self.rank = rank
        # A recovery plan's lost ranks hold source storages nobody reads: they are not asked.
        ranks = set(plan.destination.mesh.ranks).union(*(layout.mesh.ranks for layout in plan.sources))
        self.participants = sorted(ranks - plan.lost)
        self.transport = transport
        self.timeout = timeout
        self.steps = schedule(plan, rank)
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
        device = device_of([t for given in per_source for t in given.values()] + list(destinations.values()))
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
                tag=(step.bucket * 4 + step.stage) % AGREEMENT_TAG,  # the same on both ends
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

    def _target(self, spaces, piece: Piece, device) -> torch.Tensor:
        """The tensor a piece is written into; scratch buffers (whole tensors) appear on first use."""
        space = spaces[piece.key]
        if piece.space == _SCRATCH and piece.storage not in space:
            space[piece.storage] = torch.empty(self._shapes[piece.tensor], dtype=piece.dtype, device=device)
        return space[piece.storage]

    def _kind(self, peer: int) -> str:
        same = self.plan.domain_size and peer // self.plan.domain_size == self.rank // self.plan.domain_size
        return "domain" if same else "network"

    def _pack(self, step: Step, spaces, device) -> dict[int, torch.Tensor]:
        out = {}
        for peer, message in step.sends.items():
            buf = torch.empty(message.nbytes, dtype=torch.uint8, device=device)
            for piece, offset in zip(message.pieces, message.offsets):
                buf[offset : offset + piece.nbytes].view(piece.dtype).view(_sizes(piece)).copy_(_view(spaces, piece))
            out[peer] = buf
        return out


def _sizes(piece: Piece) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in piece.index)


def _view(spaces, piece: Piece) -> torch.Tensor:
    return spaces[piece.key][piece.storage][piece.index]


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def device_of(tensors: Iterable[torch.Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ExecutionError(f"storages live on several devices: {sorted(map(str, devices))}")
    return devices.pop() if devices else torch.device("cpu")
