"""The C++ quantizer against the same rule done with torch, side by side on one process.

DeepSeek-V3's largest dense projection, ``mlp.gate_proj.weight`` of the dense layers
(``[18432, 7168]`` bf16, 128 x 128 blocks), and one routed expert's ``down_proj``
(``[7168, 2048]``, MXFP8's 1 x 32 blocks too), and the first read through its transpose (a
strided view, as a region cut across a storage's rows is): the best of ``--runs`` runs of
``layoutlang.io.quantize.quantize`` (one thread, no copies: strided reads; where rows are
contiguous, per block row strip one vectorized pass for the amax and one for the values)
against the torch reference of ``tests/test_quantize.py`` (whole-tensor ops, torch's own
threads), after checking that both give the same bytes.
Prints seconds, GB/s of bf16 read, and the ratio; then the dense case once per kernel the
CPU runs (``layoutlang.io.quantize.quantize_kernels``: avx512, avx2, generic), one thread
each, into preallocated tensors, after checking that every kernel writes the same bytes.
Run from the repository root:

    python benchmarks/bench_quantize.py [--runs N] [--threads T]

``--threads`` sets torch's threads for the reference (default: torch's own choice).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quantize import reference

from layoutlang.io.quantize import quantize, quantize_into, quantize_kernels

CASES = [
    ("dense gate_proj [18432, 7168] fp8_e4m3 128x128", (18432, 7168), "fp8_e4m3", (128, 128), False),
    ("the same, read through its transpose (strided)", (18432, 7168), "fp8_e4m3", (128, 128), True),
    ("expert down_proj [7168, 2048] fp8_e4m3 128x128", (7168, 2048), "fp8_e4m3", (128, 128), False),
    ("expert down_proj [7168, 2048] mxfp8 1x32", (7168, 2048), "mxfp8", (1, 32), False),
]


def best(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch threads; best of {args.runs}")
    print(f"{'case':50s} {'layoutlang':>12s} {'torch ref':>12s} {'ratio':>7s}")
    for label, shape, fmt, block, transposed in CASES:
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
        if transposed:
            x = x.t()  # a view: every row of it is a column of the storage
        values, scales = quantize(x, fmt, block)
        want_values, want_scales = reference(x, fmt, block, "scale_inv")
        same = torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)) and torch.equal(
            scales.contiguous().view(torch.uint8), want_scales.contiguous().view(torch.uint8)
        )
        if not same:
            print(f"{label}: the quantizer and the reference differ")
            return 1
        ours = best(lambda x=x, fmt=fmt, block=block: quantize(x, fmt, block), args.runs)
        theirs = best(lambda x=x, fmt=fmt, block=block: reference(x, fmt, block, "scale_inv"), args.runs)
        gbs = x.numel() * 2 / ours / 1e9
        print(f"{label:50s} {ours:9.3f} s {theirs:9.3f} s {theirs / ours:6.2f}x   ({gbs:.2f} GB/s of bf16)")
    return kernels(args.runs)


def kernels(runs: int) -> int:
    """The dense case on each kernel, one thread, side by side."""
    label, shape, fmt, block, _ = CASES[0]
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    outputs = {}
    print(f"\n{label}, one thread, by kernel:")
    for kernel in quantize_kernels():
        values = torch.empty(shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty([-(-n // b) for n, b in zip(shape, block)], dtype=torch.float32)

        def run(values=values, scales=scales, kernel=kernel) -> None:
            quantize_into(x, values, scales, fmt, block, threads=1, kernel=kernel)

        seconds = best(run, runs)
        outputs[kernel] = (values.view(torch.uint8), scales)
        print(f"  {kernel:8s} {seconds:7.3f} s   ({x.numel() * 2 / seconds / 1e9:.2f} GB/s of bf16)")
    first = next(iter(outputs.values()))
    same = all(torch.equal(v, first[0]) and torch.equal(s, first[1]) for v, s in outputs.values())
    print(f"  every kernel wrote the same bytes: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
