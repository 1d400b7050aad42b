#!/usr/bin/env bash
# Installs layoutlang as it was at a git revision into a folder of its own, for the
# side-by-side comparisons of the benchmarks (bench_rank_plans.py --baseline DIR):
#
#     benchmarks/install_baseline.sh ff6ebca /tmp/layoutlang-ff6ebca
#
# The revision is checked out into a temporary worktree and built as a wheel (its C++ core
# included, with the build tools pip fetches), then installed into DIR without
# dependencies: the benchmark imports it from there with this checkout's .venv, so only
# layoutlang itself differs. Run from the repository with .venv set up (scripts/setup).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 REVISION DIR" >&2
  exit 2
fi
revision=$1
target=$2
cd "$(dirname "$0")/.."
python=.venv/bin/python
[ -x "$python" ] || { echo "no .venv here: run scripts/setup first" >&2; exit 2; }
commit=$(git rev-parse --verify "$revision^{commit}")
worktree=$(mktemp -d)
trap 'git worktree remove --force "$worktree" >/dev/null 2>&1 || rm -rf "$worktree"' EXIT
git worktree add --detach "$worktree" "$commit" >/dev/null
rm -rf "$target"
"$python" -m pip install --quiet --no-deps --target "$target" "$worktree"
echo "layoutlang at ${commit:0:12} installed in $target"
