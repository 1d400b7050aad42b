"""layoutlang on Ray: the rendezvous actor, RayWorkers, the LayoutlangRank mixin, ``apply --ray``.

One Ray cluster for the module, of two nodes on this machine (a head and a second raylet,
each with its own CPUs and two "slots" of a resource of the tests' own), so that the pool's
four workers land two per node and the placement makes each node a domain. The jobs that
run inside the actors are in tests/ray_jobs.py (the cluster's workers import it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'layoutlang[ray]')")

import ray_jobs  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from layoutlang._text import human_bytes  # noqa: E402
from layoutlang.errors import ExitCode  # noqa: E402
from layoutlang.integrations.ray import RayWorkers, domain_size_of, start_rendezvous  # noqa: E402
from layoutlang.integrations.workers import WorkerError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
DOCS = ROOT / "docs" / "snippets"
SLOT = "layoutlang_test_slot"  # two per node: the pool's workers land two per node

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as patch:
        # the cluster's processes import tests/ray_jobs.py, and layoutlang as this process does
        path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", str(ROOT))])
        patch.setenv("PYTHONPATH", path)
        patch.setenv("OMP_NUM_THREADS", "1")
        nodes = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 16, "resources": {SLOT: 2}, "include_dashboard": False},
        )
        nodes.add_node(num_cpus=16, resources={SLOT: 2})
        ray.init(address=nodes.address, logging_level="ERROR", log_to_driver=False)
        try:
            yield nodes
        finally:
            ray.shutdown()
            nodes.shutdown()


@pytest.fixture(scope="module")
def pool(cluster):
    with RayWorkers(4, timeout=30.0, resources={"CPU": 1, SLOT: 1}) as workers:
        yield workers


def _start_apply(*args: str, ray_address: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.Popen(
        [sys.executable, "-m", "layoutlang.cli", "apply", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = process.communicate(timeout=280)  # within the slowest test's timeout
    except subprocess.TimeoutExpired:
        process.kill()  # its own local cluster, if it started one, goes with it
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def _apply(*args: str, ray_address: str | None = None) -> subprocess.CompletedProcess:
    return _finished(_start_apply(*args, ray_address=ray_address))


def _shape(value: Any) -> Any:
    """A JSON value's shape: its keys, nested, and the kinds of its leaves."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value[:1]]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


@pytest.mark.timeout(300)  # 12 Ray actors and 12 local workers, each importing torch, on 2 busy cores
def test_apply_ray_verifies_every_byte_and_reports_as_the_local_launcher(cluster):
    # side by side: the two runs wait on their workers' imports more than on each other
    started = [_start_apply("--ray", "examples/refit.layout", "--json", ray_address=cluster.address),
               _start_apply("examples/refit.layout", "--json")]
    on_ray, local = (_finished(p) for p in started)
    assert on_ray.returncode == 0, on_ray.stderr
    assert local.returncode == 0, local.stderr
    ray_report, local_report = json.loads(on_ray.stdout)["result"], json.loads(local.stdout)["result"]
    assert _shape(ray_report) == _shape(local_report)
    assert ray_report["ok"] and ray_report["ranks"] == local_report["ranks"] == 12
    for policy, run in local_report["runs"].items():
        got = ray_report["runs"][policy]
        assert got["mismatches"] == []
        # the program's topology (domains of 2) is kept on Ray: the same plan, the same moves
        for key in ("fingerprints", "bytes", "moved_bytes", "messages", "verified_bytes"):
            assert got[key] == run[key], key
    # the tutorial's example run shows these numbers (its time and bandwidth vary)
    shown = (DOCS / "ray-apply.out").read_text("utf-8").splitlines()
    assert shown[1].startswith("refit refit: megatron (4 ranks) -> vllm (8 ranks), 12 processes (Ray actors on ")
    run = ray_report["runs"]["reshard"]
    row = shown[-1].split()
    expected = [human_bytes(run["bytes"]["local"]), human_bytes(run["bytes"]["domain"]),
                human_bytes(run["bytes"]["network"]), human_bytes(run["moved_bytes"]), f"{run['messages']:,}"]
    assert " ".join(row[3:12]) == " ".join(expected)
    assert shown[-1].endswith(f"{human_bytes(run['peak_staging_bytes'])}  ok ({human_bytes(run['verified_bytes'])})")


def test_the_tutorials_actor_example_runs(cluster):
    """Actors of the user's own (trainers and engines) become ranks with LayoutlangRank."""
    shown = (DOCS / "ray-refit.out").read_text("utf-8")
    command, _, expected = shown.partition("\n")
    assert command == "$ python docs/snippets/ray-refit.py"
    env = dict(os.environ, RAY_ADDRESS=cluster.address, OMP_NUM_THREADS="1")
    ran = subprocess.run([sys.executable, "docs/snippets/ray-refit.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == expected


def test_workers_find_the_rendezvous_with_no_address_and_each_node_is_a_domain(pool):
    results = pool.run(ray_jobs.joined)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert {r["sum"] for r in results} == {0 + 1 + 2 + 3}  # one gloo group of the four
    assert all(r["master_addr"] is None and r["secret_set"] and r["threads"] == 1 for r in results)
    # two workers per node (two slots each), consecutive ranks together: a node is a domain
    assert len(set(pool.nodes.values())) == 2
    assert pool.nodes[0] == pool.nodes[1] != pool.nodes[2] == pool.nodes[3]
    assert pool.domain_size == 2
    # the rendezvous actor's membership: every rank, and the node Ray placed it on
    assert ray.get(pool.rendezvous.membership.remote()) == pool.nodes


def test_domains_from_placement_never_span_two_nodes():
    assert domain_size_of({0: "a", 1: "a", 2: "b", 3: "b"}) == 2
    assert domain_size_of({0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "b"}) == 4  # the last domain: 4..5 of 4..7
    assert domain_size_of({0: "a", 1: "a", 2: "b", 3: "b", 4: "b", 5: "b"}) == 2  # 2 + 4: blocks of 2
    assert domain_size_of({0: "a", 1: "b", 2: "a"}) == 1  # interleaved: every rank its own domain
    # ranks that do not start at 0: domains 3..5 and 6..8 hold 4, 5 (node a) and 6, 7 (node b)
    assert domain_size_of({4: "a", 5: "a", 6: "b", 7: "b"}) == 3
    assert domain_size_of({0: "a", 1: "a", 2: "a"}) == 3


def test_a_process_without_the_secret_cannot_join(cluster):
    job = "secret-test"
    rendezvous = start_rendezvous(job, 2, timeout=60.0)
    contact = ray.get(rendezvous.contact.remote())
    honest = ray.remote(num_cpus=1)(ray_jobs.JoiningRank).remote()
    attacker: dict[str, Any] = {}

    def join_without_the_secret() -> None:
        # what an unsigned gloo rank 1 does: it knows the store's address, not the secret
        store = dist.TCPStore(contact.host, contact.port, is_master=False, timeout=timedelta(seconds=10))
        try:
            dist.ProcessGroupGloo(dist.PrefixStore("layoutlang", store), 1, 2, timedelta(seconds=8))
            attacker["joined"] = True
        except RuntimeError as err:
            attacker["error"] = str(err)

    thread = threading.Thread(target=join_without_the_secret, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        # rank 1's records are not signed: the honest rank never reads them, and gives up
        with pytest.raises(ray.exceptions.RayTaskError, match=r"wait timeout|no authentic value"):
            ray.get(honest.join.remote(job, 0, 6.0), timeout=60)
        assert time.monotonic() - start < 40
        thread.join(30)
        assert "joined" not in attacker
    finally:
        for actor in (honest, rendezvous):
            ray.kill(actor)


@pytest.mark.timeout(300)  # 13 Ray actors importing torch on 2 busy cores
def test_an_elastic_refit_on_ray_survives_a_killed_rank_and_its_replacement_joins(cluster):
    run = _apply("--ray", "--elastic", "--kill", "6@1", "--replace", "examples/refit.layout", "--json",
                 ray_address=cluster.address)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)["result"]
    assert summary["ok"] and summary["errors"] == {}
    assert list(summary["failed"]) == ["6"] and summary["failed"]["6"]["how"] == "kill"
    assert [s["step"] for s in summary["steps"]] == [0, 1, 2, 3]
    assert all(not s["mismatches"] for s in summary["steps"])
    assert summary["joined"]["12"]["ok"]  # the replacement received the last committed weights
    assert 6 not in summary["members"] and 12 in summary["members"]


def test_bad_input_is_one_line_without_a_traceback(tmp_path):
    unreachable = _apply("--ray", "examples/refit.layout", ray_address="127.0.0.1:1")
    assert unreachable.returncode == ExitCode.BAD_INPUT
    assert unreachable.stderr.startswith("error: RAY_ADDRESS=127.0.0.1:1: no Ray cluster answers there")
    elastic = _apply("--ray", "--elastic", "--kill", "99@1", "examples/refit.layout", "--json")
    assert elastic.returncode == ExitCode.BAD_INPUT
    assert "rank 99 is in no mesh of the reshard" in json.loads(elastic.stdout)["errors"][0]["message"]
    broken = tmp_path / "broken.layout"
    broken.write_text("mesh train [tp = 2] on ranks 0..1\nreshard a -> b\n")
    bad_program = _apply("--ray", str(broken))
    assert bad_program.returncode == ExitCode.BAD_INPUT
    for run in (unreachable, elastic, bad_program):
        assert "Traceback" not in run.stderr
    assert unreachable.stdout == bad_program.stdout == "" and elastic.stderr == ""  # --json: all on stdout


def test_a_killed_worker_actor_is_reported_naming_its_rank(pool):
    pool.submit(ray_jobs.sleep, 20.0)
    time.sleep(1.0)
    ray.kill(pool.actors[2])
    with pytest.raises(WorkerError) as failure:
        pool.collect(timeout=60)
    assert failure.value.kind == "died" and failure.value.exit_code == ExitCode.FAILURE
    assert str(failure.value).startswith("worker rank 2 died (its Ray actor was killed")
    # the next task starts every worker afresh, in a fresh group
    assert [r["sum"] for r in pool.run(ray_jobs.joined)] == [6] * 4
