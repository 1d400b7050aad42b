"""The typed boundary between Python and the C++ core (``layoutlang.core._core``).

- the extension ships a stub generated at build time, beside it, naming everything it exports;
- move kinds, spaces and policies are enums whose names are the public spellings of moves,
  reports and plan JSON, in column order;
- ``PlanArrays`` takes its seventeen columns and totals by name only;
- the core raises one exception type per core, with typed fields: ``CoreError`` (kind,
  tensor index, rank, detail), which the model and planner turn into the LayoutValueError
  a user reads, naming the tensor; ``nccl.NcclCoreError`` (kind, call, code, symbol,
  introduced), which becomes the NcclError family or CudaError with the core's message;
- the extension imports no Python package, not even when it raises.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import layoutlang
from layoutlang.core import _core
from layoutlang.errors import (
    CudaError,
    LayoutValueError,
    NcclError,
    NcclTimeoutError,
    NcclUnavailableError,
    core_errors,
    from_nccl_core,
)
from layoutlang.plan import KINDS, POLICIES, SPACES
from layoutlang.plan.data import _COLUMNS

pytestmark = pytest.mark.timeout(60)

N = _core.nccl

# Ranks 0 and 2 hold rows 0:4 of the training copy, ranks 5 and 7 columns 3:6 of the
# serving one: with all four lost, w[0:4, 3:6] survives nowhere.
RECOVERY = """
mesh train [dp = 2, tp = 2]
mesh infer [dp = 2, tp = 2] on ranks 4..7
mesh regrown [dp = 2, tp = 2] on ranks [4, 8, 6, 9]
tensor "w" [8, 6] fp32
layout fsdp on train {
    "w": tp = shard(0)
}
layout serve on infer {
    "w": tp = shard(1)
}
layout regrown on regrown {
    "w": tp = shard(1)
}
"""


def _public(module) -> set[str]:
    return {name for name in vars(module) if not name.startswith("_")}


@pytest.mark.parametrize("stub, module", [("__init__.pyi", _core), ("nccl.pyi", N)], ids=["_core", "nccl"])
def test_the_extension_ships_a_stub_naming_everything_it_exports(stub, module):
    text = (Path(_core.__file__).parent / "_core" / stub).read_text()
    for name in _public(module) - {"nccl"}:
        assert f"class {name}" in text or f"def {name}(" in text or f"{name}: " in text, name


def test_move_kinds_spaces_and_policies_are_enums_spelled_as_plans_print_them():
    assert KINDS == ("local", "domain", "network")
    assert SPACES == ("source", "destination", "scratch")
    assert POLICIES == ("reshard", "broadcast")
    for names, enum in ((KINDS, _core.MoveKind), (SPACES, _core.Space), (POLICIES, _core.Policy)):
        assert [enum(i).name for i in range(len(names))] == list(names)


def test_plan_arrays_take_their_columns_by_name_only():
    plan = layoutlang.compile_plan(layoutlang.load(Path(__file__).parents[1] / "examples" / "tp_to_dp.layout"))
    columns = {name: np.asarray(getattr(plan.arrays, name)) for name, _ in _COLUMNS}
    totals = {
        "num_buckets": plan.num_buckets,
        "lower_bound_bytes": plan.arrays.lower_bound_bytes,
        "broadcast_payload_bytes": plan.arrays.broadcast_payload_bytes,
    }
    again = _core.PlanArrays(**columns, **totals)
    assert np.array_equal(again.move_kind, plan.arrays.move_kind) and again.num_buckets == plan.num_buckets
    with pytest.raises(TypeError):
        _core.PlanArrays(*columns.values(), *totals.values())


def test_a_core_error_carries_the_tensor_index_and_the_user_reads_the_tensor_name():
    program = layoutlang.loads(RECOVERY)
    serve, fsdp, new = (program.layout(n) for n in ("serve", "fsdp", "regrown"))
    lost = [0, 2, 5, 7]
    with pytest.raises(_core.CoreError) as raw:
        _core.build_recovery_plan([serve.core, fsdp.core], lost, new.core, 1, 1 << 20)
    err = raw.value
    assert isinstance(err, ValueError)
    assert (err.kind, err.tensor, err.rank) == ("lost", 0, None)
    assert str(err) == f"tensor 0: {err.detail}" and err.detail.startswith("the region [")
    with pytest.raises(LayoutValueError) as named, core_errors(serve.resolved.names, serve.span):
        _core.build_recovery_plan([serve.core, fsdp.core], lost, new.core, 1, 1 << 20)
    assert named.value.message == f"tensor 'w': {err.detail}"
    assert (named.value.tensor, named.value.rank) == ("w", None)


def test_a_core_error_without_a_tensor_keeps_the_cores_message():
    with pytest.raises(_core.CoreError) as raw:
        _core.dim_runs(8, (1, ((0, 3, 1),)), [0], [4])
    assert (raw.value.kind, raw.value.tensor) == ("placement", None)
    converted = LayoutValueError.from_core(raw.value, ["w"])
    assert converted.message == str(raw.value) == "dim 0: 3 chunks do not divide axis 0 of size 4"
    assert converted.tensor is None


@pytest.mark.parametrize(
    "kind, expected",
    [("nccl", NcclError), ("timeout", NcclTimeoutError), ("cuda", CudaError), ("unavailable", NcclUnavailableError)],
)
def test_nccl_core_errors_become_the_error_of_their_kind_with_the_cores_fields(kind, expected):
    nccl = N.NcclMock()
    cuda = N.CudaMock(nccl)
    comm = N.Communicator.init(nccl, cuda, 2, 0, N.unique_id(nccl))
    inbox = np.zeros(16, dtype=np.uint8)
    operation = {
        "nccl": lambda: (nccl.fail("ncclCommRevoke", 6), comm.revoke()),
        "timeout": lambda: (nccl.fail("ncclCommRevoke", 8), comm.revoke()),
        "cuda": lambda: (
            cuda.fail("cudaEventCreateWithFlags", 700),
            comm.exchange([], [(1, inbox.ctypes.data, 16)], 1),
        ),
        "unavailable": lambda: (nccl.remove_symbol("ncclCommGrow"), comm.grow(3, None)),
    }[kind]
    with pytest.raises(N.NcclCoreError) as raw:
        operation()
    err = raw.value
    assert err.kind == kind and isinstance(err, RuntimeError)
    converted = from_nccl_core(err)
    assert type(converted) is expected and converted.message == str(err)
    if kind == "unavailable":
        assert (err.symbol, err.introduced, err.code) == ("ncclCommGrow", "2.29", None)
        assert (converted.symbol, converted.introduced, converted.call) == ("ncclCommGrow", "2.29", "ncclCommGrow")
    else:
        assert (converted.call, converted.code) == (err.call, err.code) and err.code is not None


def test_the_extension_imports_no_python_package_even_when_it_raises():
    """Loaded alone (as a top-level module, outside the layoutlang package), the extension
    raises its own exception types and leaves sys.modules without layoutlang or torch."""
    code = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("_core", {_core.__file__!r})
        core = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(core)
        try:
            core.dim_runs(8, (1, ((0, 3, 1),)), [0], [4])
        except core.CoreError as err:
            assert err.kind == "placement"
        mock = core.nccl.NcclMock()
        mock.remove_symbol("ncclCommGrow")
        comm = core.nccl.Communicator.init(mock, core.nccl.CudaMock(mock), 1, 0, core.nccl.unique_id(mock))
        try:
            comm.grow(2, None)
        except core.nccl.NcclCoreError as err:
            assert err.kind == "unavailable"
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("layoutlang", "elastic", "torch"))
        print(loaded)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_mock_runtime_says_it_moves_host_memory():
    assert N.CudaMock().host_memory is True
