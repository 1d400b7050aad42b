"""Jobs of tests/test_fp8_refit.py: refits into quantized destinations, one worker per rank.

Each job compiles the program's reshard (the same plan on every rank), fills the bf16 sources
with the synthetic weights, allocates the destination storages as an FP8 engine holds them
(fp8 values where the layout quantizes, the scale storages beside them) and runs the
Executor over gloo. It returns every destination storage's bytes and the run's report, for
the test to compare with its own reference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.errors import LayoutError, RuntimeFailure
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import fill_synthetic
from layoutlang.plan import compile_plan
from layoutlang.runtime.executor import Executor
from layoutlang.transport import TorchTransport


def destination_storages(layout, rank):
    """The storages an FP8 engine holds on ``rank``: fp8 where its parts are quantized (filled
    with a byte no quantizer writes everywhere, 0x7F: NaN in e4m3), and the scale storages."""
    quantized = layout.quantized()
    out = {}
    for name, shape in layout.storages_on(rank).items():
        part = layout.storage(name, rank).parts[0]
        q = quantized.get(part)
        dtype = torch_dtype(q.values) if q is not None else torch_dtype(layout.tensors[part].dtype)
        out[name] = torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else (
            torch.full(shape, float("nan"), dtype=dtype)
        )
    scale_dtypes = {
        box.storage: torch_dtype(q.scale.dtype) for t, q in quantized.items() for box in layout.scale_boxes(t, rank)
    }
    for name, shape in layout.scale_storages_on(rank).items():
        dtype = scale_dtypes[name]
        out[name] = (
            torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)
            if dtype.itemsize == 1
            else torch.full(shape, float("nan"), dtype=dtype)
        )
    return out


def refit_fp8(text, participants, mode=None, bucket_bytes=None, timeout=30.0, mutate=None):
    index = dist.get_rank()
    if index >= len(participants):
        return None
    rank = participants[index]
    program = layoutlang.loads(text)
    kwargs = {"bucket_bytes": bucket_bytes} if bucket_bytes else {}
    try:
        plan = compile_plan(program, mode=mode, rank=rank if mode == "pairwise" else None, **kwargs)
    except LayoutError as err:
        return {"rank": rank, "error": type(err).__name__ + ": " + err.message}
    transport = TorchTransport(rank, {p: i for i, p in enumerate(participants)})
    executor = Executor(plan, rank, transport, timeout=timeout)
    sources = {
        name: torch.empty(shape, dtype=torch_dtype(plan.source.tensors[plan.source.storage(name, rank).parts[0]].dtype))
        for name, shape in (plan.source.storages_on(rank).items() if rank in plan.source.mesh else ())
    }
    fill_synthetic(plan.source, rank, sources)
    destinations = destination_storages(plan.destination, rank) if rank in plan.destination.mesh else {}
    if mutate is not None and mutate[0] in destinations:  # a bad storage: (name, "bf16" or "drop")
        name, how = mutate
        if how == "drop":
            del destinations[name]
        else:
            destinations[name] = torch.zeros(destinations[name].shape, dtype=torch.bfloat16)
    try:
        report = executor.run(sources, destinations)
    except RuntimeFailure as err:
        return {"rank": rank, "error": type(err).__name__ + ": " + err.message}
    return {
        "rank": rank,
        "error": None,
        "storages": {name: (str(t.dtype), t.view(torch.uint8).clone()) for name, t in destinations.items()},
        "sent": report.sent,
        "received": report.received,
        "received_in_place": report.received_in_place,
    }
