"""Whether ``layoutlang check`` takes time linear in a program's size (issue 24, case 5).

Generates programs of growing size in four shapes, each checked in a fresh subprocess
(``python -m layoutlang.cli check``), and prints the time and peak memory per tensor: a
check linear in the program's size keeps both flat as the size grows; the ratio column is
the time per tensor against the smallest size of the same shape.

``for``
    one ``tensor ... for`` statement of N tensors, two layouts (the attacker's 10^6
    tensors, now at most ``MAX_PROGRAM_TENSORS``, 2^18).
``constants``
    the same, after N / 16 ``let`` constants (each generated tensor copied every constant).
``digit rules``
    the same, with N / 64 rules naming single tensors (``"layers.7.w"``), each tried on
    every name before.
``storages``
    N / 64 storage rules fusing the tensors of one layer each.

Run (a few minutes at the default sizes; ``--sizes`` for others):

    python benchmarks/bench_check_scale.py [--sizes 16384,65536,262144]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MESHES = "mesh train [dp = 2, tp = 4]\nmesh infer [tp = 8]\n"


def _tensors(n: int) -> str:
    return f'tensor "layers.{{l}}.w" [64, 64] bf16 for l in 0..{n - 1}\n'


def _layouts(extra: str = "") -> str:
    return (
        f'layout a on train {{\n  "layers.{{l}}.w": tp = shard(0), dp = shard(1)\n{extra}  default: replicate\n}}\n'
        'layout b on infer {\n  "layers.{l}.w": tp = shard(1)\n  default: replicate\n}\nreshard a -> b\n'
    )


def for_clause(n: int) -> str:
    return MESHES + _tensors(n) + _layouts()


def constants(n: int) -> str:
    return "".join(f"let c{i} = {i}\n" for i in range(n // 16)) + for_clause(n)


def digit_rules(n: int) -> str:
    rules = "".join(f'  "layers.{i}.w": tp = shard(1)\n' for i in range(n // 64))
    return MESHES + _tensors(n) + _layouts(rules)


def storages(n: int) -> str:
    half = n // 2
    tensors = (
        f'tensor "layers.{{l}}.a" [64, 64] bf16 for l in 0..{half - 1}\n'
        f'tensor "layers.{{l}}.b" [64, 64] bf16 for l in 0..{half - 1}\n'
    )
    fused = "".join(f'  storage "l{i}.ab" = "layers.{i}.a" | "layers.{i}.b"\n' for i in range(n // 64))
    layouts = (
        f"layout a on train {{\n  default: tp = shard(0)\n{fused}}}\n"
        "layout b on infer {\n  default: replicate\n}\nreshard a -> b\n"
    )
    return MESHES + tensors + layouts


SHAPES: dict[str, Callable[[int], str]] = {
    "for": for_clause,
    "constants": constants,
    "digit rules": digit_rules,
    "storages": storages,
}


def check(path: Path) -> tuple[float, float]:
    """Seconds and peak MB of ``layoutlang check PATH`` in a fresh process."""
    with tempfile.TemporaryFile("w+") as errors:
        start = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "layoutlang.cli", "check", str(path)], stdout=subprocess.DEVNULL, stderr=errors
        )
        _, status, usage = os.wait4(process.pid, 0)  # this child's own peak memory
        seconds = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            errors.seek(0)
            sys.exit(f"check of {path} failed:\n{errors.read()}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16384,65536,262144", help="tensors per program, comma-separated")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"{'shape':<12} {'tensors':>8} {'time s':>8} {'us/tensor':>10} {'ratio':>6} {'peak MB':>8}")
    with tempfile.TemporaryDirectory() as folder:
        for shape, make in SHAPES.items():
            first: float | None = None
            for n in sizes:
                path = Path(folder) / f"{shape.replace(' ', '_')}_{n}.layout"
                path.write_text(make(n))
                seconds, peak = check(path)
                per_tensor = seconds / n * 1e6
                first = first or per_tensor
                print(f"{shape:<12} {n:>8} {seconds:>8.2f} {per_tensor:>10.1f} {per_tensor / first:>6.2f} {peak:>8.0f}")
                os.unlink(path)


if __name__ == "__main__":
    main()
