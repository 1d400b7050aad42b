#!/usr/bin/env python3
"""Packing and unpacking strided boxes on the GPU: which way is fastest, per bucket shape.

For a few bucket shapes taken from real reshards, packs every box of the bucket into one
staging message (and unpacks it back) three ways, and compares with the device's own
copy bandwidth (one contiguous copy of the same bytes):

  torch-loop     one ``dst.copy_(src)`` per box: what the executor does today
  torch-foreach  ``torch._foreach_copy_`` over all boxes of the bucket
  runtime        ``layoutlang.transport.nccl.copy_pairs``: pitched cudaMemcpy2D/3DAsync through the
                 CUDA runtime loaded at run time, one call per box, adjacent boxes merged

Each result is checked against the torch-loop result before it is timed. Prints one table
(payload GB/s, percent of the device copy, calls per bucket) and which method wins for
each shape; ``--json PATH`` writes the numbers. Exits 0 with a note on a machine without
CUDA. Meant for ``run_gpu_checks.sh``; runs in well under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch


def _cases(device):
    bf16 = torch.bfloat16
    out = []
    # Tensor-parallel columns: 8 column shards of an [8192, 8192] weight (2-D strided boxes).
    w = torch.randn(8192, 8192, device=device).to(bf16)
    out.append(("tp-columns 8x[8192,1024]", [w[:, i * 1024 : (i + 1) * 1024] for i in range(8)]))
    # Fused 3-D: heads x rows x cols sub-blocks (one cudaMemcpy3D each).
    qkv = torch.randn(64, 512, 512, device=device).to(bf16)
    fused = [qkv[:, (i % 2) * 256 : (i % 2 + 1) * 256, (i // 2) * 128 : (i // 2 + 1) * 128] for i in range(4)]
    out.append(("fused-3d 4x[64,256,128]", fused))
    # Row shards: contiguous boxes that merge into one copy.
    rows = torch.randn(8192, 4096, device=device).to(bf16)
    out.append(("row-shards 16x[512,4096]", [rows[i * 512 : (i + 1) * 512] for i in range(16)]))
    # Many small boxes (unstacked experts, small biases): launch overhead dominates.
    small = torch.randn(4096, 1024, device=device).to(bf16)
    pieces = [small[(i // 8) * 16 : (i // 8 + 1) * 16, (i % 8) * 128 : (i % 8 + 1) * 128] for i in range(2048)]
    out.append(("many-small 2048x[16,128]", pieces))
    return out


def _staging(boxes, device):
    total = sum(b.numel() for b in boxes)
    flat = torch.empty(total, dtype=boxes[0].dtype, device=device)
    views, offset = [], 0
    for b in boxes:
        views.append(flat[offset : offset + b.numel()].view(b.shape))
        offset += b.numel()
    return flat, views


def _time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs, timed with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop))
    return statistics.median(samples)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_pack: skipped: no CUDA device (torch.cuda.is_available() is False)")
        return 0

    from layoutlang.transport.nccl import copy_pairs, load_cuda_runtime

    device = torch.device("cuda", torch.cuda.current_device())
    runtime = load_cuda_runtime()
    print(f"device: {torch.cuda.get_device_name(device)}; {runtime.describe()}")
    results = []
    foreach = getattr(torch, "_foreach_copy_", None)
    for name, boxes in _cases(device):
        flat, views = _staging(boxes, device)
        nbytes = flat.numel() * flat.element_size()
        reference_src = torch.empty_like(flat)
        reference = _time(lambda flat=flat, src=reference_src: flat.copy_(src), args.repeats)
        for direction in ("pack", "unpack"):
            pairs = list(zip(views, boxes)) if direction == "pack" else list(zip(boxes, views))
            truth = None
            if direction == "pack":
                for dst, src in pairs:
                    dst.copy_(src)
                truth = flat.clone()
            calls_holder: dict[str, int] = {}
            methods = {"torch-loop": lambda pairs=pairs: [d.copy_(s) for d, s in pairs]}
            if foreach is not None:
                methods["torch-foreach"] = lambda pairs=pairs: foreach([d for d, _ in pairs], [s for _, s in pairs])

            def runtime_copy(pairs=pairs, holder=calls_holder):
                holder["calls"] = copy_pairs(pairs, cuda=runtime)[0]

            methods["runtime"] = runtime_copy
            for method, fn in methods.items():
                if direction == "pack":
                    flat.zero_()
                    fn()
                    torch.cuda.synchronize()
                    if not torch.equal(flat, truth):
                        print(f"FAIL: {name} {direction} {method}: wrong bytes")
                        return 1
                ms = _time(fn, args.repeats)
                if method == "runtime":
                    calls = calls_holder.get("calls", len(pairs))
                else:
                    calls = 1 if method == "torch-foreach" else len(pairs)
                results.append(
                    {
                        "case": name,
                        "direction": direction,
                        "method": method,
                        "ms": ms,
                        "gbps": nbytes / ms / 1e6,
                        "of_device_copy": reference / ms,
                        "calls": calls,
                        "bytes": nbytes,
                    }
                )
    print(f"\n{'case':<26} {'dir':<6} {'method':<14} {'ms':>8} {'GB/s':>8} {'vs copy':>8} {'calls':>6}")
    for r in results:
        print(
            f"{r['case']:<26} {r['direction']:<6} {r['method']:<14} {r['ms']:>8.3f} {r['gbps']:>8.1f} "
            f"{r['of_device_copy']:>7.0%} {r['calls']:>6}"
        )
    print("\nfastest per case (pack + unpack):")
    by_case = {}
    for r in results:
        by_case.setdefault(r["case"], {}).setdefault(r["method"], 0.0)
        by_case[r["case"]][r["method"]] += r["ms"]
    for case, methods in by_case.items():
        best = min(methods, key=methods.get)
        ratio = methods["torch-loop"] / methods[best]
        print(f"  {case:<26} {best} ({ratio:.2f}x faster than torch-loop)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
