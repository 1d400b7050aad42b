"""``layoutlang doctor``: what this machine offers the NCCL transport.

Reports the NCCL library found (where, how, its version, and whether it offers the
functions failure recovery needs: ``ncclCommShrink`` 2.27, ``ncclCommRevoke`` 2.28,
``ncclCommGrow`` and ``ncclCommGetUniqueId`` 2.29), the CUDA runtime and driver, and
torch's view (version, CUDA build, ``torch.cuda.is_available()``, devices, torch's own
NCCL). Loading libraries is all it does: no device memory is allocated and no
communicator is created.

The command line wires it as a subcommand with :func:`add_arguments` and :func:`run`;
``python -m layoutlang.doctor`` runs it alone. Exit status: 0; with ``--strict``, 1 when
NCCL, one of those functions, or a CUDA device is missing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from typing import Any

from .. import __version__
from ..errors import CudaError, ExitCode
from .json_output import emit, error_json

__all__ = ["add_arguments", "facts", "main", "missing_for_run", "render", "run"]


HELP = "report the NCCL, CUDA and torch this machine offers"
DESCRIPTION = (
    "Find NCCL as the nccl transport would (environment override, the library already in "
    "the process, an nvidia-nccl wheel, the system), report its version and whether it offers "
    "ncclCommShrink, ncclCommRevoke and ncclCommGrow, and the CUDA runtime and torch facts."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the doctor's options to a (sub)parser."""
    parser.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit 1 unless NCCL with shrink, revoke and grow and at least one CUDA device are present",
    )
    parser.add_argument(
        "--nccl-library",
        metavar="PATH",
        help="check this libnccl file instead of searching (as LAYOUTLANG_NCCL_LIBRARY)",
    )


def _cuda_facts() -> dict[str, Any]:
    # The NCCL transport imports torch: here, so that the other commands start without it.
    from ..transport.nccl import cudart_candidates, load_cuda_runtime

    candidates = cudart_candidates()
    try:
        rt = load_cuda_runtime()
    except CudaError as err:
        return {"found": False, "error": err.message}
    runtime = rt.runtime_version
    driver = rt.driver_version
    return {
        "found": True,
        "path": rt.path,
        "origin": dict(candidates).get(rt.origin, rt.origin),
        "runtime": f"{runtime // 1000}.{(runtime % 1000) // 10}",
        "driver": f"{driver // 1000}.{(driver % 1000) // 10}" if driver else None,
        "devices": rt.device_count,
    }


def _torch_facts() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"version": torch.__version__, "cuda_build": torch.version.cuda}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        available = torch.cuda.is_available()
        out["cuda_available"] = available
        count = torch.cuda.device_count() if available else 0
        out["device_count"] = count
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(count)]
        nccl = None
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_nccl_available():
                version = torch.cuda.nccl.version()
                nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:
            nccl = None
        out["nccl"] = nccl
    return out


def facts(nccl_library: str | None = None) -> dict[str, Any]:
    """Everything the doctor reports, as plain data."""
    # The NCCL transport imports torch: here, so that the other commands start without it.
    from ..transport.nccl import LIBRARY_ENV, library_facts

    return {
        "layoutlang": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nccl": library_facts(nccl_library),
        "nccl_env": os.environ.get(LIBRARY_ENV),
        "cuda": _cuda_facts(),
        "torch": _torch_facts(),
    }


def _nccl_problems(nccl: Mapping[str, Any], *, recovery: bool = True) -> list[str]:
    """What the NCCL library found lacks; with ``recovery``, also the functions failure recovery needs."""
    if not nccl["found"]:
        return ["no NCCL library"]
    missing = [name for name, v in nccl["features"].items() if not v["available"]]
    return ["NCCL lacks " + ", ".join(missing)] if recovery and missing else []


def _device_problems(torch_facts: dict[str, Any]) -> list[str]:
    return [] if torch_facts["device_count"] else ["no CUDA device"]


def _problems(f: dict[str, Any]) -> list[str]:
    return _nccl_problems(f["nccl"]) + _device_problems(f["torch"])


def missing_for_run(device: str, transport: str, nccl_library: str | None = None) -> list[str]:
    """What this machine lacks for a run with storages on ``device`` (``cpu`` or ``cuda``) over
    ``transport`` (``torch`` or ``nccl``, the native core), in the words of the doctor's report:
    the same detection, asked only what that run needs (a plain run needs no recovery
    functions of NCCL). Empty when nothing is missing."""
    problems = []
    if transport == "nccl":
        # The NCCL transport imports torch: here, so that the other commands start without it.
        from ..transport.nccl import library_facts

        problems += _nccl_problems(library_facts(nccl_library), recovery=False)
    if device == "cuda" or transport == "nccl":
        problems += _device_problems(_torch_facts())
    return problems


def render(f: dict[str, Any]) -> str:
    """The report as text."""
    # The NCCL transport imports torch: here, so that the other commands start without it.
    from ..transport.nccl import LIBRARY_ENV

    lines = [f"layoutlang {f['layoutlang']} (Python {f['python']}, {f['platform']})", ""]
    nccl = f["nccl"]
    lines.append("NCCL")
    lines.append(f"  search order   {' -> '.join(nccl['searched'])}")
    if f["nccl_env"]:
        lines.append(f"  {LIBRARY_ENV} = {f['nccl_env']}")
    if nccl["found"]:
        lines.append(f"  library        {nccl['path']}")
        lines.append(f"  found in       {nccl['origin']}")
        lines.append(f"  version        {nccl['version']}")
        for name, v in nccl["features"].items():
            mark = "yes" if v["available"] else "NO "
            lines.append(f"  {name:<22} {mark}  (NCCL {v['introduced']}+)")
        missing = [name for name, v in nccl["features"].items() if not v["available"]]
        lines.append(
            "  shrink, revoke and grow: " + ("available" if not missing else "unavailable (" + ", ".join(missing) + ")")
        )
    else:
        lines.append("  not found: " + nccl["error"].replace("\n", "\n  "))
    lines.append("")
    cuda = f["cuda"]
    lines.append("CUDA runtime (loaded by layoutlang)")
    if cuda["found"]:
        lines.append(f"  library        {cuda['path']}")
        lines.append(f"  found in       {cuda['origin']}")
        lines.append(f"  runtime        {cuda['runtime']}")
        lines.append(f"  driver         {cuda['driver'] or 'none'}")
        lines.append(f"  devices        {cuda['devices']}")
    else:
        lines.append("  not found: " + cuda["error"].replace("\n", "\n  "))
    lines.append("")
    t = f["torch"]
    lines.append("torch")
    lines.append(f"  version              {t['version']}")
    lines.append(f"  built with CUDA      {t['cuda_build'] or 'no'}")
    lines.append(f"  cuda.is_available()  {t['cuda_available']}")
    lines.append(f"  devices              {t['device_count']}")
    for i, name in enumerate(t["devices"]):
        lines.append(f"    cuda:{i}  {name}")
    lines.append(f"  NCCL (torch's)       {t['nccl'] or 'none'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the doctor with parsed arguments; returns the exit status."""
    f = facts(getattr(args, "nccl_library", None))
    problems = _problems(f)
    failed = bool(getattr(args, "strict", False) and problems)
    status = ExitCode.FAILURE if failed else ExitCode.OK
    if getattr(args, "json", False):
        errors = [error_json("missing", problem) for problem in problems] if failed else []
        return emit("doctor", {**f, "problems": problems}, status, errors)
    print(render(f))
    if problems:
        print("\nmissing for the NCCL transport: " + "; ".join(problems))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="layoutlang doctor", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
