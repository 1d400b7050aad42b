"""How long a vLLM engine takes to serve the trainer's weights after it asks for them, three ways.

Run with the vLLM environment's Python (``scripts/setup-vllm`` makes it)::

    .venv-vllm/bin/python benchmarks/bench_vllm_join.py [--repeats 5] [--layers 4] [--hidden 512]

Two gloo trainer processes hold a random Llama (float32, GQA; bench_vllm_refit's model) as
FSDP2 DTensors and take a real Adam step before every measurement, so that every measurement
is of new weights. Three vLLM CPU engines of tensor parallel 2 run in processes of their own
(``tests/vllm_engine_host.py``, driven over a local socket); the refit session's store is
served by this driver, a process that outlives every trainer session (``host_store=False``).
Engines E0 and E1 are refitted as usual; the measured engine is E2 (started with dummy
weights). Each round measures, side by side, the time from E2's request for the weights to its
first ``generate()`` whose greedy tokens equal E0's (E0 refitted normally, same weights):

- **join**: a session of E0 and E1 (2 engines in the program); E2 is added with
  ``add_engine()`` right before a ``send_weights()``, admitted at that step's boundary, filled
  from E0/E1 (a recovery plan) and applied before ``send_weights()`` returns. From
  ``add_engine()`` to E2's first correct tokens;
- **rebuild**: everything re-initialized: a new ``trainer_init`` (a new namespace, a program
  of 3 engines) re-initializes E0, E1 and E2, then one refit. From the start of that
  ``trainer_init`` to E2's first correct tokens;
- **disk**: the trainer saves a checkpoint of its current weights (every rank's
  ``full_tensor()``, then rank 0's safetensors ``save_file``) and E2 reloads it through vLLM's
  own ``load_weights`` (``collective_rpc`` of the host's ``reload``). From the start of the
  save to E2's first correct tokens.

Before each measurement E2 holds older weights than E0 (its tokens are checked to differ, so
a match means something). Engine start-up is excluded from all three: every engine is already
running. The round then does the bookkeeping between measurements (E2 removed from the join
session with ``remove_engine()`` and a refit in which it leaves, a plain refit of E0 and E1
(timed for context), the trainer leaving its session), none of it in the three figures.
Nothing is asserted: figures, not tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / "tests" / "vllm_engine_host.py"  # one engine in a process of its own
sys.path.insert(0, str(HOST.parent))
from vllm_engine_host import KEY_ENV, HostClient  # noqa: E402 (the engine host's client)

TRAINERS = 2
TIMEOUT = 120.0
ENGINES = ("E0", "E1", "E2")
WAYS = ("join", "rebuild", "disk")


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


def brief(row: dict[str, Any]) -> str:
    """One measurement in a log line (its tokens left out)."""
    return json.dumps({k: v for k, v in row.items() if k != "tokens"})


def new_model(args: argparse.Namespace) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=2,
        vocab_size=args.vocab,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config).float()


def program(checkpoint: Path, train: str, engines: int) -> str:
    return (
        f'tensors from hf "{checkpoint / "config.json"}" as cfg dtype fp32\n'
        + train
        + f"mesh infer [dp = {engines}, tp = 2] on ranks {TRAINERS}..{TRAINERS + 2 * engines - 1}\n"
        + 'include "preset:llama/vllm_fused"\nreshard refit: train -> vllm_fused\n'
    )


# --------------------------------------------------------------------------- trainer


def trainer(rank: int, args: argparse.Namespace, work: Path, store_port: int, trainer_port: int) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layoutlang.integrations.dtensor import layout_from_state_dict
    from layoutlang.integrations.vllm.trainer import LayoutlangTrainerInitInfo, LayoutlangTrainerWeightTransferEngine

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank, world_size=TRAINERS)
    torch.manual_seed(0)
    model = new_model(args)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train_layout = layout_from_state_dict(model.state_dict())
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    ports = json.loads((work / "engines.json").read_text())
    clients = {name: HostClient(ports[name], name=name) for name in ENGINES} if rank == 0 else {}
    e0 = clients.get("E0")
    e2 = clients.get("E2")
    steps = 0

    def train() -> None:
        nonlocal steps
        steps += 1
        torch.manual_seed(100 + steps)
        ids = torch.randint(0, args.vocab, (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def init(namespace: str, engines: int) -> Any:
        info = LayoutlangTrainerInitInfo(
            rank=rank, master_address="127.0.0.1", master_port=store_port, namespace=namespace, host_store=False,
            program=program(work / "checkpoint", train_layout, engines), timeout=TIMEOUT,
        )
        names = ENGINES[:engines] if rank == 0 else ()
        return LayoutlangTrainerWeightTransferEngine.trainer_init(
            info, client=[clients[n] for n in names], source=model
        )

    def first_correct(begin: float, stale: list[list[int]]) -> dict[str, Any]:
        """E2's first generate() after ``begin``, against E0's tokens (E0 refitted normally)."""
        tokens = e2.generate()["tokens"]
        seconds = time.perf_counter() - begin
        reference = e0.generate()["tokens"]
        return {"seconds": seconds, "matched": tokens == reference, "stale_differed": stale != reference,
                "tokens": tokens}

    results: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    plain: list[float] = []
    for r in range(args.repeats):
        # the join session: E0 and E1 (untimed)
        train()
        refit = init(f"join{r}", 2)
        refit.send_weights()

        # (a) join: E2 added right before a send_weights()
        train()
        stale = e2.generate()["tokens"] if rank == 0 else []
        dist.barrier()
        begin, wall = time.perf_counter(), time.time()
        if rank == 0:
            joiner = refit.add_engine(e2)
        added = time.perf_counter() - begin
        report = refit.send_weights()
        sent = time.perf_counter() - begin
        if rank == 0:
            row = first_correct(begin, stale)
            grow = [g for g in report.recoveries if g.joined]
            marks = {"add_engine returned": added, "send_weights returned": sent}
            if grow:  # the grow after the step committed: its timeline (time.time() stamps)
                marks |= {"step committed, grow decided": grow[0].noticed_at - wall,
                          "new members agreed": grow[0].agreed_at - wall,
                          "new group built": grow[0].group_at - wall}
            row |= {"joined": list(report.joined), "refitted": list(report.refitted),
                    "recovered_from": report.recovered_from, "marks": marks}
            results["join"].append(row)
            log(f"round {r} join: {brief(row)}")
            refit.remove_engine(joiner)  # for the next measurement E2 falls behind again
        train()
        report = refit.send_weights()  # E0 and E1 only: E2 left (the engine axis shrinks)
        if rank == 0 and report.left != (joiner.index,):
            log(f"round {r}: E2's removal not reported as left: {report.to_json()}")
        train()
        begin = time.perf_counter()
        refit.send_weights()  # a plain refit of E0 and E1, for context
        plain.append(time.perf_counter() - begin)

        # (c) disk: a checkpoint of the trainer's current weights (those E0 serves), reloaded by E2
        stale = e2.generate()["tokens"] if rank == 0 else []
        dist.barrier()
        begin = time.perf_counter()
        whole = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
        gathered = time.perf_counter() - begin
        if rank == 0:
            saved = work / f"round{r}"
            saved.mkdir()
            save_file({k: v.contiguous() for k, v in whole.items()}, str(saved / "model.safetensors"))
            written = time.perf_counter() - begin
            e2.call("reload", str(saved))
            reloaded = time.perf_counter() - begin
            row = first_correct(begin, stale)
            row["bytes"] = (saved / "model.safetensors").stat().st_size
            row["marks"] = {"full_tensor() gathered": gathered, "safetensors written": written,
                            "E2 reloaded (load_weights)": reloaded}
            results["disk"].append(row)
            log(f"round {r} disk: {brief(row)}")
        del whole

        # (b) rebuild: a new trainer_init re-initializes every engine, then one refit
        train()
        refit.shutdown()
        stale = e2.generate()["tokens"] if rank == 0 else []
        dist.barrier()
        begin = time.perf_counter()
        refit = init(f"rebuild{r}", 3)
        initialized = time.perf_counter() - begin
        report = refit.send_weights()
        sent = time.perf_counter() - begin
        if rank == 0:
            row = first_correct(begin, stale) | {"refitted": list(report.refitted)}
            row["marks"] = {"trainer_init returned": initialized, "send_weights returned": sent}
            results["rebuild"].append(row)
            log(f"round {r} rebuild: {brief(row)}")
        refit.shutdown()
        dist.barrier()
    if rank == 0:
        (work / "results.json").write_text(json.dumps({"results": results, "plain": plain}))
    dist.barrier()


def run(rank: int, args: argparse.Namespace, work: Path, store_port: int, trainer_port: int) -> None:
    import traceback

    code = 0
    try:
        trainer(rank, args, work, store_port, trainer_port)
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(code)  # the sessions' threads need no teardown here


# ---------------------------------------------------------------------------- driver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engines(work: Path, checkpoint: Path) -> dict[str, subprocess.Popen[bytes]]:
    processes = {}
    for name in ENGINES:
        command = [sys.executable, str(HOST), str(checkpoint), str(work / f"host-{name}.json")]
        with open(work / f"host-{name}.log", "ab") as out:
            processes[name] = subprocess.Popen(
                [*command, "--dummy"] if name == "E2" else command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
    return processes


def engine_ports(work: Path, processes: dict[str, subprocess.Popen[bytes]], timeout: float = 900.0) -> dict[str, int]:
    end = time.monotonic() + timeout
    ports = {}
    for name, process in processes.items():
        ready = work / f"host-{name}.json"
        while not ready.exists():
            if process.poll() is not None:
                tail = (work / f"host-{name}.log").read_text()[-3000:]
                raise RuntimeError(f"engine {name} exited while starting:\n{tail}")
            if time.monotonic() > end:
                raise TimeoutError(f"engine {name} did not start within {timeout:g} s")
            time.sleep(0.5)
        time.sleep(0.1)  # written whole before it is read (small)
        ports[name] = json.loads(ready.read_text())["port"]
    return ports


def stop_engines(processes: dict[str, subprocess.Popen[bytes]], ports: dict[str, int]) -> None:
    for name, process in processes.items():
        if name in ports:
            with contextlib.suppress(Exception):
                HostClient(ports[name], name=name).stop()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def report(args: argparse.Namespace, data: dict[str, Any], start_seconds: float) -> None:
    results, plain = data["results"], data["plain"]
    print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (fp32); trainer: FSDP2 on "
          f"{TRAINERS} gloo ranks; engines: vLLM CPU, TP 2, each a process of its own; {args.repeats} rounds")
    print(f"engine start-up excluded from every figure (all three engines already running; they took "
          f"{start_seconds:.1f} s to start, together)")
    print("seconds from E2's request for the weights to its first generate() with E0's tokens:")
    print(f"{'way':<10}{'median s':>10}{'best s':>10}  {'matched':<9}each")
    medians = {}
    for way in WAYS:
        rows = results[way]
        seconds = [row["seconds"] for row in rows]
        medians[way] = statistics.median(seconds)
        matched = sum(row["matched"] for row in rows)
        print(f"{way:<10}{medians[way]:>10.3f}{min(seconds):>10.3f}  {matched}/{len(rows):<7}"
              + ", ".join(f"{s:.3f}" for s in seconds))
    print(f"ratio rebuild / join: {medians['rebuild'] / medians['join']:.2f}x; "
          f"disk / join: {medians['disk'] / medians['join']:.2f}x")
    print("where the time goes (median seconds after the request, over the rounds):")
    for way in WAYS:
        marks = [row["marks"] for row in results[way] if "marks" in row]
        names = [name for name in marks[0] if all(name in m for m in marks)] if marks else []
        parts = [f"{name} {statistics.median(m[name] for m in marks):.3f}" for name in names]
        print(f"  {way}: " + "; ".join([*parts, f"first correct generate() {medians[way]:.3f}"]))
    stale = all(row["stale_differed"] for way in WAYS for row in results[way])
    print(f"E2's tokens before each measurement differed from E0's: {'yes' if stale else 'NOT ALWAYS'}")
    joins = results["join"]
    print(f"join: E2 filled from {joins[0]['recovered_from']} bytes by where they were read; "
          f"joined {[row['joined'] for row in joins]}")
    print(f"disk: checkpoint {results['disk'][0]['bytes']:,} bytes (safetensors, on {tempfile.gettempdir()}); "
          f"plain refit of E0 and E1 (context): median {statistics.median(plain):.3f} s")
    print("join: E0 and E1 apply the step of the join only once E2 caught up (send_weights returns then)")


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    from elastic.auth import SECRET_ENV, JobSecret, remember
    from elastic.store import serve_store

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    secret = JobSecret.generate()
    os.environ[KEY_ENV] = secrets.token_hex(16)  # the engine hosts' socket key (inherited)
    os.environ[SECRET_ENV] = secret.text()  # the trainer's; the engines receive it in their init info
    store = serve_store("127.0.0.1", 0, timeout=TIMEOUT)  # outlives every trainer session
    remember(store, secret)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-join-") as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        new_model(args).save_pretrained(work / "checkpoint")
        started = time.perf_counter()
        processes = start_engines(work, work / "checkpoint")
        ports: dict[str, int] = {}
        try:
            ports = engine_ports(work, processes)
            start_seconds = time.perf_counter() - started
            log(f"engines up in {start_seconds:.1f} s")
            (work / "engines.json").write_text(json.dumps(ports))
            mp.start_processes(run, args=(args, work, store.port, free_port()), nprocs=TRAINERS, start_method="spawn")
            report(args, json.loads((work / "results.json").read_text()), start_seconds)
        finally:
            stop_engines(processes, ports)


if __name__ == "__main__":
    main()
