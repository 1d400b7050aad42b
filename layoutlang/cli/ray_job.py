"""``layoutlang apply --ray``: the program's workers as Ray actors.

On the cluster ``RAY_ADDRESS`` names (``host:port`` of its head, or ``auto``), or on a
local cluster started here and shut down at the end. The workers are a
:class:`~layoutlang.integrations.ray.RayWorkers` pool: the rendezvous actor serves the
job's store on this node, every worker finds it by name and joins the job's gloo group
signed with the job's secret. The job and its report are those of the local launcher
(:func:`~layoutlang.cli.apply_job.run_on`). A program without a topology block has its
domains from placement (a Ray node is a domain); one with a topology keeps it, each domain
placed on one node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import attrs
import ray

from ..errors import LayoutValueError
from ..integrations.ray import RayWorkers
from ..lang import load
from ..model.topology import Topology
from . import elastic_job
from .apply_job import ApplyOptions, participants_of, run_on
from .apply_progress import Display

__all__ = ["check_address", "connected", "run_ray", "run_ray_elastic"]

#: How long a RAY_ADDRESS may take to accept a connection before it counts as unreachable
#: (Ray's own client retries for minutes).
CONNECT_TIMEOUT = 5.0


def check_address(address: str) -> None:
    """Refuse, in one line, a ``RAY_ADDRESS`` that no Ray head answers at (``host:port``, or
    ``ray://host:port``); ``auto`` is left to Ray (it looks for a cluster on this machine)."""
    if address == "auto":
        return
    where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        raise LayoutValueError(f"RAY_ADDRESS={address!r}: expected host:port of the Ray head (or auto)")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT):
            pass
    except OSError as err:
        raise LayoutValueError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({err.strerror or err})",
            hint="start one (ray start --head), fix RAY_ADDRESS, or unset it to let --ray start a local cluster",
        ) from None


@contextlib.contextmanager
def connected(workers: int) -> Iterator[str]:
    """Ray, initialized for this job: on the cluster ``RAY_ADDRESS`` names, or on a local one
    started here (with a CPU per worker at least) and shut down on exit. Yields which."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        check_address(address)
    # Ray's driver prints what its cluster reports (a worker that died, as an injected fault
    # does) on stdout: into the report, or the --json object. It goes to stderr instead.
    with contextlib.redirect_stdout(sys.stderr), _initialized(address, workers) as where:
        yield where


@contextlib.contextmanager
def _initialized(address: str, workers: int) -> Iterator[str]:
    if address:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.ERROR)
        except ConnectionError as err:
            raise LayoutValueError(f"RAY_ADDRESS={address}: {str(err).splitlines()[0]}") from None
        where = "the cluster at RAY_ADDRESS"
    else:
        ray.init(num_cpus=max(workers, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
        where = "a local cluster"
    try:
        yield where
    finally:
        ray.shutdown()


def _launcher(workers: RayWorkers, where: str, domains: str) -> str:
    nodes = len(set(workers.nodes.values()))
    return f"Ray actors on {nodes} node{'s' if nodes != 1 else ''} of {where}, {domains}"


def run_ray(options: ApplyOptions, display: Display | None = None) -> tuple[list[dict[str, Any]], str]:
    """Run the job on Ray actors; every rank's report, and the launcher as the report names it."""
    participants = participants_of(options.path, options.reshard, allow_outside_includes=options.allow_outside_includes)
    program = load(options.path, allow_outside_includes=options.allow_outside_includes)
    # a program that says nothing of its topology has its domains from placement: a Ray node each
    given = None if program.topology == Topology() else program.topology.domain_size
    size = len(participants)
    with (
        connected(size) as where,
        RayWorkers(size, ranks=participants, domain_size=given, timeout=options.timeout) as workers,
    ):
        if given is None:
            options = attrs.evolve(options, domain_size=workers.domain_size)
        reports = run_on(workers, options, participants, display)
        domains = f"domains of {workers.domain_size} ranks" + ("" if given else " from placement")
        launcher = _launcher(workers, where, domains)
    return reports, launcher


def run_ray_elastic(
    options: elastic_job.ElasticOptions, namespace: str = "apply", display: Display | None = None
) -> tuple[dict[str, Any], str]:
    """Run an elastic job (``--elastic``) on Ray actors, one per rank and per replacement;
    the summary, and the launcher as the report names it. Its sessions plan with the
    program's topology: each of its domains is placed on one node, and a program without
    one keeps every rank its own domain (the session's plans are made in the ranks)."""
    program = load(options.path)
    given = None if program.topology == Topology() else program.topology.domain_size
    size = elastic_job.workers_needed(options)
    with (
        connected(size) as where,
        RayWorkers(size, domain_size=given, timeout=options.timeout) as workers,
    ):
        summary = elastic_job.run_on(workers, options, namespace, display)
        launcher = _launcher(workers, where, f"domains of {given or 1} rank{'s' if given else ''}")
    return summary, launcher
