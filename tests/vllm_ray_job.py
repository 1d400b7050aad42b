"""vLLM engines as Ray actors refitted from a trainer of Ray actors, as RL frameworks deploy
them; run with the vLLM environment's Python (``.venv-vllm``, with Ray) by
tests/test_vllm_ray.py, which asserts on what this records. Nothing here asserts.

``python tests/vllm_ray_job.py WORKDIR`` starts a local Ray cluster of two nodes on this
machine (a head, and a second raylet with resources of its own; loopback only): the trainer's
2 ranks are Ray actors on the head node (FSDP2 over gloo, the default group built through
layoutlang's rendezvous actor: no address or port set by hand), the 2 vLLM engines (tensor
parallel 2 each, their workers the actors' own processes) are ``ray.remote(LLM)`` actors on
the second node with ``max_restarts``, driven through vLLM's ``RayVLLMWeightSyncClient``
(:class:`~layoutlang.integrations.ray.vllm.RestartAwareRayClient`). The store of the refit
session is the trainer's (a free port, told to the engines in their init info). Steps:

1. step 1 refits engines A (loaded from the checkpoint) and B (dummy weights);
2. step 2: the trainer's rank 0 kills engine B's actor with ``ray.kill(..., no_restart=False)``
   halfway through its sends; the step commits on A, which ``send_weights()`` reports, B lost;
   Ray starts B's actor again (its constructor: dummy weights);
3. steps 3 onwards, a second apart: B rejoins by itself (nobody calls ``add_engine``),
   admitted at the first step boundary after the trainer's client saw Ray's new process,
   caught up from A, applied; one more step then refits both (``last_step`` in the result).

After every step the trainer saves its weights as a checkpoint (WORKDIR/stepN) and the driver
records every serving engine's greedy tokens. Then a fresh engine loaded from step 1's
checkpoint gives the oracle tokens of step 1, and of the later steps after vLLM's own reload
of each step's checkpoint (whole tensors through ``load_weights``). Actor processes are
recorded before and after, to show what restarted. Everything goes to WORKDIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TRAINERS = 2
ENGINES = ("A", "B")
JOB = "vllm-ray-refit"
#: seconds a refit waits for a peer
TIMEOUT = 60.0
#: the pause before each step after B's restart, as a training step would take (seconds)
STEP_SECONDS = 1.0
#: the last step at which B may still be admitted (the job then ends with one more step)
MAX_STEPS = 12
#: buckets of 64 KiB: the model moves in tens of executor steps, so "halfway" is mid-transfer
MEMORY_BUDGET = 128 * 2**10
TRAINER_NODE, ENGINE_NODE = "layoutlang_test_trainer_node", "layoutlang_test_engine_node"


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- engine


def _engine_environment() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # sized below: 1 GiB (its least) per worker is too much here
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the oracle's reload runs on workers


def engine_class() -> Any:
    """vLLM's ``LLM`` with the test's two questions added (tokens, and a checkpoint reloaded
    through vLLM's own path): what a framework's engine actor class is."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_engine_host import NEW_TOKENS, PROMPTS, reload_whole_tensors

    # [engine]
    class TestEngine(LLM):  # type: ignore[misc]
        def __init__(self, checkpoint: str, dummy: bool):
            _engine_environment()
            super().__init__(
                model=checkpoint, skip_tokenizer_init=True, tensor_parallel_size=2, dtype="float32",
                max_model_len=128, gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 * 2**20,
                enforce_eager=True, seed=0, load_format="dummy" if dummy else "auto",
                distributed_executor_backend="mp", weight_transfer_config={"backend": "layoutlang"},
            )
    # [/engine]

        def tokens(self) -> list[list[int]]:
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, detokenize=False)
            outputs = self.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outputs]

        def reload(self, checkpoint: str) -> None:
            self.llm_engine.collective_rpc(reload_whole_tensors, args=(checkpoint,))

        def pid(self) -> int:
            return os.getpid()

        def worker_pids(self) -> list[int]:
            return list(self.llm_engine.collective_rpc(_process_id))

    return TestEngine


def _process_id(_worker: Any) -> int:
    return os.getpid()


def wait_gone(pids: list[int], timeout: float = 60.0) -> bool:
    """Until none of ``pids`` runs (this machine's processes): whether they all went."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------------------- trainer


class Trainer:
    """One trainer rank: a tiny Llama as FSDP2 DTensors, Adam, and layoutlang's refit."""

    def __init__(self, rank: int, work: str):
        self.rank, self.work = rank, Path(work)

    def pid(self) -> int:
        return os.getpid()

    def start(self, engines: list[Any]) -> dict[str, Any]:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from vllm_refit_job import MODELS, new_model, program_text

        from layoutlang.integrations.dtensor import layout_from_state_dict
        from layoutlang.integrations.ray import LayoutlangRank
        from layoutlang.integrations.ray.rendezvous import store_host
        from layoutlang.integrations.ray.vllm import RestartAwareRayClient
        from layoutlang.integrations.vllm.trainer import (
            LayoutlangTrainerInitInfo,
            LayoutlangTrainerWeightTransferEngine,
        )

        # the job's default group, through the rendezvous actor (found by name)
        self.member = LayoutlangRank()
        self.member.join_layoutlang(JOB, self.rank)
        torch.manual_seed(0)
        self.model = new_model("llama")
        mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=2e-2)
        program = program_text(self.work / "step0", layout_from_state_dict(self.model.state_dict()),
                               MODELS["llama"]["preset"], engines=len(ENGINES))
        # [trainer]
        # the store on this node's address, a free port: the engines learn both from their init info
        info = LayoutlangTrainerInitInfo(
            rank=self.rank, master_address=store_host(), master_port=0, program=program,
            timeout=TIMEOUT, memory_budget=MEMORY_BUDGET,
        )
        self.engines = engines
        clients = [RestartAwareRayClient(engine) for engine in engines] if self.rank == 0 else []
        self.refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=self.model)
        # [/trainer]
        return {"store": [self.refit.info.master_address, self.refit.info.master_port]}

    def step(self, step: int, kill_engine: int | None = None, kill_pids: list[int] | None = None) -> dict[str, Any]:
        import ray
        import torch
        from vllm_refit_job import MODELS, new_model

        torch.manual_seed(100 + step)
        ids = torch.randint(0, MODELS["llama"]["config"]["vocab_size"], (2, 24))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        killed: dict[str, Any] = {}

        def kill_halfway(done: int, total: int) -> None:
            if kill_engine is not None and self.rank == 0 and done >= max(1, total // 2) and not killed:
                ray.kill(self.engines[kill_engine], no_restart=False)
                # Ray kills asynchronously: the sends go on once the actor and its engine's
                # processes are gone, so that the kill lands in the middle of the transfer
                killed.update(done=done, total=total, processes_gone=wait_gone(kill_pids or []))

        begin = time.perf_counter()
        report = self.refit.send_weights(progress=kill_halfway)
        seconds = time.perf_counter() - begin
        whole = {name: tensor.full_tensor() for name, tensor in self.model.state_dict().items()}
        out: dict[str, Any] = {"report": report.to_json(), "seconds": seconds, "killed": killed}
        if self.rank == 0:
            reference = new_model("llama")
            reference.load_state_dict(whole)
            reference.save_pretrained(self.work / f"step{step}")
            out["states"] = {str(e.index): e.state for e in self.refit.engines}
            out["versions"] = {str(e.index): e.version for e in self.refit.engines}
        return out


# ----------------------------------------------------------------------------- driver


def wait_until_up(actor: Any, timeout: float) -> None:
    """Until a restarting actor answers (a call meanwhile fails at once: no task retries)."""
    import ray

    end = time.monotonic() + timeout
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout)
            return
        except ray.exceptions.RayActorError:  # noqa: PERF203 (a retry loop)
            if time.monotonic() > end:
                raise
            time.sleep(1.0)


def driver(work: Path) -> dict[str, Any]:
    import ray
    import torch
    from ray.cluster_utils import Cluster
    from vllm_refit_job import new_model

    from layoutlang.integrations.ray import start_rendezvous

    torch.manual_seed(0)
    new_model("llama").save_pretrained(work / "step0")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a dead actor's descendants (the engine's vLLM processes) are stopped with it, even when
    # it was killed: else its workers outlive it, still members of the refit session
    # (Ray reads these names as written: not upper case)
    os.environ["RAY_process_group_cleanup_enabled"] = "1"  # noqa: SIM112
    os.environ["RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"] = "true"  # noqa: SIM112
    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 8, "resources": {TRAINER_NODE: TRAINERS}, "include_dashboard": False},
    )
    nodes.add_node(num_cpus=8, resources={ENGINE_NODE: 8})
    ray.init(address=nodes.address, logging_level="ERROR", log_to_driver=False, namespace="layoutlang-test")
    result: dict[str, Any] = {"steps": {}, "tokens": {}}
    try:
        import vllm_ray_job

        started = time.perf_counter()
        # [actors]
        engine_actor = ray.remote(num_cpus=0, max_restarts=2, max_task_retries=0,
                                  resources={ENGINE_NODE: 1})(vllm_ray_job.engine_class())
        engines = [engine_actor.remote(str(work / "step0"), name != "A") for name in ENGINES]
        # [/actors]
        ray.get([e.__ray_ready__.remote() for e in engines], timeout=900)
        result["engines_start_seconds"] = time.perf_counter() - started
        result["engine_pids_before"] = ray.get([e.pid.remote() for e in engines])
        result["nodes"] = len([n for n in ray.nodes() if n["Alive"]])

        rendezvous = start_rendezvous(JOB, TRAINERS)
        trainer_actor = ray.remote(num_cpus=0, resources={TRAINER_NODE: 1})(vllm_ray_job.Trainer)
        trainers = [trainer_actor.remote(rank, str(work)) for rank in range(TRAINERS)]
        result["trainer_pids_before"] = ray.get([t.pid.remote() for t in trainers])
        result["start"] = ray.get([t.start.remote(engines) for t in trainers], timeout=600)[0]
        result["membership"] = {str(k): v for k, v in ray.get(rendezvous.membership.remote()).items()}

        def run_step(step: int, kill: int | None = None) -> None:
            pids = None
            if kill is not None:
                pids = [ray.get(engines[kill].pid.remote()), *ray.get(engines[kill].worker_pids.remote())]
            outs = ray.get([t.step.remote(step, kill, pids) for t in trainers], timeout=900)
            result["steps"][str(step)] = outs[0]
            log(f"step {step}: {outs[0]['report']}")
            serving = [i for i, state in outs[0]["states"].items() if state == "serving"]
            result["tokens"][str(step)] = {ENGINES[int(i)]: ray.get(engines[int(i)].tokens.remote(), timeout=300)
                                           for i in serving}

        run_step(1)
        run_step(2, kill=1)
        # Ray starts B's actor again (a new process, dummy weights); the trainer is not told
        wait_until_up(engines[1], timeout=900)
        # Training goes on: B is admitted at the first step boundary after the trainer's client
        # saw its new process (it probes every second; how many steps pass first depends on
        # the machine's load), then one more step refits both.
        step = 2
        while step < MAX_STEPS:
            time.sleep(STEP_SECONDS)
            step += 1
            run_step(step)
            if result["steps"][str(step)]["report"]["joined"] == [1]:
                break
        time.sleep(STEP_SECONDS)
        step += 1
        run_step(step)
        result["last_step"] = step
        result["engine_pids_after"] = ray.get([e.pid.remote() for e in engines])
        result["trainer_pids_after"] = ray.get([t.pid.remote() for t in trainers])
        for engine in engines:
            ray.kill(engine, no_restart=True)
        # the oracle: a fresh engine loaded from step 1's checkpoint; the later steps reloaded
        # through vLLM's own load_weights
        oracle = ray.remote(num_cpus=0, resources={ENGINE_NODE: 1})(vllm_ray_job.engine_class()).remote(
            str(work / "step1"), False)
        result["oracle"] = {"1": ray.get(oracle.tokens.remote(), timeout=900)}
        for step in range(2, result["last_step"] + 1):
            ray.get(oracle.reload.remote(str(work / f"step{step}")), timeout=300)
            result["oracle"][str(step)] = ray.get(oracle.tokens.remote(), timeout=300)
    finally:
        ray.shutdown()
        nodes.shutdown()
    return result


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = driver(work)
    except BaseException:
        result = {"error": traceback.format_exc()}
    (work / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
