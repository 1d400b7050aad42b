"""The executor's staging on a real GPU (one device is enough). Skipped without CUDA.

What the CPU tests cannot check: a CPU staging arena that an NCCL transport copies to the
device is pinned memory, and such an arena's views travel through the transport intact;
repeated runs on CUDA tensors reuse the executor's state and stay bit exact.
Run with ``pytest -m gpu tests/gpu`` (``tests/gpu/run_gpu_checks.sh`` runs the folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from layoutlang.io.weights import fill_synthetic, verify
from layoutlang.runtime import Resharder
from layoutlang.runtime.executor import _Arena
from layoutlang.transport.nccl import Communicator, NcclTransport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def comm():
    torch.cuda.set_device(0)
    c = Communicator.create(dist.HashStore(), 0, 1, key="gpu/staging", timeout=60.0)
    yield c
    c.destroy()


def test_a_pinned_cpu_arena_travels_through_the_nccl_transport(comm):
    arena = _Arena()
    arena.reserve(1 << 20, torch.device("cpu"), pin=True)
    assert arena.buffer is not None and arena.buffer.is_pinned()
    out = arena.buffer[4096 : 4096 + 8192]  # a view inside the arena, as a step stages it
    out.copy_(torch.arange(8192) % 251)
    back = torch.zeros(8192, dtype=torch.uint8)
    NcclTransport(0, comm).exchange([(0, out)], [(0, back)], tag=0).wait(60.0)
    assert torch.equal(out, back)
    arena.reserve(1 << 10, torch.device("cpu"), pin=True)  # smaller: the same buffer is kept
    assert arena.buffer.numel() == 1 << 20


def test_repeated_runs_on_cuda_tensors_are_bit_exact(comm):
    import layoutlang

    program = layoutlang.load(HERE / "one_rank.layout")
    resharder = Resharder(program, rank=0, transport=NcclTransport(0, comm), timeout=60)
    sources = resharder.allocate("source", device="cuda")
    destinations = resharder.allocate("destination", device="cuda")
    for version in range(3):
        fill_synthetic(resharder.plan.source, 0, sources, version=version)
        for t in destinations.values():
            t.fill_(-3)
        resharder.run(sources, destinations)
        check = verify(resharder.plan.destination, 0, destinations, version=version)
        assert check.ok, (version, check.mismatches)
