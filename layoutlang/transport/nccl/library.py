"""Finding and loading NCCL and the CUDA runtime at run time (never linked)."""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from pathlib import Path
from typing import TypedDict

from ...core import _core
from ...errors import NcclUnavailableError, core_errors

LIBRARY_ENV = "LAYOUTLANG_NCCL_LIBRARY"
CUDART_ENV = "LAYOUTLANG_CUDART_LIBRARY"

#: The functions failure recovery needs, and the NCCL version that introduced each.
FEATURES = {
    "ncclCommShrink": "2.27",
    "ncclCommRevoke": "2.28",
    "ncclCommGrow": "2.29",
    "ncclCommGetUniqueId": "2.29",
}



class FeatureFacts(TypedDict):
    """Whether the library offers a failure function, and the NCCL version that introduced it."""

    available: bool
    introduced: str


class _SearchFacts(TypedDict):
    found: bool
    searched: list[str]  # where NCCL was looked for, in order


class LibraryFacts(_SearchFacts, total=False):
    """What :func:`library_facts` reports (JSON-ready, as ``layoutlang doctor --json`` prints it):
    ``error`` when nothing was found, else the library's ``path``, where it came from
    (``origin``), its ``version`` and ``version_code``, and its failure ``features``."""

    error: str
    path: str
    origin: str
    version: str
    version_code: int
    features: dict[str, FeatureFacts]


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
def _load_nccl(candidates: tuple[str, ...]) -> _core.nccl.NcclLibrary:
    with core_errors():
        return _core.nccl.NcclLibrary.load(list(candidates))


@functools.cache
def _load_cudart(candidates: tuple[str, ...]) -> _core.nccl.CudaRuntime:
    with core_errors():
        return _core.nccl.CudaRuntime.load(list(candidates))


def load_library(path: str | None = None) -> _core.nccl.NcclLibrary:
    """The NCCL library (``_core.nccl.NcclLibrary``): ``path`` if given, else the first of
    :func:`nccl_candidates`. Loaded once per candidate list. Raises NcclUnavailableError."""
    candidates = [path] if path else [c for c, _ in nccl_candidates()]
    return _load_nccl(tuple(candidates))


def load_cuda_runtime(path: str | None = None) -> _core.nccl.CudaRuntime:
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
            if Path(str(dist.locate_file(file))).resolve() == target:
                return f"{name} {dist.version}"
    return None


def _origin(origin: str, path: str, candidates: list[tuple[str, str]]) -> str:
    described = dict(candidates).get(origin, origin)
    wheel = _wheel_of(path) if described != dict(candidates).get("process") else None
    return f"the {wheel} wheel" if wheel else described


def library_facts(path: str | None = None) -> LibraryFacts:
    """What :func:`load_library` finds: path, where from, version, and the failure functions."""
    candidates = [(path, "the given path")] if path else nccl_candidates()
    try:
        lib = load_library(path)
    except NcclUnavailableError as err:
        return {"found": False, "error": err.message, "searched": [d for _, d in candidates]}
    with core_errors():
        code = lib.version
    return {
        "found": True,
        "path": lib.path,
        "origin": _origin(lib.origin, lib.path, candidates),
        "version": _core.nccl.version_string(code),
        "version_code": code,
        "features": {name: {"available": lib.has(name), "introduced": since} for name, since in FEATURES.items()},
        "searched": [d for _, d in candidates],
    }
