#!/usr/bin/env bash
# The single-GPU checks of the NCCL core, in under five minutes:
#   1. layoutlang doctor: the NCCL found, its version, shrink/revoke/grow, CUDA and torch;
#   2. pytest -m gpu tests/gpu: pitched box copies against torch, NCCL self send/receive on
#      the caller's stream, CPU buffers staged through the device, the executor on CUDA
#      tensors over NcclTransport (a one-rank colocated plan), revoke, abort of a receive
#      that never completes; the torch-ops FP8/MXFP8 quantizer on CUDA against the C++ core,
#      byte for byte (test_gpu_quantize.py);
#   3. tests/gpu/bench_pack.py: pack/unpack bandwidth of three methods against the device's
#      own copy bandwidth (see docs/reference/transports.rst for how to read it).
# On a machine without CUDA it prints why and exits 0. Usage: tests/gpu/run_gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
PY=${PYTHON:-python}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "run_gpu_checks: skipped: no CUDA device (torch.cuda.is_available() is False)"
  exit 0
fi
if ! "$PY" -c 'import layoutlang.core._core' 2>/dev/null; then
  echo "run_gpu_checks: layoutlang is not built here: run 'pip install -e .' (or scripts/setup) first"
  exit 1
fi

status=0
step() {
  local name=$1 budget=$2
  shift 2
  echo
  echo "== $name (at most ${budget} s)"
  local start=$SECONDS
  timeout "$budget" "$@" || { echo "!! $name failed (status $?)"; status=1; }
  echo "-- $name: $((SECONDS - start)) s"
}

step "layoutlang doctor" 60 "$PY" -m layoutlang.cli.doctor
step "GPU tests" 150 "$PY" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider
step "pack/unpack bandwidth" 80 "$PY" tests/gpu/bench_pack.py

echo
if [ "$status" -eq 0 ]; then echo "run_gpu_checks: all checks passed"; else echo "run_gpu_checks: FAILED"; fi
exit "$status"
