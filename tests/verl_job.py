"""verl weight updates through layoutlang's checkpoint engine, run by tests/test_verl.py with
.venv-verl's Python (verl 0.9.1 installed there).

The controller here makes the calls verl's ``CheckpointEngineManager.update_weights`` makes,
to worker processes (Ray actors in verl; spawned processes here): ``prepare`` on every
actor and rollout worker, the registered class's ``build_topology``, ``init_process_group``
with its kwargs, then the actor workers' ``update_weights`` (``send_weights`` of a
per-tensor generator, as ``ActorRolloutRefWorker.update_weights`` does) beside the rollout
workers' (``server_adapter.update_weights(engine.receive_weights())``, as
``CheckpointEngineWorker.update_weights`` does), then ``finalize``. Engines are made as verl
makes them: ``CheckpointEngineConfig`` -> ``import_external_libs(custom_backend_module)`` ->
``CheckpointEngineRegistry.new(backend, bucket_size=..., **engine_kwargs[backend])``.

Actor workers train a tiny Llama (transformers) under FSDP2 over gloo with Adam; before each
update actor rank 0 saves every parameter's ``full_tensor()`` (the oracle) and each rollout
worker saves what its server adapter received, for the test to compare.

The workers start once (importing verl and torch takes most of a job's time) and serve every
scenario in turn, each with engines of its own (as a restarted verl job would make them: a
store of its own, a new session), its files under ``OUT/<scenario>/``:

- ``dtensor``: 2 updates from the actors' FSDP2 ``state_dict()`` (the DTensor fast path);
- ``whole``: 1 update from ``full_tensor()`` of every parameter (verl's generator, the fallback);
- ``secret``: rollout worker 1 (rank 3) holds another job secret (in its environment);
- ``missing``: rollout worker 1 (rank 3) never calls in (its engine is never made), timeout 8 s.

``OUT/results.json`` records each scenario (written after each one): the actors' update
metrics, the first error the controller saw (as verl's controller raises the first failed
call) and every worker's error, and the seconds it took; ``imports`` says where each worker
imported layoutlang from.

Usage: verl_job.py OUT [--scenario NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from typing import Any

SECRET = "6c61796f75746c616e672d7665726c2d746573742d7365637265742d30303031"
OTHER_SECRET = "6f746865722d7365637265742d6f746865722d7365637265742d6f7468657221"
ACTORS, ROLLOUTS = 2, 2
STARTED = time.monotonic()
#: name -> (weights given to send_weights, updates, engine timeout, the process with another
#: secret, the process that never calls in)
SCENARIOS: dict[str, tuple[str, int, float, int | None, int | None]] = {
    "dtensor": ("dtensor", 2, 60.0, None, None),
    "whole": ("whole", 1, 60.0, None, None),
    "secret": ("dtensor", 1, 60.0, 3, None),
    "missing": ("dtensor", 1, 8.0, None, 3),
}


def _engine(rank: int, is_actor: bool, timeout: float) -> Any:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
    from verl.workers.config import CheckpointEngineConfig

    config = CheckpointEngineConfig(
        backend="layoutlang", update_weights_bucket_megabytes=1,
        engine_kwargs={"layoutlang": {"timeout": timeout, "deadline": 2.0}},
        custom_backend_module="layoutlang.integrations.verl.engine",
    )
    import_external_libs(config.custom_backend_module)
    kwargs = dict(config.engine_kwargs.get(config.backend, {}))
    bucket_size = config.update_weights_bucket_megabytes << 20
    if is_actor:  # ActorRolloutRefWorker
        return CheckpointEngineRegistry.new(config.backend, is_master=(rank == 0), bucket_size=bucket_size, **kwargs)
    return CheckpointEngineRegistry.new(config.backend, bucket_size=bucket_size, **kwargs)  # CheckpointEngineWorker


class Worker:
    """One worker process's engines, one per scenario (``engine``), and its updates."""

    def __init__(self, rank: int, out: str):
        self.rank, self.out = rank, out
        self.engines: dict[str, Any] = {}

    def hello(self) -> dict[str, Any]:
        import layoutlang

        return {"pid": os.getpid(), "layoutlang": layoutlang.__file__}

    def engine(self, scenario: str, timeout: float, bad_secret: bool = False) -> None:
        """Make this scenario's engine, as verl's worker does at its start; ``bad_secret``: with
        another job secret in this process's environment."""
        if bad_secret:
            os.environ["LAYOUTLANG_JOB_SECRET"] = OTHER_SECRET
        try:
            self.engines[scenario] = _engine(self.rank, self.rank < ACTORS, timeout)
        finally:
            os.environ["LAYOUTLANG_JOB_SECRET"] = SECRET
        self.made(scenario)

    def made(self, scenario: str) -> None:
        """What a role keeps beside an engine (a rollout worker's server adapter)."""

    def path(self, scenario: str, name: str) -> str:
        return os.path.join(self.out, scenario, name)

    def update(self, scenario: str, step: int, **kwargs: Any) -> Any:
        raise NotImplementedError

    def stop(self, scenario: str) -> None:
        self.engines.pop(scenario).shutdown()


class Actor(Worker):
    def __init__(self, rank: int, out: str, port: int):
        super().__init__(rank, out)
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ACTORS)
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        self.model = LlamaForCausalLM(config)
        mesh = init_device_mesh("cpu", (ACTORS,), mesh_dim_names=("fsdp",))
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.data = torch.Generator().manual_seed(rank)

    def update(self, scenario: str, step: int, path: str = "dtensor") -> Any:  # type: ignore[override]
        import torch

        ids = torch.randint(0, 96, (2, 8), generator=self.data)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        state = self.model.state_dict()
        oracle = {name: p.full_tensor().detach().clone() for name, p in state.items()}  # collective
        if self.rank == 0:
            torch.save(oracle, self.path(scenario, f"oracle-{step}.pt"))
        if path == "dtensor":  # each rank's own shards: layoutlang's fast path
            weights = ((name, p) for name, p in self.model.state_dict().items())
        else:  # verl's FSDP engine's get_per_tensor_param(): every rank all-gathers every tensor
            weights = ((name, p.full_tensor()) for name, p in self.model.state_dict().items())
        return asyncio.run(self.engines[scenario].send_weights(weights, global_steps=step))


class Rollout(Worker):
    def __init__(self, rank: int, out: str):
        super().__init__(rank, out)
        self.adapters: dict[str, Any] = {}

    def made(self, scenario: str) -> None:
        import torch
        from verl.workers.rollout import BaseRollout

        class Adapter(BaseRollout):
            """A server adapter that keeps what it is given (verl's tests' MockServerAdapter)."""

            def __init__(self) -> None:
                super().__init__(config=None, model_config=None, device_mesh=None)
                self.received: dict[str, torch.Tensor] = {}

            async def resume(self, tags: list[str]) -> None:
                raise NotImplementedError

            async def release(self) -> None:
                raise NotImplementedError

            async def update_weights(self, weights: Any, **kwargs: Any) -> None:
                async for name, weight in weights:
                    self.received[name] = weight.clone()

        self.adapters[scenario] = Adapter()

    def update(self, scenario: str, step: int, **kwargs: Any) -> Any:
        import torch

        engine, adapter = self.engines[scenario], self.adapters[scenario]

        async def run() -> None:  # CheckpointEngineWorker.update_weights
            await adapter.update_weights(engine.receive_weights(global_steps=step), global_steps=step,
                                         wire_format=getattr(engine, "wire_format", "named_tensors"))
        asyncio.run(run())
        torch.save(adapter.received, self.path(scenario, f"rollout-{self.rank}-{step}.pt"))
        return None


def worker(rank: int, port: int, out: str, conn: Any) -> None:
    os.environ["LAYOUTLANG_JOB_SECRET"] = SECRET
    state: Worker = Actor(rank, out, port) if rank < ACTORS else Rollout(rank, out)
    while True:
        method, kwargs = conn.recv()
        if method == "exit":  # at once: threads of abandoned groups may still wait in gloo
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            if method in ("hello", "engine", "update", "stop"):
                result = getattr(state, method)(**kwargs)
            else:  # the engine's own methods
                scenario = kwargs.pop("scenario")
                result = getattr(state.engines[scenario], method)(**kwargs)
            conn.send(("ok", result))
        except BaseException as err:  # reported to the controller, as a Ray actor's error is
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


class CallsFailed(Exception):
    """Some calls failed: ``errors`` maps each failed worker's name to its error (the first in
    the order of the calls is the message, as verl's controller raises the first one)."""

    def __init__(self, errors: dict[str, str]):
        super().__init__(next(iter(errors.values())))
        self.errors = errors


class Broken(Exception):
    """A worker did not answer: its pipe is out of step, no later scenario can run."""


class Workers:
    def __init__(self, conns: list[Any], names: list[str]):
        self.conns, self.names = conns, names

    def call(self, calls: list[tuple[int, str, dict[str, Any]]], timeout: float) -> list[Any]:
        """Every call at once; every answer is read before a failure is raised."""
        begin = time.monotonic()
        for index, method, kwargs in calls:
            self.conns[index].send((method, kwargs))
        results, errors = [], {}
        for index, method, _ in calls:
            if not self.conns[index].poll(max(0.0, begin + timeout - time.monotonic())):
                raise Broken(f"{self.names[index]}: {method} did not answer in {timeout:g} s")
            status, value = self.conns[index].recv()
            if status == "error":
                errors[self.names[index]] = f"{self.names[index]}: {method} failed: {value}"
            results.append(value)
        now = time.monotonic()
        print(f"{calls[0][1]}: {now - begin:.1f} s (at {now - STARTED:.1f} s)", file=sys.stderr)
        if errors:
            raise CallsFailed(errors)
        return results


def run_scenario(workers: Workers, name: str, out: str) -> dict[str, Any]:
    """One scenario (see the module doc) on its own engines, from their making to their shutdown."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    path, steps, timeout, bad_secret, absent = SCENARIOS[name]
    os.makedirs(os.path.join(out, name), exist_ok=True)
    total = ACTORS + ROLLOUTS
    live = [i for i in range(total) if i != absent]
    limit = timeout + 60
    engine_cls = CheckpointEngineRegistry.get("layoutlang")
    record: dict[str, Any] = {"metrics": [], "error": None, "errors": {}}
    begin = time.monotonic()
    workers.call([(i, "engine", {"scenario": name, "timeout": timeout, "bad_secret": i == bad_secret})
                  for i in live], limit)
    try:
        for step in range(steps):
            # CheckpointEngineManager.build_process_group
            metadata = workers.call([(i, "prepare", {"scenario": name}) for i in live], limit)
            actor_kwargs, rollout_kwargs = engine_cls.build_topology(ACTORS, ROLLOUTS, metadata)
            calls = [(i, "init_process_group", {"scenario": name, **{k: v[i] for k, v in actor_kwargs.items()}})
                     for i in range(ACTORS)]
            calls += [(ACTORS + j, "init_process_group",
                       {"scenario": name, **{k: v[j] for k, v in rollout_kwargs.items()}}) for j in range(ROLLOUTS)]
            workers.call([c for c in calls if c[0] in live], limit)
            # CheckpointEngineManager.update_weights: actors and rollouts at once
            results = workers.call([(i, "update", {"scenario": name, "step": step, "path": path}) for i in live],
                                   limit)
            record["metrics"].append(results[:ACTORS])
            workers.call([(i, "finalize", {"scenario": name}) for i in live], limit)
    except CallsFailed as err:
        record["error"], record["errors"] = str(err), err.errors
    record["seconds"] = time.monotonic() - begin
    workers.call([(i, "stop", {"scenario": name}) for i in live], limit)
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only these (default: every one, in order)")
    args = parser.parse_args()
    with socket.socket() as sock:  # a free port for the actors' own gloo group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    names = [f"actor {i}" for i in range(ACTORS)] + [f"rollout worker {j}" for j in range(ROLLOUTS)]
    for index in range(ACTORS + ROLLOUTS):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(index, port, args.out, child), daemon=True)
        proc.start()
        conns.append(parent)
        procs.append(proc)
    # while the workers start (as custom_backend_module does in verl's controller)
    import layoutlang.integrations.verl.engine  # noqa: F401

    workers = Workers(conns, names)
    results: dict[str, Any] = {}
    path = os.path.join(args.out, "results.json")
    code = 0
    try:
        # the workers start (imports of verl and torch: slow on 2 cores)
        results["imports"] = {names[i]: hello["layoutlang"]
                              for i, hello in enumerate(workers.call([(i, "hello", {}) for i in range(len(names))],
                                                                     240))}
        for name in args.scenario or list(SCENARIOS):
            results[name] = run_scenario(workers, name, args.out)
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    except (Broken, CallsFailed) as err:
        print(f"FAILED: {err}", file=sys.stderr)
        code = 1
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    for conn in conns:
        conn.send(("exit", {}))
    deadline = time.monotonic() + 10
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    print(f"done at {time.monotonic() - STARTED:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
