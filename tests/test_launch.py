"""The local launcher's bookkeeping: a job ends with its failure, whatever its workers do.

A worker that is stopped (SIGSTOP: a hung or overloaded host) never answers; once another
worker has failed, the launcher waits one more timeout for the rest, then reports the first
failure naming the workers that never answered, instead of waiting for the whole task's
deadline (which ``apply --repeat 400`` makes hours long). A worker killed by a signal is
reported with the signal's name. Every worker, respawned ones too, holds the job's secret:
the operator's, or one the launcher generated.
"""

from __future__ import annotations

import os
import time

import launch_jobs
import pytest

from elastic.auth import SECRET_ENV, JobSecret
from layoutlang.cli.launch import LocalWorkers, WorkerError
from layoutlang.errors import ExitCode

pytestmark = pytest.mark.timeout(180)


def test_a_stopped_worker_ends_the_job_one_timeout_after_the_first_failure():
    with LocalWorkers(3, timeout=3.0) as workers:
        workers.run(os.getpid)  # started: a loaded machine's start-up is not the job's wait
        workers.submit(launch_jobs.one_rank_stops, 1)
        started = time.monotonic()
        with pytest.raises(WorkerError) as err:
            workers.collect(timeout=3600)  # the task's own deadline, as apply --repeat gives it
        seconds = time.monotonic() - started
    # what ended it: the stopped worker's silence one timeout (+5 s) after the first failure,
    # not the task's hour (a loaded machine may take longer to get there than a quiet one)
    assert "worker 1 did not answer within 8 s of it (stopped or hung)" in str(err.value)
    assert seconds < 600
    assert "rank 0: ExecutionError" in str(err.value)
    assert err.value.exit_code == ExitCode.FAILURE


def test_a_worker_killed_by_a_signal_is_named_with_the_signal():
    with LocalWorkers(2, timeout=10.0) as workers:
        workers.submit(launch_jobs.one_rank_is_killed, 1)
        with pytest.raises(WorkerError) as err:
            workers.collect(timeout=60)
    assert str(err.value) == "worker rank 1 died (killed by SIGKILL)"
    assert err.value.kind == "died" and err.value.exit_code == ExitCode.FAILURE


def test_every_worker_respawned_or_not_holds_the_operators_secret(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "correct horse battery staple")
    with LocalWorkers(2, timeout=10.0) as workers:
        assert workers.secret == JobSecret(b"correct horse battery staple")
        workers.run(os.getpid)  # the first workers have built their group: rank 1 may go
        workers.respawn([1])
        # handed to each worker at its start, as the hex of its bytes
        assert workers.run(os.getenv, SECRET_ENV) == [workers.secret.text()] * 2
    monkeypatch.delenv(SECRET_ENV)
    with LocalWorkers(1, timeout=10.0) as first, LocalWorkers(1, timeout=10.0) as second:
        assert first.secret != second.secret  # generated afresh for every job
        assert first.run(os.getenv, SECRET_ENV) == [first.secret.text()]
