"""The real NCCL from the nvidia-nccl-cu12 wheel, loaded with dlopen (no GPU needed).

Skipped when the wheel is not installed (the project's CI may not have it). Checks the
library's version against the wheel's, that the failure functions resolve, the search
order and its environment override, the doctor's report, the NCCL error path on a
machine without a CUDA driver, and that our declarations match the real nccl.h.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from layoutlang.cli import doctor
from layoutlang.core import _core
from layoutlang.errors import NcclError, NcclUnavailableError, core_errors
from layoutlang.transport.nccl import FEATURES, LIBRARY_ENV, library_facts, load_library

pytestmark = pytest.mark.timeout(120)

try:
    WHEEL_VERSION = importlib.metadata.version("nvidia-nccl-cu12")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "nvidia-nccl-cu12 is not installed, so the real NCCL library cannot be checked "
        "(pip install nvidia-nccl-cu12 to run these tests)",
        allow_module_level=True,
    )

N = _core.nccl
DIST = importlib.metadata.distribution("nvidia-nccl-cu12")
LIBRARY = next(
    (str(DIST.locate_file(f)) for f in DIST.files or () if f.name == "libnccl.so.2"),
    None,
)
HEADER = next((str(DIST.locate_file(f)) for f in DIST.files or () if f.name == "nccl.h"), None)


def version_code(text: str) -> int:
    major, minor, patch = (int(x) for x in text.split(".")[:3])
    return major * 10000 + minor * 100 + patch


def test_the_wheel_ships_the_library():
    assert LIBRARY and Path(LIBRARY).is_file()


def test_the_library_reports_the_wheels_version_and_offers_shrink_revoke_and_grow():
    lib = load_library(LIBRARY)
    assert lib.version == version_code(WHEEL_VERSION)
    assert N.version_string(lib.version) == WHEEL_VERSION
    assert WHEEL_VERSION.startswith("2.32")  # the version the project pins for these checks
    for symbol in FEATURES:
        assert lib.has(symbol), symbol
    assert not lib.has("ncclNoSuchFunction")
    assert lib.describe() == f"NCCL {WHEEL_VERSION} ({lib.path})"


def test_the_search_finds_the_wheel_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(LIBRARY_ENV, raising=False)
    facts = library_facts()
    assert facts["found"]
    assert facts["searched"][0].startswith("this process")
    if facts["origin"] != "this process (torch's NCCL)":  # a CUDA torch brings its own
        assert facts["origin"] == f"the nvidia-nccl-cu12 {WHEEL_VERSION} wheel"
        assert all(v["available"] for v in facts["features"].values())


def test_the_environment_variable_chooses_the_file(monkeypatch, tmp_path):
    monkeypatch.setenv(LIBRARY_ENV, LIBRARY)
    facts = library_facts()
    assert facts["searched"] == [f"${LIBRARY_ENV}"]
    assert Path(facts["path"]).resolve() == Path(LIBRARY).resolve()
    missing = tmp_path / "libnccl.so.2"
    monkeypatch.setenv(LIBRARY_ENV, str(missing))
    with pytest.raises(NcclUnavailableError, match="no NCCL library could be loaded") as caught:
        load_library()
    assert str(missing) in caught.value.message  # an explicit choice that fails is an error, no fallback


def test_unique_ids_come_from_the_real_library():
    lib = load_library(LIBRARY)
    first, second = N.unique_id(lib), N.unique_id(lib)
    assert len(first) == len(second) == N.UNIQUE_ID_BYTES and first != second


def test_without_a_cuda_driver_init_fails_with_an_error_naming_the_call():
    from layoutlang.errors import CudaError
    from layoutlang.transport.nccl import load_cuda_runtime

    try:
        cuda = load_cuda_runtime()
    except CudaError as err:
        pytest.skip(f"no CUDA runtime to pass to NCCL: {err.message}")
    if cuda.driver_version:
        pytest.skip("a CUDA driver is present: init would succeed (tests/gpu covers it)")
    lib = load_library(LIBRARY)
    with pytest.raises(NcclError) as caught, core_errors():
        N.Communicator.init(lib, cuda, 1, 0, N.unique_id(lib), timeout=30)
    assert caught.value.call == "ncclCommInitRankConfig"
    assert caught.value.code == 1  # ncclUnhandledCudaError
    assert "ncclUnhandledCudaError" in caught.value.message


def test_the_doctor_reports_the_library_and_its_failure_functions(monkeypatch, capsys):
    monkeypatch.setenv(LIBRARY_ENV, LIBRARY)
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)["result"]
    assert report["nccl"]["version"] == WHEEL_VERSION
    assert {name: v["available"] for name, v in report["nccl"]["features"].items()} == dict.fromkeys(FEATURES, True)
    assert doctor.main([]) == 0
    text = capsys.readouterr().out
    assert f"version        {WHEEL_VERSION}" in text
    assert "shrink, revoke and grow: available" in text


def _cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    try:
        import nvidia.cuda_runtime  # type: ignore[import-not-found]

        roots += list(nvidia.cuda_runtime.__path__)
    except ImportError:
        pass
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return str(Path(root) / "include")
    return None


PROBE = r"""
#include <nccl.h>
#include <cuda_runtime_api.h>
#include <cstddef>
#include "nccl_abi.hpp"
namespace L = layoutlang::nccl;
#define SAME(a, b) static_assert((long)(a) == (long)(b), #a)
SAME(offsetof(ncclConfig_t, blocking), offsetof(L::Config, blocking));
SAME(offsetof(ncclConfig_t, netName), offsetof(L::Config, netName));
SAME(offsetof(ncclConfig_t, splitShare), offsetof(L::Config, splitShare));
SAME(offsetof(ncclConfig_t, commName), offsetof(L::Config, commName));
SAME(offsetof(ncclConfig_t, shrinkShare), offsetof(L::Config, shrinkShare));
SAME(sizeof(ncclUniqueId), sizeof(L::UniqueId));
SAME(sizeof(ncclResult_t), sizeof(L::Result));
SAME(ncclUint8, L::kUint8);
SAME(ncclInProgress, L::kInProgress);
SAME(ncclRemoteError, L::kRemoteError);
SAME(NCCL_SHRINK_DEFAULT, L::kShrinkDefault);
SAME(NCCL_SHRINK_ABORT, L::kShrinkAbort);
SAME(NCCL_API_MAGIC, L::kApiMagic);
SAME(NCCL_VERSION(2, 32, 3), L::version_code(2, 32, 3));
SAME(sizeof(cudaMemcpy3DParms), sizeof(L::CudaMemcpy3DParms));
SAME(offsetof(cudaMemcpy3DParms, dstPtr), offsetof(L::CudaMemcpy3DParms, dstPtr));
SAME(offsetof(cudaMemcpy3DParms, kind), offsetof(L::CudaMemcpy3DParms, kind));
SAME(cudaMemcpyDefault, L::kCudaMemcpyDefault);
SAME(cudaErrorNotReady, L::kCudaErrorNotReady);
int main() { return 0; }
"""


def test_our_declarations_match_the_real_nccl_h(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    include = _cuda_include()
    if not (compiler and HEADER and include):
        pytest.skip("needs a C++ compiler, the wheel's nccl.h and cuda_runtime.h to compare declarations")
    source = tmp_path / "probe.cpp"
    source.write_text(PROBE)
    ours = Path(__file__).resolve().parents[1] / "csrc" / "nccl"
    result = subprocess.run(
        [compiler, "-std=c++17", "-fsyntax-only", "-Wno-enum-compare", f"-I{Path(HEADER).parent}", f"-I{include}",
         f"-I{ours}", str(source)],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
