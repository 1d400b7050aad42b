"""A verl weight update through layoutlang's checkpoint engine, run by tests/test_verl.py with
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

Usage: verl_job.py OUT --path dtensor|whole [--steps N] [--bad-secret-rank R] [--absent-rank R]
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


def actor(rank: int, world: int, port: int, conn: Any, args: argparse.Namespace) -> None:
    os.environ["LAYOUTLANG_JOB_SECRET"] = SECRET
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(rank)
    engine = _engine(rank, True, args.timeout)
    serve(conn, engine, actor_update(model, optimizer, data, engine, rank, args))


def actor_update(model: Any, optimizer: Any, data: Any, engine: Any, rank: int, args: argparse.Namespace) -> Any:
    import torch

    def update(step: int) -> Any:
        ids = torch.randint(0, 96, (2, 8), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = model.state_dict()
        oracle = {name: p.full_tensor().detach().clone() for name, p in state.items()}  # collective
        if rank == 0:
            torch.save(oracle, os.path.join(args.out, f"oracle-{step}.pt"))
        if args.path == "dtensor":  # each rank's own shards: layoutlang's fast path
            weights = ((name, p) for name, p in model.state_dict().items())
        else:  # verl's FSDP engine's get_per_tensor_param(): every rank all-gathers every tensor
            weights = ((name, p.full_tensor()) for name, p in model.state_dict().items())
        return asyncio.run(engine.send_weights(weights, global_steps=step))

    return update


def rollout(rank: int, conn: Any, args: argparse.Namespace) -> None:
    os.environ["LAYOUTLANG_JOB_SECRET"] = OTHER_SECRET if rank == args.bad_secret_rank else SECRET
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

    engine = _engine(rank, False, args.timeout)
    adapter = Adapter()

    def update(step: int) -> Any:
        async def run() -> None:  # CheckpointEngineWorker.update_weights
            await adapter.update_weights(engine.receive_weights(global_steps=step), global_steps=step,
                                         wire_format=getattr(engine, "wire_format", "named_tensors"))
        asyncio.run(run())
        torch.save(adapter.received, os.path.join(args.out, f"rollout-{rank}-{step}.pt"))
        return None

    serve(conn, engine, update)


def serve(conn: Any, engine: Any, update: Any) -> None:
    while True:
        method, kwargs = conn.recv()
        try:
            if method == "stop":
                engine.shutdown()
                conn.send(("ok", None))
                return
            result = update(**kwargs) if method == "update" else getattr(engine, method)(**kwargs)
            conn.send(("ok", result))
        except BaseException as err:  # reported to the controller, as a Ray actor's error is
            conn.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


class Workers:
    def __init__(self, conns: list[Any], names: list[str]):
        self.conns, self.names = conns, names

    def call(self, calls: list[tuple[int, str, dict[str, Any]]], timeout: float) -> list[Any]:
        begin = time.monotonic()
        for index, method, kwargs in calls:
            self.conns[index].send((method, kwargs))
        results = []
        for index, method, _ in calls:
            if not self.conns[index].poll(timeout):
                raise RuntimeError(f"{self.names[index]}: {method} did not answer in {timeout:g} s")
            status, value = self.conns[index].recv()
            if status == "error":
                raise RuntimeError(f"{self.names[index]}: {method} failed: {value}")
            results.append(value)
        print(f"{calls[0][1]}: {time.monotonic() - begin:.1f} s", file=sys.stderr)
        return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--path", choices=["dtensor", "whole"], default="dtensor")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--bad-secret-rank", type=int, default=-1)
    parser.add_argument("--absent-rank", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import layoutlang.integrations.verl.engine  # noqa: F401  (as custom_backend_module does in verl's controller)

    with socket.socket() as sock:  # a free port for the actors' own gloo group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    conns, procs, names = [], [], []
    total = args.actors + args.rollouts
    for index in range(total):
        parent, child = ctx.Pipe()
        if index < args.actors:
            proc = ctx.Process(target=actor, args=(index, args.actors, port, child, args), daemon=True)
            names.append(f"actor {index}")
        else:
            proc = ctx.Process(target=rollout, args=(index, child, args), daemon=True)
            names.append(f"rollout worker {index - args.actors}")
        proc.start()
        conns.append(parent)
        procs.append(proc)
    workers = Workers(conns, names)
    live = [i for i in range(total) if i != args.absent_rank]
    limit = args.timeout + 60
    metrics: list[Any] = []
    try:
        engine_cls = CheckpointEngineRegistry.get("layoutlang")
        for step in range(args.steps):
            # CheckpointEngineManager.build_process_group
            # the first call also waits for the workers to start (imports of verl and torch: slow on 2 cores)
            metadata = workers.call([(i, "prepare", {}) for i in range(total)], limit if step else 240)
            actor_kwargs, rollout_kwargs = engine_cls.build_topology(args.actors, args.rollouts, metadata)
            calls = [(i, "init_process_group", {k: v[i] for k, v in actor_kwargs.items()}) for i in range(args.actors)]
            calls += [(args.actors + j, "init_process_group", {k: v[j] for k, v in rollout_kwargs.items()})
                      for j in range(args.rollouts)]
            workers.call([c for c in calls if c[0] in live], limit)
            # CheckpointEngineManager.update_weights: actors and rollouts at once
            results = workers.call([(i, "update", {"step": step}) for i in live], limit)
            metrics.append(results[: args.actors])
            workers.call([(i, "finalize", {}) for i in live], limit)
        workers.call([(i, "stop", {}) for i in live], limit)
    except RuntimeError as err:
        print(f"FAILED: {err}", file=sys.stderr)
        with open(os.path.join(args.out, "error.txt"), "w") as f:
            f.write(str(err))
        for proc in procs:
            proc.kill()
        return 1
    with open(os.path.join(args.out, "metrics.json"), "w") as f:
        json.dump(metrics, f)
    deadline = time.monotonic() + 10
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
