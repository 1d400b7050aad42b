#!/usr/bin/env bash
# Multi-rank NCCL checks for a machine with two or more GPUs (not part of the single-GPU
# run): communicator creation through a TCPStore, a ring exchange, the executor over all
# ranks, shrink after a rank stops, grow with a new process (tests/gpu/multi_gpu.py); then the
# refit session of live engines over NCCL: an engine lost and one joining, every byte
# verified (tests/gpu/refit_session_gpu.py, three or more GPUs).
# With fewer than two GPUs it prints why and exits 0. Usage:
#   tests/gpu/run_multi_gpu_checks.sh [--ranks N] [--timeout SECONDS]
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  . .venv/bin/activate
fi
status=0
timeout 900 "${PYTHON:-python}" tests/gpu/multi_gpu.py "$@" || status=1
timeout 900 "${PYTHON:-python}" tests/gpu/refit_session_gpu.py "$@" || status=1
exit "$status"
