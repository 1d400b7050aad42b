"""One vLLM engine in a process of its own, driven over a local socket: what a serving process
is to an RL framework (an engine that outlives the trainer, restarts on its own, is added and
removed while training goes on). Run with the vLLM environment's Python (``.venv-vllm``).

``python tests/vllm_engine_host.py CHECKPOINT READY_FILE [--dummy]`` starts a tensor-parallel-2
CPU engine with layoutlang's weight transfer, then listens on 127.0.0.1 (any free port) with
the authentication key in ``LAYOUTLANG_TEST_HOST_KEY`` and writes ``{"port": ..., "pid": ...}``
into READY_FILE. :class:`HostClient` calls it: the four weight-sync methods of vLLM's client
protocol (so the trainer drives it like any engine), ``generate``, ``worker_pids``, ``reload``
(a checkpoint through vLLM's own ``load_weights``, as its NCCL engine loads whole tensors),
``cast_parameter`` / ``restore_parameter`` (one worker's model changed under the weight
transfer, and put back) and ``stop``. Calls run one at a time on the engine, each connection in a thread of its own.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Any

KEY_ENV = "LAYOUTLANG_TEST_HOST_KEY"
PROMPTS = [[1, 5, 9, 20, 33], [7, 7, 3]]
NEW_TOKENS = 8


class HostClient:
    """Calls one engine host. The weight-sync methods make it a vLLM ``VLLMWeightSyncClient``."""

    def __init__(self, port: int, *, name: str = "engine"):
        self.port, self.name = port, name

    def call(self, method: str, *args: Any) -> Any:
        with Client(("127.0.0.1", self.port), authkey=os.environ[KEY_ENV].encode()) as connection:
            connection.send((method, args))
            status, value = connection.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {method} failed: {value}")
        return value

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("init_weight_transfer_engine", init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self.call("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self.call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish_weight_update", weight_version)

    def generate(self) -> dict[str, list]:
        return self.call("generate")

    def worker_pids(self) -> list[int]:
        return self.call("worker_pids")

    def stop(self) -> None:
        self.call("stop")


def _worker_pid(worker: Any) -> int:
    return os.getpid()


def cast_parameter(worker: Any, name: str, tp_rank: int, dtype: str) -> None:
    """On the worker of tensor-parallel rank ``tp_rank`` only: cast the model's parameter
    ``name`` to ``dtype`` in place (the same parameter, other data: what code of the engine
    that changes a model under the weight transfer does), keeping its data to put back."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != tp_rank:
        return
    param = dict(worker.model_runner.model.named_parameters())[name]
    worker.layoutlang_test_kept = (name, param.data)
    param.data = param.data.to(getattr(torch, dtype))


def restore_parameter(worker: Any) -> None:
    """Put back the data ``cast_parameter`` replaced (the model as it was)."""
    kept = getattr(worker, "layoutlang_test_kept", None)
    if kept is None:
        return
    name, data = kept
    dict(worker.model_runner.model.named_parameters())[name].data = data
    del worker.layoutlang_test_kept


def reload_whole_tensors(worker: Any, checkpoint: str) -> None:
    """vLLM's own path for whole tensors, run on each worker: every checkpoint tensor into
    ``load_weights`` under the layerwise-reload lifecycle (what vLLM's NCCL engine does)."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    model.load_weights(list(load_file(f"{checkpoint}/model.safetensors").items()))
    finalize_layerwise_reload(model, worker.model_runner.model_config)


def serve(checkpoint: str, ready: Path, dummy: bool) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # sized below: 1 GiB (its least) per worker is too much here
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # worker_pids runs a function on workers
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLM(
        model=checkpoint,
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=128,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=64 * 2**20,
        enforce_eager=True,
        seed=0,
        load_format="dummy" if dummy else "auto",
        weight_transfer_config={"backend": "layoutlang"},
    )
    lock = threading.Lock()
    stopping = threading.Event()

    def generate() -> dict[str, list]:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, detokenize=False)
        outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [[s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
        return {"tokens": tokens, "logprobs": logprobs}

    methods = {
        "generate": generate,
        "worker_pids": lambda: engine.llm_engine.collective_rpc(_worker_pid),
        "reload": lambda path: engine.llm_engine.collective_rpc(reload_whole_tensors, args=(path,)) and None,
        "cast_parameter": lambda *args: engine.llm_engine.collective_rpc(cast_parameter, args=args) and None,
        "restore_parameter": lambda: engine.llm_engine.collective_rpc(restore_parameter) and None,
        "init_weight_transfer_engine": lambda info: engine.init_weight_transfer_engine({"init_info": info}),
        "shutdown_weight_transfer_engine": engine.shutdown_weight_transfer_engine,
        "start_weight_update": engine.start_weight_update,
        "update_weights": lambda info: engine.update_weights({"update_info": info}),
        "finish_weight_update": engine.finish_weight_update,
        "stop": stopping.set,
    }

    def answer(connection: Any) -> None:
        with connection:
            method, args = connection.recv()
            try:
                with lock:
                    value = methods[method](*args)
                connection.send(("ok", value))
            except Exception as err:
                connection.send(("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"))

    listener = Listener(("127.0.0.1", 0), authkey=os.environ[KEY_ENV].encode())
    ready.write_text(json.dumps({"port": listener.address[1], "pid": os.getpid()}))

    def accept() -> None:
        while not stopping.is_set():
            try:
                connection = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    stopping.wait()
    listener.close()
    engine.llm_engine.engine_core.shutdown()
    os._exit(0)


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]), "--dummy" in sys.argv[3:])
