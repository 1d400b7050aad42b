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


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_training_steps_change_the_same_elements_on_every_rank_and_the_truth_follows(monkeypatch, chunk):
    """``apply --delta``'s synthetic training steps: each step changes about the fraction asked
    of every tensor's elements, picked by their place in the logical tensor (so replicas and
    differently sharded ranks change alike); ``changed_truth`` gives what every box holds after
    the steps, checked here against the whole tensor changed element by element."""
    import layoutlang

    monkeypatch.setattr(weights, "SYNTHETIC_CHUNK", chunk)
    program = layoutlang.loads(
        "mesh a [tp = 2] on ranks 0..1\nmesh b [tp = 4] on ranks 2..5\n"
        'tensor "w" [64, 48] fp32\ntensor "e" [100, 8] bf16\n'
        'layout s on a {\n "w": tp = shard(0)\n "e": tp = shard(1)\n}\n'
        'layout d on b {\n "w": tp = shard(1)\n "e": tp = shard(0)\n}\nreshard s -> d\n'
    )
    whole = program.layout("s")
    steps, fraction = 3, 0.05
    truth = weights.changed_truth(whole, None, fraction, steps)
    for layout in (program.layout("s"), program.layout("d")):
        for rank in layout.mesh.ranks:
            storages = {
                name: torch.zeros(shape, dtype=torch_dtype(layout.tensors[layout.storage(name, rank).parts[0]].dtype))
                for name, shape in layout.storages_on(rank).items()
            }
            weights.fill_synthetic(layout, rank, storages)
            changed = [weights.change_synthetic(layout, rank, storages, fraction, step) for step in range(1, steps + 1)]
            held = sum(t.numel() for t in storages.values())
            assert all(0 < c < 0.15 * held for c in changed), changed
            assert weights.verify(layout, rank, storages, truth=truth).ok
            assert not weights.verify(layout, rank, storages).ok  # they did change
    # element by element: an element takes the values of the last step that picked it
    for name in ("w", "e"):
        tensor = whole.tensors[name]
        index = whole.resolved.index[name]
        expected = synthetic_box(index, tensor.shape, tensor.dtype, (0, 0), tensor.shape)
        flat = torch.arange(expected.numel()).view(tensor.shape)
        for step in range(1, steps + 1):
            picked = weights._changed(flat, index, fraction, step)
            later = synthetic_box(index, tensor.shape, tensor.dtype, (0, 0), tensor.shape, version=step)
            expected[picked] = later[picked]
        box = whole.boxes(name, 0)[0]
        got = truth(name, index, box)
        assert torch.equal(got, expected[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
