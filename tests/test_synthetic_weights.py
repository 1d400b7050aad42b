"""Synthetic weights (layoutlang.io.weights) made in slabs: the values equal their formula
whatever the slab size, and filling a storage takes about the storage, not several times it
in int64 intermediates (measured as peak RSS growth in a fresh process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import layoutlang.io.weights as weights
from layoutlang.io.torch_dtypes import torch_dtype
from layoutlang.io.weights import synthetic_box

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]


def _formula(tensor_index, shape, dtype, offsets, sizes, version):
    """The synthetic values by their definition, element by element in numpy (int64)."""
    grids = np.meshgrid(*[np.arange(o, o + s) for o, s in zip(offsets, sizes)], indexing="ij")
    flat = np.ravel_multi_index(grids, shape) if shape else np.zeros((), dtype=np.int64)
    m = weights._modulus(dtype)
    values = (flat.astype(np.int64) * 40503 + (tensor_index + 1) * 12345 + version * 7919) % m
    if dtype not in ("uint8", "bool"):
        values = values - m // 2
    return torch.from_numpy(np.asarray(values, dtype=np.int64)).reshape(tuple(sizes)).to(torch_dtype(dtype))


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_synthetic_values_in_slabs_equal_the_formula(monkeypatch, chunk):
    monkeypatch.setattr(weights, "SYNTHETIC_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    for _ in range(60):
        shape = tuple(int(n) for n in rng.integers(1, 8, size=rng.integers(0, 4)))
        offsets = tuple(int(rng.integers(0, n)) for n in shape)
        sizes = tuple(int(rng.integers(1, n - o + 1)) for n, o in zip(shape, offsets))
        dtype = ["fp32", "bf16", "fp8_e4m3", "uint8"][int(rng.integers(0, 4))]
        got = synthetic_box(2, shape, dtype, offsets, sizes, version=3)
        assert torch.equal(got, _formula(2, shape, dtype, offsets, sizes, 3)), (shape, offsets, sizes, dtype)


def test_fill_synthetic_needs_about_its_storages_only():
    # A 256 MiB fp32 storage: the whole-box int64 arithmetic took several times that (the
    # element indices alone 512 MiB; 1.3 GiB measured); in slabs it is a few slabs of 8 MiB.
    script = textwrap.dedent(
        """
        import resource, sys, torch
        import layoutlang
        from layoutlang.io.weights import fill_synthetic
        program = layoutlang.loads('mesh m [dp = 1] on ranks 0..0\\ntensor "w" [8192, 8192] fp32\\n'
                                   'layout a on m { default: replicate }\\nreshard a -> a\\n')
        layout = program.layout("a")
        storage = torch.ones(8192, 8192)  # touched: its pages count before the fill
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fill_synthetic(layout, 0, {"w": storage})
        growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(growth * 1024, storage.numel() * 4, float(storage[8191, 8191]))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    growth, storage, last = out.stdout.split()
    expected_last = float(_formula(0, (8192, 8192), "fp32", (8191, 8191), (1, 1), 0).item())
    assert float(last) == expected_last
    assert int(growth) <= int(storage) // 4, (int(growth) / 2**20, "MiB of peak RSS growth")
