"""Resharder.allocate for a quantized destination: fp8 value storages where the layout
quantizes, the scale storages beside them, so that ``run`` without destinations refits into
FP8. The storages expected are those tests/fp8_refit_jobs.py builds for an FP8 engine; the
bytes are compared with the torch reference of tests/test_quantize.py (via
tests/test_fp8_refit.py's ``check``)."""

from __future__ import annotations

import fp8_allocate_jobs as jobs
import pytest
from fp8_refit_jobs import destination_storages
from test_fp8_refit import CASES, check, participants_of

import layoutlang

pytestmark = [pytest.mark.timeout(300), pytest.mark.workers(8)]


@pytest.mark.parametrize("name", ["tp_uneven", "stacked"])
def test_run_without_destinations_allocates_fp8_values_and_scales(pool, name):
    text = CASES[name]
    results = pool.run(jobs.refit_allocated, text, participants_of(text))
    program = layoutlang.loads(text)
    destination = program.layout(program.reshard().destination)
    by_rank = {r["rank"]: r for r in results if r}
    scales = 0
    for rank in destination.mesh.ranks:
        want = {n: (t.dtype, tuple(t.shape)) for n, t in destination_storages(destination, rank).items()}
        assert by_rank[rank]["allocated"] == want, rank
        assert any(dtype.itemsize == 1 and dtype.is_floating_point for dtype, _ in want.values())
        scales += len(destination.scale_storages_on(rank))
    assert scales > 0
    assert check(text, results) > 0
