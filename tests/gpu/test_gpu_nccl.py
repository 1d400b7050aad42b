"""The NCCL core on a real GPU (one device is enough). Skipped without CUDA.

Run by ``tests/gpu/run_gpu_checks.sh`` (with the packing benchmark and the doctor), or
directly: ``pytest -m gpu tests/gpu``. What these check that the mock cannot: the real
CUDA runtime's pitched copies, NCCL's grouped self send/receive on the caller's stream,
the non-blocking communicator's polling, abort of an operation that never completes,
revoke, and the executor on CUDA tensors over the NCCL transport.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from layoutlang.cli import doctor
from layoutlang.errors import NcclError
from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder
from layoutlang.transport.nccl import Communicator, NcclTransport, copy_pairs, load_library

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

HERE = Path(__file__).resolve().parent
_KEYS = iter(range(10**6))


def new_communicator(timeout: float = 60.0) -> Communicator:
    store = dist.HashStore()
    return Communicator.create(store, 0, 1, key=f"gpu/{next(_KEYS)}", timeout=timeout)


@pytest.fixture(scope="module")
def comm():
    torch.cuda.set_device(0)
    c = new_communicator()
    yield c
    c.destroy()


def test_the_doctor_sees_the_device_and_a_usable_nccl():
    facts = doctor.facts()
    assert facts["torch"]["device_count"] >= 1
    assert facts["cuda"]["found"] and facts["cuda"]["driver"]
    assert facts["nccl"]["found"], facts["nccl"]


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_box_copies_on_the_device_match_torch(ndim, dtype):
    rng = np.random.default_rng(ndim)
    pairs, expected = [], []
    for _ in range(8):
        shape = tuple(int(x) for x in rng.integers(2, 40, size=ndim))
        start = tuple(int(rng.integers(0, s)) for s in shape)
        size = tuple(int(rng.integers(1, s - b + 1)) for s, b in zip(shape, start))
        source = torch.randn(shape, device="cuda").to(dtype)
        box = source[tuple(slice(b, b + n) for b, n in zip(start, size))]
        target = torch.zeros(tuple(n + 3 for n in size), device="cuda", dtype=dtype)
        window = target[tuple(slice(1, 1 + n) for n in size)]
        pairs.append((window, box))
        expected.append((target, box.clone()))
    calls, nbytes = copy_pairs(pairs)
    torch.cuda.synchronize()
    for (window, _), (target, copy) in zip(pairs, expected):
        assert torch.equal(window, copy)
        assert int((target != 0).sum()) <= window.numel()  # nothing outside the window
    assert nbytes == sum(b.numel() * b.element_size() for _, b in pairs)
    if ndim <= 3:
        assert calls <= len(pairs)


def test_a_self_exchange_moves_bytes_on_the_current_stream(comm):
    n = 8 << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream
    ticket = comm.exchange([(0, src.data_ptr(), n)], [(0, dst.data_ptr(), n)], stream)
    assert comm.wait(ticket, 60.0)
    assert torch.equal(src, dst)


@pytest.mark.parametrize("side_stream", [False, True])
def test_the_transport_stages_cpu_buffers_through_the_device(comm, side_stream):
    transport = NcclTransport(0, comm, side_stream=side_stream)
    out = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    back = torch.zeros_like(out)
    transport.exchange([(0, out)], [(0, back)], tag=0).wait(60.0)
    assert torch.equal(out, back)


def test_the_executor_runs_a_colocated_plan_on_cuda_tensors(comm):
    import layoutlang

    program = layoutlang.load(HERE / "one_rank.layout")
    resharder = Resharder(program, rank=0, transport=NcclTransport(0, comm), timeout=60)
    sources = resharder.allocate("source", device="cuda")
    fill_synthetic(resharder.plan.source, 0, sources)
    destinations = resharder.run(sources)
    assert all(t.is_cuda for t in destinations.values())
    check = verify(resharder.plan.destination, 0, destinations)
    assert check.ok, check.mismatches
    assert resharder.last_report.sent["local"] > 0


def test_revoke_then_destroy():
    c = new_communicator()
    src = torch.ones(1024, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    assert c.wait(c.exchange([(0, src.data_ptr(), 1024)], [(0, dst.data_ptr(), 1024)], 0), 60.0)
    c.revoke()
    assert c.state == "revoked"
    c.destroy()
    assert c.state == "destroyed"


def test_abort_ends_a_receive_that_never_completes():
    c = new_communicator()
    dst = torch.zeros(1024, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    try:
        ticket = c.exchange([], [(0, dst.data_ptr(), 1024)], stream.cuda_stream)  # no matching send
        finished = c.wait(ticket, 2.0)
    except NcclError:
        finished = None  # NCCL may refuse an unmatched self receive: also a clean outcome
    assert finished is not True
    started = time.monotonic()
    c.abort()
    assert time.monotonic() - started < 30
    assert c.state == "aborted"


def test_the_loaded_nccl_reports_its_failure_functions():
    lib = load_library()
    print(f"\n{lib.describe()}: " + ", ".join(f"{s}={'yes' if lib.has(s) else 'no'}" for s in
          ("ncclCommShrink", "ncclCommRevoke", "ncclCommGrow", "ncclCommGetUniqueId")))
    assert lib.version >= 21400  # ncclCommInitRankConfig and non-blocking communicators
