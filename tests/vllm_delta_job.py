"""Delta refits of live bf16 vLLM engines during real training (issue 25's acceptance), run with
the vLLM environment's Python (``.venv-vllm``) by tests/test_vllm_delta.py, which asserts on
what it records. Nothing here asserts.

``python tests/vllm_delta_job.py WORKDIR [--models llama,qwen3_moe] [--lrs 1e-6,1e-5] [--steps 10]``
starts 2 gloo trainer processes. For each model (the tiny Llama and Qwen3-MoE of
tests/vllm_refit_job.py, vocabulary 256 so that vLLM pads nothing), one after the other:

- trainer rank 0 starts three vLLM CPU engines (tensor parallel 1, bf16, eager): engines A and B
  with random ("dummy") weights, refitted by layoutlang's weight-transfer engine with
  ``delta=True`` (one refit session per model, engine axis of 2), and the reference engine R,
  loaded by vLLM from the trainer's initial checkpoint, which layoutlang never touches;
- for each learning rate, the trainer starts again from the same initial weights (seeded):
  fp32 master weights as FSDP2 DTensors, bf16 forward and backward with fp32 gradient
  reductions (``MixedPrecisionPolicy``), AdamW, random token batches, as
  benchmarks/bench_delta_density.py trains. The refit session carries on: the first refit of
  the second learning rate is a delta against what the engines hold (the first run's last step);
- after every optimizer step: every trainer rank gathers the bf16 cast of the weights, and the
  fraction of bf16 elements whose bits changed is counted (the benchmark's ``compare``); the
  engines are refitted (``send_weights()``: each trainer rank sends the bf16 cast of its own
  shards; its ``DeltaReport`` gives the bytes on the wire against dense and the encodings);
  rank 0 saves the bf16 weights as a safetensors checkpoint (``save_pretrained``), reloads R
  in place from it through vLLM's own loader, and records the greedy tokens and logprobs of
  A, B and R for fixed prompts, and a digest of every weight each engine computes with;
- the oracle R is checked against a truly fresh engine loaded from the checkpoint of the last
  step of each learning rate (same tokens, logprobs and weight digests);
- in the middle of each learning rate's run (step k: 4 of 10, then 6 of 10), engine B is
  restarted: before step k's refit it leaves the session on purpose (``remove_engine``: the
  engine axis shrinks, a new generation, so that refit is dense), is stopped and started again
  (a new process, dummy weights); before step k+1's it is added (``add_engine``): admitted at
  that step's boundary and caught up from A. Step k+2 starts a new generation again (the axis
  grew): dense for both engines, then deltas. (Removing and adding before the same refit
  stalled here: the sender's ``send_weights()`` waited its whole timeout for the joiner to ask
  to join, in ``_await_joiners``, before going on.)

The oracle is vLLM's loader, not layoutlang. vLLM 0.32's in-place reload
(``Worker.reload_weights``: ``load_weights`` under its layerwise reload) is right for the Llama;
for the Qwen3-MoE it skips the CPU experts' prepack (``UnquantizedFusedMoEMethod`` runs the
experts kernel's ``process_weights_after_loading`` on the first load only), so R also runs that
kernel step after each reload (:func:`load_checkpoint`): with it, a reloaded engine holds
bit-for-bit the weights of a fresh engine (checked at the fresh steps, every weight digested).

The weight digest (:func:`held_weights`) covers every non-empty parameter (norms, embeddings,
the experts' packed tensors) and every linear layer's CPU kernel, which holds its weight in an
opaque oneDNN handle (``named_parameters()`` shows it empty): the kernel is run on an identity
matrix, which gives back exactly the bf16 weight it computes with.

Everything goes to WORKDIR/result.json (rank 0's record: per model, learning rate and step);
the per-step figures are printed as they come and written to WORKDIR/figures.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

# one bound OpenMP thread per engine (set per engine below: the same kernels in every engine)
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
# the digests and the reference's reload run functions on the engines' workers
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import attrs
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # (this script's folder is on it)
from bench_delta_density import compare, full_bf16  # the changed fraction, counted as the benchmark does
from vllm_elastic_job import free_port
from vllm_refit_job import MODELS, TRAINERS, log, train_layout_of

from layoutlang.integrations.vllm.trainer import StateDictSource

#: seconds any wait of a refit session may take; a member silent for DEADLINE seconds is
#: suspected (generous: the machine is shared, and engines start while the session runs)
TIMEOUT = 120.0
DEADLINE = 10.0
#: the job gives up after this many seconds (the test's own timeout is longer)
JOB_SECONDS = 1500
SEED = 0
#: as benchmarks/bench_delta_density.py trains: sequences of tokens per rank and step
BATCH, SEQ, WEIGHT_DECAY = 4, 32, 0.01
VOCAB = 256  # a multiple of 64: vLLM pads no vocabulary rows, so every weight it holds is trained
#: 16 fixed prompts of 4 to 16 random token ids, 16 greedy tokens each: at a learning rate of
#: 1e-5 some of them change at most steps (a few prompts of repeated tokens never do)
PROMPTS = [torch.randint(0, VOCAB, (int(n),), generator=torch.Generator().manual_seed(i)).tolist()
           for i, n in enumerate(torch.randint(4, 17, (16,), generator=torch.Generator().manual_seed(7)))]
NEW_TOKENS = 16


def new_model(name: str) -> torch.nn.Module:
    """The tiny model of tests/vllm_refit_job.py, fp32, with a vocabulary of 256."""
    import transformers

    spec = MODELS[name]
    config = transformers.AutoConfig.for_model(name, **{**spec["config"], "vocab_size": VOCAB})
    return getattr(transformers, spec["architecture"])(config).float()


def save_checkpoint(name: str, weights: dict[str, torch.Tensor], path: Path) -> None:
    """``save_pretrained`` of a model holding ``weights`` (bf16): what vLLM loads."""
    model = new_model(name).to(torch.bfloat16)
    model.load_state_dict(weights)
    model.save_pretrained(path)


def program_text(name: str, checkpoint: Path, train_layout: str) -> str:
    """The refit's program: the bf16 cast of the training layout into 2 engines of tensor parallel 1."""
    return (
        f'tensors from hf "{checkpoint / "config.json"}" as cfg dtype bf16\n'
        + train_layout
        + f"mesh infer [dp = 2, tp = 1] on ranks {TRAINERS}..{TRAINERS + 1}\n"
        + f'include "preset:{MODELS[name]["preset"]}"\n'
        + "reshard refit: train -> vllm_fused\n"
    )


# ------------------------------------------------------------------------------ engines

#: every engine this process started, stopped on the way out whatever happens
STARTED: list[Any] = []


def start_engine(checkpoint: Path, *, dummy: bool = False, refitted: bool = False, core: int = 0) -> Any:
    """A vLLM CPU engine: bf16, tensor parallel 1, bound to one core. ``refitted``: with
    layoutlang's weight transfer (the oracle engines are plain vLLM)."""
    from vllm import LLM

    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)  # read by the engine's worker when it starts
    extra = {"weight_transfer_config": {"backend": "layoutlang"}} if refitted else {}
    engine = LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        tensor_parallel_size=1,
        dtype="bfloat16",
        max_model_len=128,
        gpu_memory_utilization=0.05,
        kv_cache_memory_bytes=32 * 2**20,
        enforce_eager=True,
        seed=0,
        load_format="dummy" if dummy else "auto",
        **extra,
    )
    STARTED.append(engine)
    return engine


def stop(engine: Any) -> None:
    if engine in STARTED:
        STARTED.remove(engine)
        with contextlib.suppress(Exception):
            engine.llm_engine.engine_core.shutdown()
    gc.collect()


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:20]


def held_weights(worker: Any) -> dict[str, str]:
    """On an engine's worker: a digest of every weight its model computes with. Non-empty
    parameters by their bytes; each linear layer's CPU kernel (vLLM keeps the weight in a
    oneDNN handle and leaves the parameter empty) by its output for an identity matrix, which
    is the bf16 weight itself, transposed (one product of 1 and the weight per element)."""
    model = worker.model_runner.model
    out = {name: _digest(p) for name, p in model.named_parameters() if p.numel()}
    with torch.no_grad():
        for name, module in model.named_modules():
            kernel, weight = getattr(module, "cpu_linear", None), getattr(module, "weight", None)
            if kernel is None or weight is None:
                continue
            handles = [c.cell_contents for c in kernel.__closure__ or () if hasattr(c.cell_contents, "handler_tensor")]
            k = handles[0].k if handles else weight.shape[-1] if weight.numel() else module.input_size_per_partition
            out[f"{name} (kernel)"] = _digest(kernel(torch.eye(k, dtype=weight.dtype), None, None))
    return out


def load_checkpoint(worker: Any, checkpoint: str) -> int:
    """On the reference engine's worker: vLLM's own in-place reload of a checkpoint, then the
    MoE experts' CPU prepack that vLLM 0.32 runs only on a first load (a no-op for the Llama).
    Returns how many MoE layers were repacked."""
    worker.reload_weights(weights_path=checkpoint)
    repacked = 0
    for module in worker.model_runner.model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        process = getattr(getattr(kernel, "fused_experts", None), "process_weights_after_loading", None)
        if process is not None:
            process(module)
            repacked += 1
    return repacked


def observe(engine: Any) -> dict[str, Any]:
    """An engine's greedy tokens for the fixed prompts with the logprob of each, and its
    weights' digest."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=0, detokenize=False)
    outputs = [o.outputs[0] for o in engine.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                                                      use_tqdm=False)]
    return {
        "tokens": [list(o.token_ids) for o in outputs],
        "logprobs": [[step[t].logprob for step, t in zip(o.logprobs, o.token_ids)] for o in outputs],
        "weights": engine.llm_engine.collective_rpc(held_weights)[0],
    }


# ------------------------------------------------------------------------------ trainer


class ServedCast(StateDictSource):
    """The trainer's weights as the engines serve them: each fp32 master (an FSDP2 DTensor)
    cast to bf16 on its own rank, no communication; read afresh at every refit, from the model
    of the current run."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {name: t.detach().to(torch.bfloat16) for name, t in self.model.state_dict().items()}


def sharded_model(name: str) -> torch.nn.Module:
    """The initial weights (seeded, the same on every rank), sharded by FSDP2 as the benchmark does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(SEED)
    model = new_model(name)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def plan_of(steps: int, runs: int) -> tuple[list[int], list[int]]:
    """Per run: the step before whose refit engine B is restarted, and the step checked
    against a fresh engine (the last)."""
    restarts = [max(2, (steps * (4 + 2 * i)) // 10) for i in range(runs)]
    return [min(r, steps) for r in restarts], [steps] * runs


def figures_line(row: dict[str, Any]) -> str:
    m = row["messages"]
    engine = "-" if row["changed_vs_engine"] is None else f"{row['changed_vs_engine']:.3%}"
    return (
        f"{row['model']:<9} {row['lr']:>6.0e} {row['step']:>4} {row['fraction']:>10.3%} {engine:>9} "
        f"{row['wire_bytes']:>10,} {row['dense_bytes']:>10,} {row['ratio']:>7.3f}  "
        f"{m.get('dense', 0)}/{m.get('bitmask', 0)}/{m.get('indices', 0)}  {row['event']}"
    )


FIGURES_HEADER = (
    f"{'model':<9} {'lr':>6} {'step':>4} {'bf16 chg':>10} {'vs held':>9} {'wire B':>10} {'dense B':>10} "
    f"{'w/d':>7}  d/b/i  event"
)


def refit_model(rank: int, name: str, work: Path, port: int, args: argparse.Namespace) -> dict[str, Any]:
    """One model: its engines, one refit session, a run per learning rate."""
    from layoutlang.integrations.vllm.trainer import (
        LayoutlangTrainerInitInfo,
        LayoutlangTrainerWeightTransferEngine,
        OfflineLLMClient,
    )

    out: dict[str, Any] = {"model": name, "runs": []}
    model = sharded_model(name)
    initial = full_bf16(model)  # every rank gathers
    step0 = work / name / "step0"
    engines: dict[str, Any] = {}
    if rank == 0:
        save_checkpoint(name, {k: bits.view(torch.bfloat16) for k, (_, bits) in initial.items()}, step0)
        begin = time.perf_counter()
        engines = {
            "A": start_engine(step0, dummy=True, refitted=True, core=0),
            "B": start_engine(step0, dummy=True, refitted=True, core=1),
        }
        reference = start_engine(step0, core=0)
        out["engines_start_seconds"] = time.perf_counter() - begin
        out["initial"] = observe(reference)
        log(f"{name}: 3 engines started in {out['engines_start_seconds']:.0f} s")
    dist.barrier()
    source = ServedCast(model)
    train_layout = train_layout_of(name, model)
    info = LayoutlangTrainerInitInfo(
        rank=rank, master_address="127.0.0.1", master_port=port, program=program_text(name, step0, train_layout),
        timeout=TIMEOUT, deadline=DEADLINE, namespace=f"delta-{name}", delta=True,
    )
    clients = [OfflineLLMClient(engines[n]) for n in ("A", "B")] if rank == 0 else []
    refit = LayoutlangTrainerWeightTransferEngine.trainer_init(info, client=clients, source=source)
    index = {"A": 0, "B": 1}  # engine names -> their index in the trainer engine
    pending: dict[str, Any] = {}  # B started again, added at the next step
    restarts, fresh_steps = plan_of(args.steps, len(args.lrs))
    held = None  # the bf16 weights the engines hold (the last refit's)
    try:
        for run, lr in enumerate(args.lrs):
            if run:
                model = source.model = sharded_model(name)  # the trainer starts again from the initial weights
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, foreach=False)
            data = torch.Generator().manual_seed(SEED * 1000 + rank)  # each rank its own batches
            previous = initial
            rows: list[dict[str, Any]] = []
            out["runs"].append({"lr": lr, "restart_at": restarts[run], "fresh_at": [fresh_steps[run]], "steps": rows})
            for step in range(1, args.steps + 1):
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=data)
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                current = full_bf16(model)
                event = ""
                if rank == 0 and step == restarts[run]:
                    event = stop_b(refit, engines, index, pending, step0)
                elif rank == 0 and pending:
                    event = add_b(refit, engines, index, pending)
                dist.barrier()
                begin = time.perf_counter()
                report = refit.send_weights()
                seconds = time.perf_counter() - begin
                deltas: list[Any] = [None] * TRAINERS
                dist.all_gather_object(deltas, None if report.delta is None else attrs.asdict(report.delta))
                if rank == 0:
                    row = {"model": name, "lr": lr, "step": step, "loss": float(loss.detach()), "event": event,
                           "seconds": seconds, **compare(previous, current)}
                    row["changed_vs_engine"] = None if held is None else compare(held, current)["fraction"]
                    row |= wire_figures(deltas)
                    row["report"] = report.to_json()
                    row |= oracle(name, current, work / name / f"lr{lr:g}" / f"step{step}", engines, reference,
                                  fresh=step == fresh_steps[run])
                    row["engine_index"] = dict(index)
                    rows.append(row)
                    print(figures_line(row), flush=True)
                    with open(work / "figures.txt", "a") as figures:
                        figures.write(figures_line(row) + "\n")
                previous = held = current
    finally:
        refit.shutdown()
        if rank == 0:
            for engine in [*engines.values(), *pending.values(), reference]:
                stop(engine)
    return out


def stop_b(refit: Any, engines: dict[str, Any], index: dict[str, int], pending: dict[str, Any],
           checkpoint: Path) -> str:
    """Engine B leaves the session on purpose (the engine axis shrinks at this step) and is
    stopped; a new engine process (random weights) is started in its place, to be added at the
    next step (an engine asks to join between steps)."""
    old = index.pop("B")
    refit.remove_engine(old)
    stop(engines.pop("B"))
    begin = time.perf_counter()
    pending["B"] = start_engine(checkpoint, dummy=True, refitted=True, core=1)
    log(f"engine B (index {old}) left and was stopped; started again in {time.perf_counter() - begin:.0f} s")
    return f"B (engine {old}) left, stopped, started again"


def add_b(refit: Any, engines: dict[str, Any], index: dict[str, int], pending: dict[str, Any]) -> str:
    """The restarted engine B asks to join: admitted at this step's boundary, caught up from A."""
    from layoutlang.integrations.vllm.trainer import OfflineLLMClient

    engines["B"] = pending.pop("B")
    index["B"] = refit.add_engine(OfflineLLMClient(engines["B"])).index
    return f"B added (engine {index['B']})"


def wire_figures(deltas: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The trainer ranks' delta reports of one refit, summed."""
    present = [d for d in deltas if d is not None]
    messages: dict[str, int] = {}
    for d in present:
        for encoding, count in d["messages"].items():
            messages[encoding] = messages.get(encoding, 0) + count
    wire = sum(d["wire_bytes"] for d in present)
    dense = sum(d["dense_bytes"] for d in present)
    return {
        "wire_bytes": wire, "dense_bytes": dense, "ratio": wire / dense if dense else 1.0, "messages": messages,
        "stale": sorted({s for d in present for s in d["stale"]}), "kept_bytes": [d["kept_bytes"] for d in present],
        "ranks_reporting": len(present),
    }


def oracle(name: str, current: dict[str, Any], checkpoint: Path, engines: dict[str, Any], reference: Any, *,
           fresh: bool) -> dict[str, Any]:
    """After a refit: the step's checkpoint, the reference reloaded from it by vLLM, and what
    every engine generates and holds (a fresh engine too at ``fresh`` steps)."""
    save_checkpoint(name, {k: bits.view(torch.bfloat16) for k, (_, bits) in current.items()}, checkpoint)
    repacked = reference.llm_engine.collective_rpc(load_checkpoint, args=(str(checkpoint),))[0]
    out: dict[str, Any] = {
        "engines": {n: observe(e) for n, e in engines.items()},
        "reference": observe(reference) | {"repacked": repacked},
    }
    if fresh:
        begin = time.perf_counter()
        engine = start_engine(checkpoint, core=1)
        try:
            out["fresh"] = observe(engine) | {"start_seconds": time.perf_counter() - begin}
        finally:
            stop(engine)
    return out


def trainer(rank: int, work: Path, ports: list[int], args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=TRAINERS,
                            timeout=timedelta(seconds=JOB_SECONDS))
    record: dict[str, Any] = {"rank": rank, "models": []}
    if rank == 0:
        print(FIGURES_HEADER, flush=True)
        (work / "figures.txt").write_text(FIGURES_HEADER + "\n")
    begin = time.perf_counter()
    for i, name in enumerate(args.models):
        started = time.perf_counter()
        record["models"].append(refit_model(rank, name, work, ports[1 + i], args))
        record["models"][-1]["seconds"] = time.perf_counter() - started
    record["seconds"] = time.perf_counter() - begin
    return record


def run(rank: int, work: Path, ports: list[int], args: argparse.Namespace) -> None:
    """One trainer rank: its record (or its error) written to WORKDIR, whatever happens every
    engine it started stopped."""
    done = work / f"rank{rank}.json"
    try:
        done.write_text(json.dumps(trainer(rank, work, ports, args)))
    except BaseException:
        done.with_suffix(".error").write_text(traceback.format_exc())
    finally:
        while STARTED:
            stop(STARTED[-1])
        os._exit(0 if done.exists() else 1)  # a lost peer would hang the process group's teardown


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--models", default="llama,qwen3_moe")
    parser.add_argument("--lrs", default="1e-6,1e-5")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.lrs = [float(lr) for lr in args.lrs.split(",") if lr]
    return args


def main(argv: list[str]) -> None:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(1 + len(args.models))]
    begin = time.monotonic()
    context = mp.start_processes(run, args=(work, ports, args), nprocs=TRAINERS, join=False, start_method="spawn")
    failed_at = None
    while any(p.is_alive() for p in context.processes) and time.monotonic() - begin < JOB_SECONDS:
        if failed_at is None and any(p.exitcode not in (None, 0) for p in context.processes):
            failed_at = time.monotonic()  # a rank failed: the other gets a minute to notice
        if failed_at is not None and time.monotonic() - failed_at > 60:
            break
        time.sleep(1)
    for process in context.processes:
        if process.is_alive():
            process.kill()
    records: dict[str, Any] = {"seconds": time.monotonic() - begin, "args": {
        "models": args.models, "lrs": args.lrs, "steps": args.steps}}
    for rank in range(TRAINERS):
        path, error = work / f"rank{rank}.json", work / f"rank{rank}.error"
        records[str(rank)] = (
            json.loads(path.read_text()) if path.exists()
            else {"error": error.read_text() if error.exists() else "no record (killed, or out of time)"}
        )
    (work / "result.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main(sys.argv[1:])
