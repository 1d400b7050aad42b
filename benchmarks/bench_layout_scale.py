"""How long the language and the C++ core take on a DeepSeek-V3-sized program.

Loads benchmarks/deepseek_v3_refit.layout (45,395 logical tensors, two meshes of 256
ranks), resolves every tensor in both layouts, then computes every rank's boxes of every
tensor in the C++ core and validates every storage on every rank. Prints each phase's
time and the box counts. Run:

    python benchmarks/bench_layout_scale.py [FILE]
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import layoutlang
from layoutlang.lang import parse, read_source

HERE = Path(__file__).resolve().parent


def timed(label: str, fn, rows: list[tuple[str, float]]):
    start = time.perf_counter()
    result = fn()
    rows.append((label, time.perf_counter() - start))
    return result


def main(path: Path) -> None:
    rows: list[tuple[str, float]] = []
    text = read_source(path)
    timed("parse (text -> syntax tree)", lambda: parse(text, str(path)), rows)
    program = timed("load (includes, imports, names)", lambda: layoutlang.load(path), rows)
    for layout in program.layouts.values():
        label = f"resolve layout {layout.name} (rules, sub-meshes, storages, compile)"
        timed(label, lambda layout=layout: layout.resolved, rows)
    summaries = {}
    for layout in program.layouts.values():
        summaries[layout.name] = timed(f"boxes of every tensor on every rank of {layout.name}", layout.summary, rows)
    for layout in program.layouts.values():
        timed(f"validate storages of {layout.name} on every rank", layout.check, rows)

    print(f"program: {path.name}: {len(program.tensors):,} logical tensors, "
          f"{sum(t.numel for t in program.tensors.values()) / 1e9:.1f}B parameters")
    for layout in program.layouts.values():
        summary = summaries[layout.name]
        boxes = sum(r["boxes"] for r in summary)
        held = sum(r["bytes"] for r in summary)
        print(f"  layout {layout.name} on {layout.mesh.name} {dict(layout.mesh.axes)}: "
              f"{boxes:,} boxes, {held / 2**40:.2f} TiB held in all, "
              f"{max(r['bytes'] for r in summary) / 2**30:.1f} GiB on the fullest rank")
    width = max(len(label) for label, _ in rows)
    for label, seconds in rows:
        print(f"  {label:<{width}}  {seconds:8.3f} s")
    print(f"  {'total':<{width}}  {sum(s for _, s in rows):8.3f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak memory (max RSS): {peak:.0f} MiB")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "deepseek_v3_refit.layout")
