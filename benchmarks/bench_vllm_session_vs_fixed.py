"""The steady-state refit of live vLLM engines: today's elastic refit session against the fixed
refit group it replaced, side by side in one run.

    python benchmarks/bench_vllm_session_vs_fixed.py [--baseline c0af11f] [--rounds 2] [--refits 10]

The fixed group is layoutlang as it was at ``--baseline`` (the last revision before the refit
group became an elastic session: one gloo group of a fixed world size, built at
``trainer_init``), installed into a folder of its own by ``benchmarks/install_baseline.sh``
and run in the vLLM environment with that folder first on the path (a ``sitecustomize`` there
takes this checkout's editable install out of the way, in the engines' processes too). Both
ways run the same benchmark, that revision's own ``benchmarks/bench_vllm_refit.py`` and this
checkout's: 2 FSDP2 trainer ranks refit 2 vLLM CPU engines of tensor parallel 2 (Llama, 4
layers, hidden 512), and print the median of their layoutlang refits (the whole refit a
trainer sees: control-plane calls, the transfer, vLLM's ``load_weights`` on apply). The two
ways alternate, each in fresh processes (ABBA over ``--rounds``), and the ratio of the medians
is printed (the target: at most 1.1x). Figures, not tests.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# the median of the layoutlang refits in either revision's bench_vllm_refit.py output
LINE = re.compile(r"^layoutlang\s+[\d,]+\s+([\d.]+)", re.MULTILINE)

SITECUSTOMIZE = '''"""Take the editable install of the checkout out of the way: layoutlang comes from here."""
import sys

sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
'''


def install(revision: str, folder: Path, *, build: bool) -> None:
    """The baseline revision in ``folder`` (built unless ``build`` is False: an install made
    already), with the path hook and that revision's benchmark beside it."""
    if build:
        subprocess.run(["bash", str(ROOT / "benchmarks" / "install_baseline.sh"), revision, str(folder)], cwd=ROOT,
                       check=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    script = subprocess.run(["git", "show", f"{revision}:benchmarks/bench_vllm_refit.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    (folder / "bench_vllm_refit_baseline.py").write_text(script)


def run(way: str, folder: Path, refits: int) -> float:
    env = dict(os.environ)
    if way == "fixed group":
        env["PYTHONPATH"] = str(folder)
        command = [str(VLLM_PYTHON), str(folder / "bench_vllm_refit_baseline.py"), "--refits", str(refits)]
    else:
        env.pop("PYTHONPATH", None)
        command = [str(VLLM_PYTHON), str(ROOT / "benchmarks" / "bench_vllm_refit.py"), "--refits", str(refits)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    found = LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{way}: the benchmark failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-3000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="c0af11f", help="the revision of the fixed refit group")
    parser.add_argument("--baseline-dir", type=Path, help="an install of it made already (install_baseline.sh)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each way runs twice a round")
    parser.add_argument("--refits", type=int, default=10, help="refits per run")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"no vLLM environment at {VLLM_PYTHON}: run scripts/setup-vllm")
    with tempfile.TemporaryDirectory(prefix="layoutlang-baseline-") as tmp:
        folder = args.baseline_dir or Path(tmp) / "baseline"
        install(args.baseline, folder, build=args.baseline_dir is None)
        medians: dict[str, list[float]] = {"fixed group": [], "elastic session": []}
        for r in range(args.rounds):
            order = ["fixed group", "elastic session"]
            for way in order + order[::-1] if r % 2 == 0 else order[::-1] + order:
                medians[way].append(run(way, folder, args.refits))
                print(f"  {way:<16} {medians[way][-1]:.3f} s (median of {args.refits} refits)", flush=True)
    print(f"live vLLM refit (bench_vllm_refit.py's layoutlang way), {args.rounds * 2} runs each, alternating:")
    print(f"{'way':<18}{'median of runs s':>18}{'best run s':>12}")
    for way, values in medians.items():
        print(f"{way:<18}{statistics.median(values):>18.3f}{min(values):>12.3f}")
    ratio = statistics.median(medians["elastic session"]) / statistics.median(medians["fixed group"])
    print(f"ratio elastic session / fixed group ({args.baseline}): {ratio:.3f}x "
          f"(target at most 1.1x: {'met' if ratio <= 1.1 else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
