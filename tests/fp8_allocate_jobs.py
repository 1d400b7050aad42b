"""Jobs of tests/test_resharder_allocate_fp8.py: a Resharder into a quantized destination that
allocates the destination storages itself (``run`` without destinations), one worker per rank.
Returns what it allocated (name, dtype, shape) and every destination storage's bytes."""

from __future__ import annotations

import torch
import torch.distributed as dist

import layoutlang
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import fill_synthetic
from layoutlang.runtime.resharder import Resharder


def refit_allocated(text, participants):
    index = dist.get_rank()
    if index >= len(participants):
        return None
    rank = participants[index]
    program = layoutlang.loads(text)
    resharder = Resharder(program, rank=rank, rank_map={p: i for i, p in enumerate(participants)}, timeout=30.0)
    source = resharder.plan.source
    sources = {
        name: torch.empty(shape, dtype=torch_dtype(source.tensors[source.storage(name, rank).parts[0]].dtype))
        for name, shape in (source.storages_on(rank).items() if rank in source.mesh else ())
    }
    fill_synthetic(source, rank, sources)
    allocated = {name: (t.dtype, tuple(t.shape)) for name, t in resharder.allocate("destination").items()}
    destinations = resharder.run(sources)
    return {
        "rank": rank,
        "error": None,
        "allocated": allocated,
        "storages": {name: (str(t.dtype), t.view(torch.uint8).clone()) for name, t in destinations.items()},
    }
