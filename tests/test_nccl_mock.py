"""The NCCL core over NcclMock and CudaMock: every NCCL call path, with errors at each step.

The mock records every call; tests compare the log with the sequence NCCL must see:
one group per exchange and the group always closed, revoke before a default-mode shrink
of a failed communicator, a grow id used once, every ``ncclResult_t`` turned into an
exception that names the call. The mock is also a fabric: communicators created from one
id in one process (one per thread) really move bytes, so the executor runs end to end on
CPU tensors over the NCCL transport.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import layoutlang
from layoutlang.core import _core
from layoutlang.errors import (
    CudaError,
    ExecutionError,
    NcclError,
    NcclTimeoutError,
    NcclUnavailableError,
    core_errors,
)
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder
from layoutlang.transport.nccl import FEATURES, Communicator, NcclTransport, copy_pairs

pytestmark = pytest.mark.timeout(60)

N = _core.nccl
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

SUCCESS, UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE, REMOTE, IN_PROGRESS, TIMEOUT = range(9)
ERROR_CODES = [UNHANDLED_CUDA, SYSTEM, INTERNAL, INVALID_ARGUMENT, INVALID_USAGE, REMOTE, TIMEOUT, 42]


# ----------------------------------------------------------------------- helpers


@pytest.fixture
def mock():
    nccl = N.NcclMock()
    return nccl, N.CudaMock(nccl)


def make(nccl, cuda, size=2, rank=0, **kwargs):
    return N.Communicator.init(nccl, cuda, size, rank, N.unique_id(nccl), **kwargs)


def names(nccl) -> list[str]:
    return [c.split("(")[0] for c in nccl.calls]


def buffer(n=16, fill=0):
    return torch.full((n,), fill, dtype=torch.uint8)


def ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def run_threads(functions, timeout=30.0):
    """Run each function in a thread; returns (results, exceptions)."""
    results = [None] * len(functions)
    errors: list[BaseException | None] = [None] * len(functions)

    def target(i):
        try:
            results[i] = functions[i]()
        except BaseException as err:
            errors[i] = err

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(len(functions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    return results, errors


def test_the_cpp_self_tests_pass():
    assert N.self_test() == []


# --------------------------------------------------------- every call, every error

# Each driver brings a communicator to the point where one NCCL call is made, then makes it.


def _exchange_driver(nccl, cuda):
    comm = make(nccl, cuda, 2, 0)
    a, b = buffer(), buffer()
    return lambda: comm.exchange([(1, ptr(a), 16)], [(1, ptr(b), 16)], 1)


def _wait_driver(nccl, cuda):
    comm = make(nccl, cuda, 2, 0)
    b = buffer()
    ticket = comm.exchange([], [(1, ptr(b), 16)], 1)
    return lambda: comm.wait(ticket, 5.0)


def _init_driver(nccl, cuda):
    uid = N.unique_id(nccl)
    return lambda: N.Communicator.init(nccl, cuda, 1, 0, uid)


def _destroy_driver(nccl, cuda):
    comm = make(nccl, cuda, 2, 0)
    return comm.destroy


def _shrink_driver(nccl, cuda):
    comm = make(nccl, cuda, 3, 0)
    return lambda: comm.shrink([2])


def _grow_driver(nccl, cuda):
    comm = make(nccl, cuda, 2, 1)
    return lambda: comm.grow(3, None)


DRIVERS = {
    "ncclGetUniqueId": lambda nccl, cuda: (lambda: N.unique_id(nccl)),
    "ncclCommInitRankConfig": _init_driver,
    "ncclGroupStart": _exchange_driver,
    "ncclRecv": _exchange_driver,
    "ncclSend": _exchange_driver,
    "ncclGroupEnd": _exchange_driver,
    "ncclCommGetAsyncError": _wait_driver,
    "ncclCommRevoke": lambda nccl, cuda: make(nccl, cuda, 2, 0).revoke,
    "ncclCommShrink": _shrink_driver,
    "ncclCommGetUniqueId": lambda nccl, cuda: make(nccl, cuda, 2, 0).grow_unique_id,
    "ncclCommGrow": _grow_driver,
    "ncclCommFinalize": _destroy_driver,
    "ncclCommDestroy": _destroy_driver,
    "ncclCommAbort": lambda nccl, cuda: make(nccl, cuda, 2, 0).abort,
}

# Calls NCCL may complete later (ncclInProgress, then the asynchronous error).
ASYNC_CALLS = [
    "ncclCommInitRankConfig",
    "ncclGroupEnd",
    "ncclCommRevoke",
    "ncclCommShrink",
    "ncclCommGrow",
    "ncclCommFinalize",
]


@pytest.mark.parametrize("code", ERROR_CODES, ids=lambda c: N.result_name(c).replace(" ", "_"))
@pytest.mark.parametrize("call", sorted(DRIVERS))
def test_every_error_of_every_call_names_the_call_and_the_result(mock, call, code):
    nccl, cuda = mock
    operation = DRIVERS[call](nccl, cuda)
    nccl.fail(call, code)
    expected = NcclTimeoutError if code == TIMEOUT else NcclError
    with pytest.raises(expected) as caught, core_errors():
        operation()
    err = caught.value
    assert isinstance(err, ExecutionError)  # one error family for users
    assert err.call == call and err.code == code
    assert call in err.message and N.result_name(code) in err.message
    assert nccl.group_depth() == 0  # never a group left open


@pytest.mark.parametrize("code", [INTERNAL, REMOTE, TIMEOUT])
@pytest.mark.parametrize("call", ASYNC_CALLS)
def test_asynchronous_errors_of_non_blocking_calls_name_the_call(mock, call, code):
    nccl, cuda = mock
    operation = DRIVERS[call](nccl, cuda)
    nccl.fail(call, code, async_=True)
    with pytest.raises(NcclError) as caught, core_errors():
        operation()
    assert caught.value.call == call and caught.value.code == code
    assert N.result_name(code) in caught.value.message


def test_result_names_and_meanings_cover_every_result():
    for code in range(9):
        assert N.result_name(code).startswith("nccl")
        assert N.result_meaning(code)
    assert N.result_name(42) == "ncclResult 42"
    assert "remote peer" in N.result_meaning(REMOTE)


@pytest.mark.parametrize("symbol", sorted(FEATURES))
def test_a_missing_function_names_itself_and_the_nccl_version_that_introduced_it(mock, symbol):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 0)
    nccl.remove_symbol(symbol)
    operation = {
        "ncclCommShrink": lambda: comm.shrink([2], True),
        "ncclCommRevoke": comm.revoke,
        "ncclCommGrow": lambda: comm.grow(4, None),
        "ncclCommGetUniqueId": comm.grow_unique_id,
    }[symbol]
    assert not nccl.has(symbol)
    with pytest.raises(NcclUnavailableError) as caught, core_errors():
        operation()
    err = caught.value
    assert err.symbol == symbol and err.introduced == FEATURES[symbol]
    assert f"NCCL {FEATURES[symbol]} or later" in err.message


# ----------------------------------------------------------------------- creation


def test_a_communicator_is_created_non_blocking_and_polled_to_completion():
    nccl = N.NcclMock(progress_polls=3)
    cuda = N.CudaMock(nccl)
    comm = make(nccl, cuda, 1, 0)
    assert nccl.calls == ["ncclGetUniqueId()", "ncclCommInitRankConfig(nranks=1, rank=0, blocking=0)"]
    assert nccl.polls == 3
    assert (comm.rank, comm.size, comm.state, comm.blocking) == (0, 1, "ready", False)


def test_a_blocking_communicator_is_not_polled(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 1, 0, blocking=True)
    assert nccl.calls[-1] == "ncclCommInitRankConfig(nranks=1, rank=0, blocking=1)"
    assert nccl.polls == 0 and comm.blocking
    del comm  # a communicator dropped without destroy is aborted, never leaked
    assert nccl.calls[-1] == "ncclCommAbort(rank=0)"


def test_init_that_never_completes_times_out_and_aborts():
    nccl = N.NcclMock(progress_polls=10**9)
    cuda = N.CudaMock(nccl)
    with pytest.raises(NcclTimeoutError, match=r"did not complete within 0\.05 s") as caught, core_errors():
        make(nccl, cuda, 2, 0, timeout=0.05)
    assert caught.value.call == "ncclCommInitRankConfig"
    assert names(nccl)[-1] == "ncclCommAbort"
    assert nccl.live_comms() == 0


def test_bad_arguments_are_refused_before_any_nccl_call(mock):
    nccl, cuda = mock
    with pytest.raises(NcclError, match="not called"), core_errors():
        N.Communicator.init(nccl, cuda, 2, 2, N.unique_id(nccl))
    with pytest.raises(ValueError, match="128 bytes"):
        N.Communicator.init(nccl, cuda, 2, 0, b"short")
    assert names(nccl) == ["ncclGetUniqueId"]


def test_create_exchanges_the_unique_id_through_a_store_as_bytes(mock):
    nccl, cuda = mock
    store = dist.HashStore()
    create = [lambda r=r: Communicator.create(store, r, 3, api=nccl, cuda=cuda, timeout=10) for r in range(3)]
    comms, errors = run_threads(create)
    assert errors == [None] * 3
    assert [c.rank for c in comms] == [0, 1, 2] and {c.size for c in comms} == {3}
    assert names(nccl).count("ncclGetUniqueId") == 1  # only rank 0 asks NCCL
    assert store.num_keys() == 0  # read by every rank, then deleted: the key can be reused
    again, errors = run_threads(create)
    assert errors == [None] * 3 and [c.size for c in again] == [3, 3, 3]
    assert names(nccl).count("ncclGetUniqueId") == 2


def test_the_unique_id_crosses_the_store_as_raw_bytes(mock):
    nccl, cuda = mock
    seen = []

    class Recording(dist.HashStore):
        def set(self, key, value):
            seen.append((key, value))
            super().set(key, value)

    store = Recording()
    run_threads(
        [lambda r=r: Communicator.create(store, r, 2, key="k", api=nccl, cuda=cuda, timeout=10) for r in range(2)]
    )
    key, value = seen[0]
    assert key == "k" and isinstance(value, bytes) and len(value) == N.UNIQUE_ID_BYTES  # no pickle


# ----------------------------------------------------------------------- exchange


def test_an_exchange_is_one_group_on_the_callers_stream(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 0)
    nccl.clear_calls()
    sends = [buffer(8, 1), buffer(4, 2)]
    recvs = [buffer(8), buffer(4)]
    ticket = comm.exchange(
        [(1, ptr(sends[0]), 8), (2, ptr(sends[1]), 4)], [(1, ptr(recvs[0]), 8), (2, ptr(recvs[1]), 4)], 7
    )
    assert ticket > 0
    assert nccl.calls == [
        "ncclGroupStart()",
        "ncclRecv(rank=0, peer=1, bytes=8)",
        "ncclRecv(rank=0, peer=2, bytes=4)",
        "ncclSend(rank=0, peer=1, bytes=8)",
        "ncclSend(rank=0, peer=2, bytes=4)",
        "ncclGroupEnd()",
    ]
    assert [c.split("(")[0] for c in cuda.calls] == ["cudaEventCreateWithFlags", "cudaEventRecord"]
    assert nccl.group_depth() == 0


def test_an_empty_exchange_calls_nothing(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    nccl.clear_calls()
    assert comm.exchange([], [], 1) == 0
    assert comm.wait(0, 1.0) is True
    assert nccl.calls == [] and cuda.calls == []


@pytest.mark.parametrize("call", ["ncclRecv", "ncclSend"])
@pytest.mark.parametrize("skip", [0, 1])
def test_the_group_is_closed_when_a_send_or_receive_fails(mock, call, skip):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 0)
    bufs = [buffer() for _ in range(4)]
    nccl.clear_calls()
    nccl.fail(call, INVALID_ARGUMENT, skip=skip)
    with pytest.raises(NcclError) as caught, core_errors():
        comm.exchange([(1, ptr(bufs[0]), 16), (2, ptr(bufs[1]), 16)], [(1, ptr(bufs[2]), 16), (2, ptr(bufs[3]), 16)], 1)
    assert caught.value.call == call and "(peer " in caught.value.message
    seq = names(nccl)
    assert seq[0] == "ncclGroupStart" and seq[-1] == "ncclGroupEnd"
    assert seq.count(call) == skip + 1  # nothing posted after the failure
    assert nccl.group_depth() == 0
    assert comm.state == "failed"
    nccl.clear_calls()
    with pytest.raises(NcclError, match="the communicator is failed"), core_errors():
        comm.exchange([(1, ptr(bufs[0]), 16)], [], 1)
    assert nccl.calls == []


def test_bad_peers_and_null_buffers_are_refused_before_the_group(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    nccl.clear_calls()
    with pytest.raises(NcclError, match="peer 5 is not a rank"), core_errors():
        comm.exchange([(5, ptr(buffer()), 16)], [], 1)
    with pytest.raises(NcclError, match="null buffer"), core_errors():
        comm.exchange([], [(1, 0, 16)], 1)
    assert nccl.calls == [] and comm.state == "ready"


def test_ranks_in_threads_exchange_bytes(mock):
    nccl, cuda = mock
    uid = N.unique_id(nccl)
    size = 3

    def rank(r):
        comm = N.Communicator.init(nccl, cuda, size, r, uid, timeout=10)
        sends = {p: torch.full((32,), 10 * r + p, dtype=torch.uint8) for p in range(size) if p != r}
        recvs = {p: buffer(32) for p in range(size) if p != r}
        ticket = comm.exchange(
            [(p, ptr(b), 32) for p, b in sends.items()], [(p, ptr(b), 32) for p, b in recvs.items()], 100 + r
        )
        assert comm.wait(ticket, 10.0)
        comm.destroy()
        return {p: int(b[0]) for p, b in recvs.items()}

    results, errors = run_threads([lambda r=r: rank(r) for r in range(size)])
    assert errors == [None] * size
    for r, got in enumerate(results):
        assert got == {p: 10 * p + r for p in range(size) if p != r}
    assert nccl.live_comms() == 0


def test_a_receive_whose_sender_never_posts_times_out(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    ticket = comm.exchange([], [(1, ptr(buffer()), 16)], 1)
    assert comm.wait(ticket, 0.05) is False
    assert comm.state == "ready"  # the caller decides: abort or revoke


def test_an_asynchronous_error_while_waiting_fails_the_communicator(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    ticket = comm.exchange([], [(1, ptr(buffer()), 16)], 1)
    nccl.fail_async(REMOTE, after_polls=3)
    with pytest.raises(NcclError, match="ncclRemoteError") as caught, core_errors():
        comm.wait(ticket, 5.0)
    assert caught.value.call == "ncclCommGetAsyncError" and caught.value.code == REMOTE
    assert comm.state == "failed"
    assert comm.async_error() == REMOTE


def test_mismatched_message_sizes_surface_as_an_error(mock):
    nccl, cuda = mock
    uid = N.unique_id(nccl)
    a = N.Communicator.init(nccl, cuda, 2, 0, uid)
    b = N.Communicator.init(nccl, cuda, 2, 1, uid)
    a.exchange([(1, ptr(buffer(8)), 8)], [], 1)
    with pytest.raises(NcclError, match="ncclInvalidUsage") as caught, core_errors():
        b.wait(b.exchange([], [(0, ptr(buffer(16)), 16)], 2), 5.0)
    assert "16 bytes" in caught.value.message and "8 bytes" in caught.value.message


@pytest.mark.parametrize("call", ["cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventQuery"])
def test_cuda_runtime_failures_name_the_call(mock, call):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    cuda.fail(call, 700)
    with pytest.raises(CudaError) as caught, core_errors():
        ticket = comm.exchange([], [(1, ptr(buffer()), 16)], 1)
        comm.wait(ticket, 5.0)
    assert caught.value.call == call and caught.value.code == 700
    assert call in caught.value.message
    if call == "cudaEventRecord":  # the event is not leaked
        assert [c.split("(")[0] for c in cuda.calls][-1] == "cudaEventDestroy"


# ----------------------------------------------------------------------- failure operations


def test_abort_is_immediate_and_idempotent(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    ticket = comm.exchange([], [(1, ptr(buffer()), 16)], 1)
    nccl.clear_calls()
    comm.abort()
    comm.abort()
    assert nccl.calls == ["ncclCommAbort(rank=0)"]
    assert comm.state == "aborted" and nccl.live_comms() == 0
    with pytest.raises(NcclError, match="abandoned"), core_errors():
        comm.wait(ticket, 1.0)
    with pytest.raises(NcclError, match="aborted"), core_errors():
        comm.exchange([(1, ptr(buffer()), 16)], [], 1)
    comm.destroy()  # nothing left to do
    assert nccl.calls == ["ncclCommAbort(rank=0)"]


def test_revoke_stops_in_flight_work_and_allows_destroy_without_finalize(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    ticket = comm.exchange([], [(1, ptr(buffer()), 16)], 1)
    assert nccl.pending_recvs() == 1
    nccl.clear_calls()
    comm.revoke()
    assert nccl.calls == ["ncclCommRevoke(rank=0, flags=0)"]
    assert comm.state == "revoked" and nccl.pending_recvs() == 0
    with pytest.raises(NcclError, match="revoked"), core_errors():
        comm.wait(ticket, 1.0)
    comm.revoke()  # idempotent
    comm.destroy()
    assert names(nccl) == ["ncclCommRevoke", "ncclCommDestroy"]  # finalize is invalid after revoke
    assert comm.state == "destroyed"


def test_destroy_finalizes_a_ready_communicator_and_aborts_a_failed_one(mock):
    nccl, cuda = mock
    ready = make(nccl, cuda, 2, 0)
    nccl.clear_calls()
    ready.destroy()
    assert names(nccl) == ["ncclCommFinalize", "ncclCommDestroy"]
    failed = make(nccl, cuda, 2, 0)
    nccl.fail_async(REMOTE)
    failed.async_error()
    assert failed.state == "failed"
    nccl.clear_calls()
    failed.destroy()
    assert names(nccl) == ["ncclCommAbort"]


def test_a_failing_finalize_aborts(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    nccl.fail("ncclCommFinalize", REMOTE, async_=True)
    nccl.clear_calls()
    with pytest.raises(NcclError, match="was aborted"), core_errors():
        comm.destroy()
    assert names(nccl) == ["ncclCommFinalize", "ncclCommAbort"] and comm.state == "aborted"


def test_a_healthy_shrink_uses_the_default_mode_without_revoke(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 4, 1)
    nccl.clear_calls()
    child = comm.shrink([3, 0])
    assert nccl.calls[0] == "ncclCommShrink(rank=1, exclude=[0, 3], flags=NCCL_SHRINK_DEFAULT)"
    assert "ncclCommRevoke" not in names(nccl)
    assert (child.rank, child.size, child.state) == (0, 2, "ready")
    assert comm.state == "ready"  # the parent stays until its owner retires it


def test_after_a_failure_a_default_shrink_revokes_first(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 0)
    nccl.fail_async(REMOTE)
    assert comm.async_error() == REMOTE
    nccl.clear_calls()
    child = comm.shrink([2])
    seq = names(nccl)
    assert seq.index("ncclCommRevoke") < seq.index("ncclCommShrink")
    assert comm.state == "revoked" and (child.rank, child.size) == (0, 2)


def test_after_a_failure_an_abort_mode_shrink_does_not_revoke(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 2)
    nccl.fail_async(REMOTE)
    comm.async_error()
    nccl.clear_calls()
    child = comm.shrink([0], True)
    assert nccl.calls[0] == "ncclCommShrink(rank=2, exclude=[0], flags=NCCL_SHRINK_ABORT)"
    assert "ncclCommRevoke" not in names(nccl)
    assert (child.rank, child.size) == (1, 2)


def test_shrink_refuses_what_nccl_would_refuse(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 1)
    nccl.clear_calls()
    with pytest.raises(NcclError, match="this rank"), core_errors():
        comm.shrink([1])
    with pytest.raises(NcclError, match="not a rank"), core_errors():
        comm.shrink([3])
    comm.abort()
    with pytest.raises(NcclError, match="cannot shrink"), core_errors():
        comm.shrink([2])
    assert "ncclCommShrink" not in names(nccl)


def test_shrink_falls_back_to_computed_ranks_when_nccl_cannot_say(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 5, 3)
    nccl.fail("ncclCommUserRank", INTERNAL)
    child = comm.shrink([0, 4])
    assert (child.rank, child.size) == (2, 3)


def test_a_failed_shrink_aborts_the_half_made_child(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 3, 0)
    nccl.fail("ncclCommShrink", REMOTE, async_=True)
    with pytest.raises(NcclError), core_errors():
        comm.shrink([2])
    assert names(nccl)[-1] == "ncclCommAbort"
    assert nccl.live_comms() == 1  # only the parent


def test_shrink_without_revoke_support_hints_at_abort_mode(mock):
    nccl, cuda = mock
    comm = Communicator(make(nccl, cuda, 3, 0), nccl, cuda)
    nccl.fail_async(REMOTE)
    comm.async_error()
    nccl.remove_symbol("ncclCommRevoke")
    with pytest.raises(NcclUnavailableError) as caught:
        comm.shrink([2])
    assert "mode='abort'" in caught.value.hint
    assert comm.shrink([2], mode="abort").size == 2


def test_a_grow_id_is_single_use(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 1, 0)
    uid = comm.grow_unique_id()
    assert len(uid) == N.UNIQUE_ID_BYTES
    before = len(nccl.calls)
    with pytest.raises(NcclError, match="still unconsumed"), core_errors():
        comm.grow_unique_id()
    with pytest.raises(NcclError, match="not the one this communicator issued"), core_errors():
        comm.grow(2, N.unique_id(nccl))
    before = len(nccl.calls)
    bigger = comm.grow(2, uid)
    assert (bigger.rank, bigger.size) == (0, 2)
    assert nccl.calls[before] == "ncclCommGrow(rank=0, nranks=2, id=set, newrank=-1)"
    before = len(nccl.calls)
    with pytest.raises(NcclError, match="already used"), core_errors():
        comm.grow(3, uid)
    assert len(nccl.calls) == before  # refused without calling NCCL
    joined = N.Communicator.join(nccl, cuda, 2, 1, uid)
    assert (joined.rank, joined.size) == (1, 2)
    # NCCL's own check: rank 1 already joined
    with pytest.raises(NcclError, match="ncclInvalidUsage"), core_errors():
        N.Communicator.join(nccl, cuda, 2, 1, uid)


def test_a_failed_grow_consumes_its_id(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 1, 0)
    uid = comm.grow_unique_id()
    nccl.fail("ncclCommGrow", REMOTE)
    with pytest.raises(NcclError), core_errors():
        comm.grow(2, uid)
    with pytest.raises(NcclError, match="already used"), core_errors():
        comm.grow(2, uid)


def test_grow_refuses_bad_sizes_and_join_refuses_bad_ranks(mock):
    nccl, cuda = mock
    comm = make(nccl, cuda, 2, 0)
    with pytest.raises(NcclError, match="does not add any"), core_errors():
        comm.grow(2, None)
    with pytest.raises(NcclError, match=r"not in 0\.\.2"), core_errors():
        N.Communicator.join(nccl, cuda, 3, 3, comm.grow_unique_id())


def test_grow_through_a_store_then_exchange_among_all_ranks(mock):
    nccl, cuda = mock
    store = dist.HashStore()
    old = run_threads(
        [lambda r=r: Communicator.create(store, r, 2, key="g0", api=nccl, cuda=cuda, timeout=10) for r in range(2)]
    )[0]

    def existing(r):
        return old[r].grow(store, 3, key="grow1", coordinator=r == 0)

    def new():
        return Communicator.join(store, 2, 3, key="grow1", api=nccl, cuda=cuda, timeout=10)

    comms, errors = run_threads([lambda: existing(0), lambda: existing(1), new])
    assert errors == [None] * 3
    assert [(c.rank, c.size) for c in comms] == [(0, 3), (1, 3), (2, 3)]
    assert [c.state for c in old] == ["aborted", "aborted"]  # the idle parents are released
    seq = names(nccl)
    assert seq.count("ncclCommGetUniqueId") == 1 and seq.count("ncclCommGrow") == 3

    def ring(c):
        out, into = torch.full((4,), c.rank + 1, dtype=torch.uint8), buffer(4)
        t = c.exchange([((c.rank + 1) % 3, ptr(out), 4)], [((c.rank - 1) % 3, ptr(into), 4)], 200 + c.rank)
        assert c.wait(t, 10.0)
        return int(into[0])

    got, errors = run_threads([lambda c=c: ring(c) for c in comms])
    assert errors == [None] * 3 and got == [3, 1, 2]


def test_survivors_of_a_hung_rank_revoke_shrink_and_go_on(mock):
    nccl, cuda = mock
    uid = N.unique_id(nccl)

    def survivor(r):
        comm = Communicator(N.Communicator.init(nccl, cuda, 3, r, uid, timeout=10), nccl, cuda)
        into = buffer(4)
        ticket = comm.exchange([], [(2, ptr(into), 4)], 300 + r)  # rank 2 never sends
        assert comm.wait(ticket, 0.05) is False
        comm.revoke()
        smaller = comm.shrink([2])
        out, back = torch.full((4,), 7 + r, dtype=torch.uint8), buffer(4)
        t = smaller.exchange([(1 - smaller.rank, ptr(out), 4)], [(1 - smaller.rank, ptr(back), 4)], 400 + r)
        assert smaller.wait(t, 10.0)
        return (smaller.rank, smaller.size, int(back[0]))

    hung = N.Communicator.init  # rank 2 joins and then does nothing
    results, errors = run_threads([lambda: survivor(0), lambda: survivor(1), lambda: hung(nccl, cuda, 3, 2, uid)])
    assert errors == [None] * 3
    assert results[:2] == [(0, 2, 8), (1, 2, 7)]


# ----------------------------------------------------------------------- transport


def _participants(program):
    statement = program.reshard()
    ranks = set(program.layout(statement.source).mesh.ranks) | set(program.layout(statement.destination).mesh.ranks)
    return sorted(ranks)


@pytest.mark.parametrize("name", ["tp_to_dp", "colocated", "refit"])
def test_the_executor_moves_exact_bytes_over_the_nccl_transport(mock, name):
    nccl, cuda = mock
    program = layoutlang.load(EXAMPLES / f"{name}.layout")
    participants = _participants(program)
    store = dist.HashStore()

    def rank(r):
        transport = NcclTransport.from_store(r, participants, store, api=nccl, cuda=cuda, timeout=20)
        resharder = Resharder(program, rank=r, transport=transport, timeout=20)
        sources = resharder.allocate("source")
        fill_synthetic(resharder.plan.source, r, sources)
        destinations = resharder.run(sources)
        report = resharder.last_report
        check = verify(resharder.plan.destination, r, destinations) if r in resharder.plan.destination.mesh else None
        transport.communicator.destroy()
        return check, report

    results, errors = run_threads([lambda r=r: rank(r) for r in participants], timeout=50)
    assert errors == [None] * len(participants), errors
    checks = [c for c, _ in results if c is not None]
    assert checks and all(c.ok for c in checks), [c.mismatches for c in checks if not c.ok]
    plan = layoutlang.compile_plan(program)
    moved = sum(rep.sent["domain"] + rep.sent["network"] for _, rep in results)
    assert moved == plan.stats.bytes["domain"] + plan.stats.bytes["network"]
    assert nccl.group_depth() == 0 and nccl.live_comms() == 0


def _pair(nccl, cuda, **kwargs):
    """Program ranks 4 and 5 on a 2-rank communicator; only rank 4's side is returned."""
    comm = Communicator(make(nccl, cuda, 2, 0), nccl, cuda)
    return NcclTransport(4, comm, {4: 0, 5: 1}, **kwargs)


def test_a_timeout_names_the_peers_and_aborts(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda)
    pending = transport.exchange([(5, buffer(8, 1))], [(5, buffer(8))], tag=3)
    with pytest.raises(NcclTimeoutError) as caught:
        pending.wait(0.05)
    message = caught.value.message
    assert message.startswith("rank 4: the NCCL exchange with rank 5 did not complete within 0.05 s")
    assert "receiving 8 bytes from rank 5" in message and "the communicator was aborted" in message
    assert transport.communicator.state == "aborted" and names(nccl)[-1] == "ncclCommAbort"
    with pytest.raises(NcclError, match="could not start"):
        transport.exchange([(5, buffer())], [], tag=4)


def test_the_revoke_policy_keeps_the_communicator_shrinkable(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda, on_failure="revoke")
    pending = transport.exchange([], [(5, buffer(8))], tag=0)
    with pytest.raises(NcclTimeoutError, match="was revoked"):
        pending.wait(0.05)
    assert transport.communicator.state == "revoked"


def test_an_asynchronous_error_names_the_peers(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda)
    pending = transport.exchange([], [(5, buffer(8))], tag=0)
    nccl.fail_async(REMOTE, after_polls=2)
    with pytest.raises(NcclError) as caught:
        pending.wait(5.0)
    assert isinstance(caught.value, ExecutionError) and not isinstance(caught.value, NcclTimeoutError)
    assert "rank 4: the NCCL exchange with rank 5 failed" in caught.value.message
    assert caught.value.code == REMOTE and transport.communicator.state == "aborted"


def test_a_cuda_failure_while_waiting_aborts_and_names_the_peers(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda)
    pending = transport.exchange([], [(5, buffer(8))], tag=0)
    cuda.fail("cudaEventQuery", 999)
    with pytest.raises(NcclError, match="rank 4: the NCCL exchange with rank 5 failed") as caught:
        pending.wait(5.0)
    assert caught.value.call == "cudaEventQuery" and transport.communicator.state == "aborted"


def test_a_failure_to_start_aborts_and_names_the_peers(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda)
    nccl.fail("ncclGroupEnd", SYSTEM)
    with pytest.raises(NcclError, match="rank 4: the NCCL exchange with rank 5 could not start") as caught:
        transport.exchange([(5, buffer())], [], tag=0)
    assert caught.value.call == "ncclGroupEnd"
    assert transport.communicator.state == "aborted"


def test_transport_buffers_must_be_contiguous_bytes(mock):
    nccl, cuda = mock
    transport = _pair(nccl, cuda)
    with pytest.raises(ExecutionError, match="uint8"):
        transport.exchange([(5, torch.zeros(4, dtype=torch.float32))], [], tag=0)
    with pytest.raises(ExecutionError, match="uint8"):
        transport.exchange([(5, buffer(8)[::2])], [], tag=0)
    with pytest.raises(ExecutionError, match="no rank in the NCCL communicator"):
        transport.exchange([(9, buffer(8))], [], tag=0)
    with pytest.raises(ValueError, match="on_failure"):
        NcclTransport(4, transport.communicator, on_failure="ignore")


# ----------------------------------------------------------------------- box copies


def _random_case(rng, ndim, dtype):
    shape = tuple(int(x) for x in rng.integers(1, 7, size=ndim))
    start = tuple(int(rng.integers(0, s)) for s in shape)
    size = tuple(int(rng.integers(1, s - b + 1)) for s, b in zip(shape, start))
    source = torch.arange(int(np.prod(shape)), dtype=torch.int64).to(dtype).reshape(shape)
    view = source[tuple(slice(b, b + n) for b, n in zip(start, size))]
    other = tuple(n + int(rng.integers(0, 3)) for n in size)
    target = torch.zeros(other, dtype=dtype)
    window = target[tuple(slice(0, n) for n in size)]
    return window, view, target


@pytest.mark.parametrize("ndim", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
def test_box_copies_match_torch(ndim, dtype):
    rng = np.random.default_rng(ndim * 100 + dtype.itemsize)
    for _ in range(20):
        pairs = [_random_case(rng, ndim, dtype) for _ in range(3)]
        calls, nbytes = copy_pairs([(w, v) for w, v, _ in pairs], cuda=N.CudaMock())
        for window, view, target in pairs:
            assert torch.equal(window, view)
            outside = target.clone()
            outside[tuple(slice(0, n) for n in window.shape)] = 0
            assert not outside.any()  # nothing written outside the box
        assert nbytes == sum(v.numel() * v.element_size() for _, v, _ in pairs)
        if ndim <= 3:
            assert calls <= len(pairs)  # one call per box up to 3-D


def test_boxes_cost_one_call_each_and_adjacent_ones_merge():
    storage = torch.arange(6 * 8 * 10, dtype=torch.float32).reshape(6, 8, 10)
    message = torch.empty(3 * 4 * 5 + 2 * 8 * 10, dtype=torch.float32)
    box3 = storage[1:4, 2:6, 3:8]
    rows = storage[4:6]  # contiguous
    pairs = [(message[:60].view(3, 4, 5), box3), (message[60:].view(2, 8, 10), rows)]
    cuda = N.CudaMock()
    assert copy_pairs(pairs, cuda=cuda) == (2, (60 + 160) * 4)
    assert [c.split("(")[0] for c in cuda.calls] == ["cudaMemcpy3DAsync", "cudaMemcpyAsync"]
    assert torch.equal(message[:60].view(3, 4, 5), box3)
    a, b = storage[0].reshape(-1), storage[1].reshape(-1)
    out = torch.empty(160)
    assert copy_pairs([(out[:80], a), (out[80:], b)], cuda=N.CudaMock()) == (1, 640)  # merged
    plan = [
        (c.dst, c.src, c.width, c.height, c.depth, c.dpitch, c.spitch, c.dheight, c.sheight)
        for c in N.plan_box_copies(np.array([[0, 0, 4, 4, 5, 5, 1, 10, 1]], dtype=np.int64))
    ]
    assert plan == [(0, 0, 20, 4, 1, 20, 40, 4, 4)]  # a 2-D box is one 2-D copy


def test_box_copy_errors():
    with pytest.raises(ValueError, match="copies do not convert"):
        copy_pairs([(torch.zeros(4), torch.zeros(4, dtype=torch.float64))], cuda=N.CudaMock())
    cuda = N.CudaMock()
    cuda.fail("cudaMemcpy3DAsync", 1)
    storage = torch.zeros(4, 4, 4)
    with pytest.raises(CudaError, match="cudaMemcpy3DAsync failed") as caught:
        copy_pairs([(torch.zeros(2, 2, 2), storage[:2, :2, :2])], cuda=cuda)
    assert caught.value.call == "cudaMemcpy3DAsync"
    assert copy_pairs([], cuda=N.CudaMock()) == (0, 0)


# ----------------------------------------------------------------------- doctor


def test_the_doctor_reports_a_missing_library_and_strict_mode_fails(capsys, tmp_path):
    from layoutlang.cli import doctor

    missing = str(tmp_path / "libnccl.so.2")
    assert doctor.main(["--nccl-library", missing]) == 0
    text = capsys.readouterr().out
    assert "not found: no NCCL library could be loaded" in text and missing in text
    assert "missing for the NCCL transport: no NCCL library" in text
    assert doctor.main(["--nccl-library", missing, "--strict"]) == 1
    capsys.readouterr()
    assert doctor.main(["--nccl-library", missing, "--json"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)["result"]
    assert report["nccl"]["found"] is False and "no NCCL library" in report["problems"][0]
    assert report["torch"]["version"] == torch.__version__
    assert report["torch"]["cuda_available"] == torch.cuda.is_available()


def test_the_doctor_plugs_into_a_command_line():
    import argparse

    from layoutlang.cli import doctor

    parser = argparse.ArgumentParser(prog="layoutlang")
    sub = parser.add_subparsers(dest="command")
    doctor.add_arguments(sub.add_parser("doctor"))
    args = parser.parse_args(["doctor", "--json", "--strict"])
    assert (args.json, args.strict, args.nccl_library) == (True, True, None)
