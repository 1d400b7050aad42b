"""The native NCCL transport: NCCL loaded at run time, communicators, and failure operations.

NCCL is never linked. The first use loads ``libnccl.so.2`` from, in order:

1. the file named by ``$LAYOUTLANG_NCCL_LIBRARY`` (when set, only that file: an explicit
   choice that fails is an error, not a silent fallback);
2. a libnccl already loaded in this process (torch's): a symbol in the global namespace
   (``dlsym(RTLD_DEFAULT)``), then any loaded ``libnccl.so*``;
3. the ``nvidia/nccl/lib`` folder of an installed ``nvidia-nccl-cu*`` wheel;
4. ``libnccl.so.2`` from the system's library path.

Functions are resolved on first call; a missing one raises :class:`NcclUnavailableError`
naming it and the NCCL version that introduced it (``ncclCommShrink`` 2.27,
``ncclCommRevoke`` 2.28, ``ncclCommGrow`` and ``ncclCommGetUniqueId`` 2.29). The CUDA
runtime (events, pitched copies) is found the same way (``$LAYOUTLANG_CUDART_LIBRARY``,
this process, the ``nvidia-cuda-runtime-cu*`` wheels, the system).

A :class:`Communicator` is created from a unique id that rank 0 publishes in a
``torch.distributed`` Store (raw bytes, never pickled). It is non-blocking, so a hung peer
can always be aborted. :class:`NcclTransport` runs the executor's exchanges over it: one
``ncclGroupStart``/``ncclGroupEnd`` of sends and receives per exchange, waited on with a
deadline; on a failure or a timeout the communicator is aborted (or revoked) and an
:class:`NcclError` (an :class:`~layoutlang.execute.ExecutionError`) names the peers.

NCCL point-to-point messages carry no tag: between two ranks they match in the order they
are posted. The executor posts its steps in plan order on every rank, so the order is
the same on both ends; the ``tag`` of :meth:`NcclTransport.exchange` is accepted and
ignored.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .execute import ExecutionError

__all__ = [
    "CUDART_ENV",
    "FEATURES",
    "LIBRARY_ENV",
    "Communicator",
    "CudaError",
    "NcclError",
    "NcclTimeoutError",
    "NcclTransport",
    "NcclUnavailableError",
    "copy_pairs",
    "cudart_candidates",
    "library_facts",
    "load_cuda_runtime",
    "load_library",
    "nccl_candidates",
]

log = logging.getLogger(__name__)

LIBRARY_ENV = "LAYOUTLANG_NCCL_LIBRARY"
CUDART_ENV = "LAYOUTLANG_CUDART_LIBRARY"

#: The functions failure recovery needs, and the NCCL version that introduced each.
FEATURES = {
    "ncclCommShrink": "2.27",
    "ncclCommRevoke": "2.28",
    "ncclCommGrow": "2.29",
    "ncclCommGetUniqueId": "2.29",
}


# ------------------------------------------------------------------------- errors


class NcclError(ExecutionError):
    """An NCCL call failed: ``call`` names it, ``code`` is its ``ncclResult_t``."""

    kind = "nccl"

    def __init__(self, message: str, call: str | None = None, code: int | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.call = call
        self.code = code

    @property
    def result(self) -> str | None:
        """The name of the result (``ncclRemoteError``)."""
        return None if self.code is None else _core_nccl().result_name(self.code)

    def to_json(self) -> dict[str, Any]:
        out = super().to_json()
        out.update(call=self.call, code=self.code)
        return out


class NcclTimeoutError(NcclError):
    """An NCCL operation did not complete before its deadline."""

    kind = "nccl-timeout"


class NcclUnavailableError(NcclError):
    """No NCCL library could be loaded, or it lacks a function (``symbol``, new in ``introduced``)."""

    kind = "nccl-unavailable"

    def __init__(self, message: str, symbol: str | None = None, introduced: str | None = None):
        super().__init__(message, call=symbol)
        self.symbol = symbol
        self.introduced = introduced or None


class CudaError(ExecutionError):
    """A CUDA runtime call failed (``code`` -1: the runtime could not be loaded)."""

    kind = "cuda"

    def __init__(self, message: str, call: str | None = None, code: int | None = None):
        super().__init__(message)
        self.call = call
        self.code = code


def _core_nccl():
    from . import _core

    return _core.nccl


# ------------------------------------------------------------------ finding libraries


def _nvidia_dirs() -> list[Path]:
    """The ``nvidia`` namespace package folders of every site-packages on the path."""
    found: list[Path] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) for p in spec.submodule_search_locations]
    for entry in sys.path:
        candidate = Path(entry or ".") / "nvidia"
        if candidate.is_dir() and candidate not in found:
            found.append(candidate)
    return found


def _wheel_files(package: str, pattern: str) -> list[str]:
    """Files matching ``pattern`` under ``nvidia/<package>/lib`` (and ``nvidia/cu*/lib``)."""
    out: list[str] = []
    for base in _nvidia_dirs():
        for folder in [base / package / "lib", *sorted(base.glob("cu[0-9]*/lib"))]:
            for path in sorted(folder.glob(pattern)):
                if str(path) not in out:
                    out.append(str(path))
    return out


def nccl_candidates() -> list[tuple[str, str]]:
    """Where NCCL is looked for, in order: (candidate, description). ``"process"`` means a
    libnccl already loaded in this process."""
    chosen = os.environ.get(LIBRARY_ENV)
    if chosen:
        return [(chosen, f"${LIBRARY_ENV}")]
    return [
        ("process", "this process (torch's NCCL)"),
        *[(path, "an nvidia-nccl wheel") for path in _wheel_files("nccl", "libnccl.so.2")],
        ("libnccl.so.2", "the system library path"),
    ]


def cudart_candidates() -> list[tuple[str, str]]:
    """Where the CUDA runtime is looked for, in order: (candidate, description)."""
    chosen = os.environ.get(CUDART_ENV)
    if chosen:
        return [(chosen, f"${CUDART_ENV}")]
    # torch's runtime first: streams and events of one process should come from one runtime.
    return [
        ("process", "this process (torch's CUDA runtime)"),
        *[(path, "an nvidia-cuda-runtime wheel") for path in _wheel_files("cuda_runtime", "libcudart.so.*")],
        ("libcudart.so.13", "the system library path"),
        ("libcudart.so.12", "the system library path"),
        ("libcudart.so", "the system library path"),
    ]


@functools.cache
def _load_nccl(candidates: tuple[str, ...]):
    return _core_nccl().NcclLibrary.load(list(candidates))


@functools.cache
def _load_cudart(candidates: tuple[str, ...]):
    return _core_nccl().CudaRuntime.load(list(candidates))


def load_library(path: str | None = None):
    """The NCCL library (``_core.nccl.NcclLibrary``): ``path`` if given, else the first of
    :func:`nccl_candidates`. Loaded once per candidate list. Raises NcclUnavailableError."""
    candidates = [path] if path else [c for c, _ in nccl_candidates()]
    return _load_nccl(tuple(candidates))


def load_cuda_runtime(path: str | None = None):
    """The CUDA runtime (``_core.nccl.CudaRuntime``), found like NCCL. Raises CudaError."""
    candidates = [path] if path else [c for c, _ in cudart_candidates()]
    return _load_cudart(tuple(candidates))


def _wheel_of(path: str) -> str | None:
    """``nvidia-nccl-cu12 2.32.3`` when an installed distribution owns ``path``."""
    from importlib import metadata

    target = Path(path).resolve()
    for dist in metadata.distributions():
        name = dist.metadata["Name"] or ""
        if not name.lower().startswith("nvidia-nccl"):
            continue
        for file in dist.files or ():
            if Path(dist.locate_file(file)).resolve() == target:
                return f"{name} {dist.version}"
    return None


def _origin(origin: str, path: str, candidates: list[tuple[str, str]]) -> str:
    described = dict(candidates).get(origin, origin)
    wheel = _wheel_of(path) if described != dict(candidates).get("process") else None
    return f"the {wheel} wheel" if wheel else described


def library_facts(path: str | None = None) -> dict[str, Any]:
    """What :func:`load_library` finds: path, where from, version, and the failure functions."""
    candidates = [(path, "the given path")] if path else nccl_candidates()
    try:
        lib = load_library(path)
    except NcclUnavailableError as err:
        return {"found": False, "error": err.message, "searched": [d for _, d in candidates]}
    code = lib.version
    return {
        "found": True,
        "path": lib.path,
        "origin": _origin(lib.origin, lib.path, candidates),
        "version": _core_nccl().version_string(code),
        "version_code": code,
        "features": {name: {"available": lib.has(name), "introduced": since} for name, since in FEATURES.items()},
        "searched": [d for _, d in candidates],
    }


# ----------------------------------------------------------------------- communicator


def _publish(store: Any, key: str, value: bytes, readers: Sequence[int], timeout: float) -> None:
    """Put ``value`` under ``key`` until every reader has taken it, then delete it.

    Deleting it makes a key safe to reuse: the next creation under the same key waits for
    a new value instead of reading this one. The publisher deletes before it creates its
    communicator, and creation completes on no rank before it starts on every rank, so no
    reader can reach a later creation while this value is still there.
    """
    store.set(key, value)
    acks = [f"{key}/read/{r}" for r in readers]
    if acks:
        store.wait(acks, timedelta(seconds=timeout))
    for k in [*acks, key]:
        store.delete_key(k)


def _receive(store: Any, key: str, rank: int, timeout: float) -> bytes:
    """The value another rank publishes under ``key`` (raw bytes, never unpickled)."""
    store.wait([key], timedelta(seconds=timeout))
    value = bytes(store.get(key))
    store.set(f"{key}/read/{rank}", b"1")
    return value


class Communicator:
    """An NCCL communicator (a thin Python face of ``_core.nccl.Communicator``).

    ``api`` and ``cuda`` default to the real libraries; tests pass ``NcclMock`` and
    ``CudaMock``. The failure operations keep NCCL's guarantees (see
    ``docs/reference/transports.rst``): :meth:`abort` ends the communicator at once;
    :meth:`revoke` stops in-flight operations and leaves it shrinkable; :meth:`shrink`
    excludes ranks (after a failure, default mode revokes first; ``mode="abort"`` lets
    NCCL terminate the parent's operations); :meth:`grow` adds ranks that :meth:`join`
    with the coordinator's single-use id. Shrink and grow release the parent.
    """

    def __init__(self, core: Any, api: Any, cuda: Any):
        self.core, self.api, self.cuda = core, api, cuda

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, state={self.state!r})"

    @classmethod
    def create(
        cls,
        store: Any,
        rank: int,
        size: int,
        *,
        key: str = "layoutlang/nccl/init",
        api: Any = None,
        cuda: Any = None,
        timeout: float = 300.0,
        blocking: bool = False,
    ) -> Communicator:
        """Every rank calls this; rank 0 creates the unique id and publishes it under ``key``
        until every rank has read it (so the key can be reused for the next communicator)."""
        api = api if api is not None else load_library()
        cuda = cuda if cuda is not None else load_cuda_runtime()
        nccl = _core_nccl()
        if rank == 0:
            unique_id = nccl.unique_id(api)
            _publish(store, key, unique_id, range(1, size), timeout)
        else:
            unique_id = _receive(store, key, rank, timeout)
        core = nccl.Communicator.init(api, cuda, size, rank, unique_id, blocking=blocking, timeout=timeout)
        return cls(core, api, cuda)

    @classmethod
    def join(
        cls,
        store: Any,
        rank: int,
        size: int,
        *,
        key: str,
        api: Any = None,
        cuda: Any = None,
        timeout: float = 300.0,
        blocking: bool = False,
    ) -> Communicator:
        """A new rank joins a grow, with the id the coordinator published under ``key``."""
        api = api if api is not None else load_library()
        cuda = cuda if cuda is not None else load_cuda_runtime()
        unique_id = _receive(store, key, rank, timeout)
        core = _core_nccl().Communicator.join(api, cuda, size, rank, unique_id, blocking=blocking, timeout=timeout)
        return cls(core, api, cuda)

    @property
    def rank(self) -> int:
        return self.core.rank

    @property
    def size(self) -> int:
        return self.core.size

    @property
    def state(self) -> str:
        """``ready``, ``failed``, ``revoked``, ``aborted`` or ``destroyed``."""
        return self.core.state

    def exchange(self, sends, recvs, stream: int) -> int:
        """One group of receives and sends, each ``(peer, pointer, bytes)``; returns a ticket."""
        return self.core.exchange(list(sends), list(recvs), stream)

    def wait(self, ticket: int, timeout: float) -> bool:
        return self.core.wait(ticket, timeout)

    def async_error(self) -> int:
        return self.core.async_error()

    def abort(self) -> None:
        self.core.abort()

    def revoke(self) -> None:
        self.core.revoke()

    def destroy(self) -> None:
        self.core.destroy()

    def shrink(self, exclude: Sequence[int], *, mode: str = "default", retire: bool = True) -> Communicator:
        """A communicator without the ranks in ``exclude`` (ranks of this communicator).

        ``mode="default"`` (NCCL_SHRINK_DEFAULT) needs a quiescent parent: after a failure
        the parent is revoked first. ``mode="abort"`` (NCCL_SHRINK_ABORT) lets NCCL end the
        parent's operations. With ``retire`` the parent is released afterwards.
        """
        if mode not in ("default", "abort"):
            raise ValueError(f"shrink mode must be 'default' or 'abort', not {mode!r}")
        try:
            child = self.core.shrink(list(exclude), mode == "abort")
        except NcclUnavailableError as err:
            if err.symbol == "ncclCommRevoke":
                err.hint = "this NCCL cannot revoke: shrink with mode='abort' instead"
            raise
        if retire:
            self._retire()
        return Communicator(child, self.api, self.cuda)

    def grow(self, store: Any, size: int, *, key: str, coordinator: bool) -> Communicator:
        """Grow to ``size`` ranks; every existing rank calls this. The coordinator asks NCCL
        for a single-use id (ncclCommGetUniqueId) and publishes it under ``key``; new ranks
        call :meth:`join` with the same key."""
        if coordinator:
            unique_id = self.core.grow_unique_id()
            _publish(store, key, unique_id, range(self.size, size), self.core.timeout)
            child = self.core.grow(size, unique_id)
        else:
            child = self.core.grow(size, None)
        self._retire()
        return Communicator(child, self.api, self.cuda)

    def _retire(self) -> None:
        """Release the parent of a shrink or grow. A revoked parent is destroyed (NCCL's
        path after revoke); any other is aborted: it is idle and shares nothing with its
        child, and abort is local, whereas finalize waits until the communicator is
        globally quiescent, i.e. for ranks a shrink excluded."""
        try:
            if self.core.state == "revoked":
                self.core.destroy()
            else:
                self.core.abort()
        except NcclError as err:
            log.warning("releasing the previous communicator: %s", err.message)
            self.core.abort()


# ------------------------------------------------------------------------- transport

_MOCK_STREAMS = itertools.count(1)

#: Seconds between calls of a transport's ``watch`` while a wait is pending.
WATCH_SLICE = 0.05


def _ranks_phrase(ranks: Sequence[int]) -> str:
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class _NcclPending:
    def __init__(self, transport: NcclTransport, ticket: int, labels: list[str], peers: list[int], keep: list, back: list):
        self.transport, self.ticket, self.labels, self.peers = transport, ticket, labels, peers
        self._keep, self._back = keep, back  # staging buffers live until the transfer is done

    def wait(self, timeout: float) -> None:
        t = self.transport
        if t.watch is None:
            done = self._wait_core(timeout)
        else:
            done = self._wait_watched(timeout, t.watch)
        if not done:
            action = t._fail()
            raise NcclTimeoutError(
                f"rank {t.rank}: the NCCL exchange with {_ranks_phrase(self.peers)} did not complete within "
                f"{timeout:g} s ({'; '.join(self.labels)}); a peer may have died or hung; the communicator "
                f"was {action}",
                call="ncclCommGetAsyncError",
                code=8,
            )
        for host, device in self._back:
            host.copy_(device)
        self._keep = self._back = []
        if t.first_completed_at is None:
            t.first_completed_at = time.time()

    def _wait_core(self, timeout: float) -> bool:
        """One wait on the core (False: not done within ``timeout``, with no side effect)."""
        t = self.transport
        try:
            return t.communicator.wait(self.ticket, timeout)
        except (NcclError, CudaError) as err:
            action = t._fail()
            raise NcclError(
                f"rank {t.rank}: the NCCL exchange with {_ranks_phrase(self.peers)} failed "
                f"({'; '.join(self.labels)}): {err.message}; the communicator was {action}",
                call=err.call,
                code=err.code if isinstance(err, NcclError) else None,
            ) from None

    def _wait_watched(self, timeout: float, watch: Callable[[], None]) -> bool:
        """Wait in slices of at most WATCH_SLICE seconds, calling ``watch()`` between them.

        A slice that ends unfinished leaves the exchange pending (the core's wait has no
        side effect on a timeout), so only the overall deadline gives up. When ``watch``
        raises (a member that is not a peer of this exchange has failed), the failure
        policy is applied, since the exchange can no longer be trusted to finish, and the
        watch's exception propagates unchanged.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if self._wait_core(min(WATCH_SLICE, max(remaining, 0.0))):
                return True
            if time.monotonic() >= deadline:
                return False
            try:
                watch()
            except BaseException:
                self.transport._fail()
                raise


class NcclTransport:
    """The executor's transport over NCCL (the interface of
    :class:`~layoutlang.execute.TorchTransport`).

    ``rank`` is this process's program rank; ``rank_map`` maps program ranks to ranks of
    the communicator (default: the same numbers). Each exchange is one group of receives
    and sends enqueued on the current CUDA stream (``side_stream=True``: on a stream of
    its own that first waits for the current one, so local copies run while the transfers
    fly). ``on_failure`` is what a failure or timeout does to the communicator:
    ``"abort"`` (nothing survives) or ``"revoke"`` (it can be shrunk afterwards).
    CPU tensors (the executor's agreement messages) are staged through the device.

    ``watch``, when given, is called between slices of at most :data:`WATCH_SLICE` seconds
    while a wait is pending: it raises to give up on the exchange (an elastic session's
    failure detector uses it to notice a failed member that is not a peer of the exchange,
    whose failure would otherwise only show as a timeout). The failure policy is then
    applied and the watch's exception propagates unchanged.
    """

    def __init__(
        self,
        rank: int,
        communicator: Communicator,
        rank_map: Mapping[int, int] | None = None,
        *,
        on_failure: str = "abort",
        device: Any = None,
        side_stream: bool = False,
        watch: Callable[[], None] | None = None,
    ):
        if on_failure not in ("abort", "revoke"):
            raise ValueError(f"on_failure must be 'abort' or 'revoke', not {on_failure!r}")
        self.rank = rank
        self.communicator = communicator
        self.on_failure = on_failure
        self.watch = watch
        self.first_completed_at: float | None = None  # time.time() of the first exchange waited to completion
        self._map = dict(rank_map) if rank_map is not None else None
        mock = type(communicator.cuda).__name__ == "CudaMock"
        if device is None:
            device = torch.device("cpu") if mock else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        # The mock fabric completes an event when the receives posted before it on its
        # stream arrive: every transport gets a stream number of its own.
        self._mock_stream = next(_MOCK_STREAMS) if self.device.type == "cpu" else None
        self._side = torch.cuda.Stream(self.device) if side_stream and self.device.type == "cuda" else None

    @classmethod
    def from_store(
        cls,
        rank: int,
        participants: Sequence[int],
        store: Any,
        *,
        key: str = "layoutlang/nccl/executor",
        timeout: float = 300.0,
        api: Any = None,
        cuda: Any = None,
        **kwargs: Any,
    ) -> NcclTransport:
        """Create the communicator of ``participants`` (program ranks, in order) through ``store``."""
        ordered = sorted(set(participants))
        if rank not in ordered:
            raise ExecutionError(f"rank {rank} is not one of the participants {ordered}")
        comm = Communicator.create(store, ordered.index(rank), len(ordered), key=key, api=api, cuda=cuda, timeout=timeout)
        return cls(rank, comm, {r: i for i, r in enumerate(ordered)}, **kwargs)

    def _peer(self, rank: int) -> int:
        if self._map is None:
            return rank
        if rank not in self._map:
            raise ExecutionError(f"rank {self.rank}: program rank {rank} has no rank in the NCCL communicator")
        return self._map[rank]

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return self._mock_stream
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            return self._side.cuda_stream
        return torch.cuda.current_stream(self.device).cuda_stream

    def _fail(self) -> str:
        """Apply the failure policy; returns what was done ("aborted" or "revoked")."""
        if self.on_failure == "revoke":
            try:
                self.communicator.revoke()
                return "revoked"
            except (NcclError, CudaError) as err:
                log.warning("rank %d: revoke failed (%s); aborting", self.rank, err.message)
        try:
            self.communicator.abort()
        except NcclError as err:
            log.warning("rank %d: abort failed: %s", self.rank, err.message)
        return "aborted"

    def _staged(self, buf: torch.Tensor, receive: bool, keep: list, back: list) -> torch.Tensor:
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise ExecutionError(f"rank {self.rank}: NCCL transport buffers are contiguous 1-D uint8 tensors")
        if buf.device.type == self.device.type:
            keep.append(buf)
            return buf
        if receive:
            device = torch.empty_like(buf, device=self.device)
            back.append((buf, device))
        else:
            device = buf.to(self.device)
        keep.append(device)
        return device

    def exchange(self, sends, recvs, tag):
        keep: list = []
        back: list = []
        labels: list[str] = []
        peers: list[int] = []
        posted_recvs, posted_sends = [], []
        for peer, buf in recvs:
            staged = self._staged(buf, True, keep, back)
            posted_recvs.append((self._peer(peer), staged.data_ptr(), staged.numel()))
            labels.append(f"receiving {buf.numel()} bytes from rank {peer}")
            peers.append(peer)
        for peer, buf in sends:
            staged = self._staged(buf, False, keep, back)
            posted_sends.append((self._peer(peer), staged.data_ptr(), staged.numel()))
            labels.append(f"sending {buf.numel()} bytes to rank {peer}")
            peers.append(peer)
        try:
            ticket = self.communicator.exchange(posted_sends, posted_recvs, self._stream())
        except (NcclError, CudaError) as err:
            action = self._fail() if self.communicator.state in ("ready", "failed") else self.communicator.state
            raise NcclError(
                f"rank {self.rank}: the NCCL exchange with {_ranks_phrase(peers)} could not start: {err.message}; "
                f"the communicator is {action}",
                call=err.call,
                code=err.code if isinstance(err, NcclError) else None,
            ) from None
        return _NcclPending(self, ticket, labels, peers, keep, back)


# ------------------------------------------------------------------------- box copies


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, cuda: Any = None, stream: int | None = None) -> tuple[int, int]:
    """``dst.copy_(src)`` for every ``(dst, src)`` pair (same shape and dtype, any strides)
    as pitched CUDA runtime copies: one call per box up to 3-D, adjacent contiguous boxes
    merged. Returns (runtime calls, bytes). ``cuda`` defaults to the CUDA runtime;
    ``CudaMock()`` copies host memory, for tests. ``stream`` defaults to the current one.
    """
    if not pairs:
        return (0, 0)
    width = max(max(dst.dim(), 1) for dst, _ in pairs)
    desc = np.zeros((len(pairs), 3 + 3 * width), dtype=np.int64)
    for i, (dst, src) in enumerate(pairs):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"copy {i}: the destination is {tuple(dst.shape)} {dst.dtype}, the source "
                f"{tuple(src.shape)} {src.dtype} (copies do not convert)"
            )
        pad = width - dst.dim()
        desc[i, 0] = dst.data_ptr()
        desc[i, 1] = src.data_ptr()
        desc[i, 2] = dst.element_size()
        desc[i, 3 : 3 + width] = [1] * pad + list(dst.shape)
        desc[i, 3 + width : 3 + 2 * width] = [0] * pad + list(dst.stride())
        desc[i, 3 + 2 * width :] = [0] * pad + list(src.stride())
    first = pairs[0][0]
    if cuda is None:
        cuda = load_cuda_runtime()
    if stream is None:
        stream = torch.cuda.current_stream(first.device).cuda_stream if first.is_cuda else 0
    return tuple(_core_nccl().copy_boxes(cuda, desc, stream))
