"""Live vLLM engines that die, restart, join and leave while a trainer keeps refitting them, run
with the vLLM environment's Python (``.venv-vllm``) by tests/test_vllm_elastic.py, which asserts
on what it records. Nothing here asserts.

``python tests/vllm_elastic_job.py WORKDIR`` is the driver. It serves the refit session's store
(a process that outlives the trainer, as an RL framework's controller does), starts the engines
(tests/vllm_engine_host.py: each a vLLM CPU engine of tensor parallel 2 in a process of its
own) and the trainer: 2 gloo processes holding a tiny random Llama (float32, made here) as
FSDP2 DTensors, taking real Adam steps. The trainer refits through layoutlang's vLLM
weight-transfer engine, with every engine's greedy tokens recorded after every step and the
trainer's weights saved as a checkpoint. Every refit is a delta refit (only attention and norms
train, so most of what the engines hold does not change between steps):

1. a program whose inference layout vLLM does not hold fails ``trainer_init`` on every rank
   before a byte moves (engines A, B, C unchanged);
2. step 1 refits A (loaded from the checkpoint), B and C (dummy weights);
3. step 2: one worker of B is SIGKILLed halfway through the trainer's sends; the step commits
   on A and C within the same ``send_weights()``, which reports B lost;
4. step 3: B is started again (a new process, dummy weights) and added: admitted at the step's
   boundary, filled from the other engines;
5. an attacker without the job's secret forges a member list and a commit record and asks to
   join, while step 4 adds a fourth engine D (the engine axis grows past its first size);
6. step 5 removes C on purpose (it shrinks);
7. the trainer is SIGKILLed; the engines are asked for tokens meanwhile; a new trainer (same
   secret, same store) loads the checkpoint of step 5, re-attaches to A, B, D and refits step 6;
8. step 7: one worker of D holds ``model.norm.weight`` cast to float64 (its model no longer
   matches what a refit writes): D cannot prepare the step, so no engine applies it; the
   parameter is put back and the engines generate (step 6's tokens expected); step 8 applies
   everywhere.

Then a fresh engine per checkpoint (the oracle) generates the tokens every refitted engine must
have generated, and reloads the same checkpoint through vLLM's own ``load_weights`` path.
Everything goes to WORKDIR/result.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_engine_host import KEY_ENV, HostClient
from vllm_refit_job import MODELS, new_model, program_text, transformers_logprobs

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = 2
NAMESPACE = "refit"
#: seconds any wait of the session may take: a dead member is noticed long before
TIMEOUT = 60.0
#: buckets of 64 KiB: the 1.4 MB model moves in tens of executor steps, so "halfway" is
#: in the middle of a transfer
MEMORY_BUDGET = 128 * 2**10
CTL = "test-ctl"


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- driver


class Hosts:
    """The engine processes this driver started (each stopped on the way out)."""

    def __init__(self, work: Path):
        self.work = work
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, checkpoint: Path, *, dummy: bool) -> None:
        ready = self.work / f"host-{name}.json"
        ready.unlink(missing_ok=True)
        args = [sys.executable, str(ROOT / "tests" / "vllm_engine_host.py"), str(checkpoint), str(ready)]
        with open(self.work / f"host-{name}.log", "ab") as out:
            self.processes[name] = subprocess.Popen(
                [*args, "--dummy"] if dummy else args, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )

    def client(self, name: str, timeout: float = 600.0) -> HostClient:
        ready = self.work / f"host-{name}.json"
        end = time.monotonic() + timeout
        while not ready.exists():
            if self.processes[name].poll() is not None:
                raise RuntimeError(f"engine {name} exited while starting: see host-{name}.log")
            if time.monotonic() > end:
                raise TimeoutError(f"engine {name} did not start within {timeout:g} s")
            time.sleep(0.5)
        time.sleep(0.1)  # the file is written whole before this reads it (write_text, small)
        return HostClient(json.loads(ready.read_text())["port"], name=name)

    def stop(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is None:
            return
        with contextlib.suppress(Exception):
            self.client(name, timeout=1).stop()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()

    def stop_all(self) -> None:
        for name in list(self.processes):
            self.stop(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_processes(work: Path, incarnation: int, store_port: int, env: dict[str, str]) -> list[subprocess.Popen]:
    """The trainer job: one process per rank, its own gloo group on a fresh port."""
    port = free_port()
    out = []
    for rank in range(TRAINERS):
        log_file = open(work / f"trainer{incarnation}-rank{rank}.log", "ab")  # noqa: SIM115 (the child's)
        out.append(subprocess.Popen(
            [sys.executable, __file__, "trainer", str(work), str(rank), str(incarnation), str(store_port), str(port)],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env,
        ))
    return out


def wait_key(ctl: Any, key: str, processes: list[subprocess.Popen], timeout: float = 900.0) -> str:
    """The value the trainer sets under ``key``; raises if the trainer died first."""
    end = time.monotonic() + timeout
    while not ctl.check([key]):
        dead = [p.args for p in processes if p.poll() not in (None, 0)]
        if dead:
            raise RuntimeError(f"a trainer process failed before '{key}': see the trainer logs")
        if time.monotonic() > end:
            raise TimeoutError(f"the trainer did not reach '{key}' within {timeout:g} s")
        time.sleep(0.2)
    return bytes(ctl.get(key)).decode()


def driver(work: Path) -> dict[str, Any]:
    from elastic.auth import SECRET_ENV, JobSecret, remember
    from elastic.store import serve_store

    secret = JobSecret.generate()
    env = dict(os.environ)
    env[KEY_ENV] = os.environ[KEY_ENV] = secrets.token_hex(16)
    env[SECRET_ENV] = secret.text()  # the trainer's; the engines receive it in their init info
    store = serve_store("127.0.0.1", 0, timeout=TIMEOUT)
    remember(store, secret)
    ctl = dist.PrefixStore(CTL, store)
    torch.manual_seed(0)
    new_model("llama").save_pretrained(work / "step0")
    result: dict[str, Any] = {"store_port": store.port}
    hosts = Hosts(work)
    try:
        started = time.perf_counter()
        hosts.start("A", work / "step0", dummy=False)
        for name in ("B", "C", "D"):
            hosts.start(name, work / "step0", dummy=True)
        clients = {name: hosts.client(name) for name in ("A", "B", "C", "D")}
        result["engines_start_seconds"] = time.perf_counter() - started
        result["before"] = {name: clients[name].generate() for name in ("A", "B", "C")}
        result["pids"] = {name: {"host": hosts.processes[name].pid, "workers": c.worker_pids()}
                          for name, c in clients.items()}
        (work / "engines.json").write_text(json.dumps({name: c.port for name, c in clients.items()}))

        first = trainer_processes(work, 1, store.port, env)
        wait_key(ctl, "need-B2", first)
        result["secret_in_titles"] = titles_with(secret.text())
        hosts.start("B2", work / "step0", dummy=True)  # B started again: a new process
        clients["B2"] = hosts.client("B2")
        result["pids"]["B2"] = {"host": hosts.processes["B2"].pid, "workers": clients["B2"].worker_pids()}
        ctl.set("B2", str(clients["B2"].port))
        where = json.loads(wait_key(ctl, "attack", first))
        result["attacker"] = attack(work, store.port, where["generation"], where["next_step"])
        ctl.set("attacked", json.dumps(result["attacker"]))
        wait_key(ctl, "done1", first)
        for process in first:  # the trainer job dies
            process.send_signal(signal.SIGKILL)
        for process in first:
            process.wait()
        # during the outage the engines answer prompts with the last committed weights
        result["outage"] = {name: clients[name].generate() for name in ("A", "B2", "D")}
        result["outage_at"] = time.time()
        second = trainer_processes(work, 2, store.port, env)
        wait_key(ctl, "done2", second)
        for process in second:
            process.wait(timeout=120)
        result["pids_after"] = {name: {"host": hosts.processes[name].pid, "workers": clients[name].worker_pids()}
                                for name in ("A", "B2", "C", "D")}
        result["members"] = agreed_members(store, secret)
    finally:
        hosts.stop_all()
    result["oracle"] = oracle(work, hosts)
    # the secret reached every engine (in its init info) and signed every record: it must
    # appear in no log and no output of any process, the store's records included
    result["secret_in_files"] = [p.name for p in work.iterdir() if p.is_file() and secret.text() in p.read_text(
        errors="replace")]
    result["secret_in_store"] = any(secret.text().encode() in bytes(v) for v in store_values(store))
    return result


def titles_with(text: str) -> list[str]:
    """The command lines (process titles) of this machine's processes that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in cmdline:
                found.append(cmdline[:200])
    return found


def store_values(store: Any) -> list[bytes]:
    """Every value of the session's records that a reader can find (member lists, commit
    records, resume records, engine records)."""
    raw = dist.PrefixStore(NAMESPACE, store)
    keys = ["gen0/program", "ended"] + [f"gen{g}/{name}" for g in range(12) for name in ("members", "resume")]
    return [raw.get(k) for k in keys if raw.check([k])]


def agreed_members(store: Any, secret: Any) -> list[list[int]]:
    """Every generation's agreed member list, read with the job's secret."""
    from elastic.membership import Membership

    membership = Membership(store, -1, namespace=NAMESPACE, secret=secret)
    out, g = [], 0
    while (members := membership.members_of(g)) is not None:
        out.append(members)
        g += 1
    return out


def oracle(work: Path, hosts: Hosts) -> dict[str, Any]:
    """Fresh engines loaded from the first and the last checkpoint the trainer saved (started
    side by side), their tokens; then each checkpoint through vLLM's own reload (its
    ``load_weights`` path) into the engine of the first, and the tokens again: an engine
    start costs over a minute here, and the first and last checkpoints show that the reload
    gives a fresh engine's tokens. ``loaded`` says which the ``fresh`` tokens of a step are."""
    steps = sorted(int(p.name[4:]) for p in work.glob("step*") if p.name[4:].isdigit() and p.name != "step0")
    first, last = steps[0], steps[-1]
    hosts.start("fresh-first", work / f"step{first}", dummy=False)
    hosts.start("fresh-last", work / f"step{last}", dummy=False)
    out: dict[str, Any] = {}
    engine = hosts.client("fresh-last")
    out[str(last)] = {"fresh": engine.generate(), "loaded": "fresh"}
    engine.call("reload", str(work / f"step{last}"))
    out[str(last)]["fresh_reloaded"] = engine.generate()
    hosts.stop("fresh-last")
    engine = hosts.client("fresh-first")
    out[str(first)] = {"fresh": engine.generate(), "loaded": "fresh"}
    for step in steps:
        engine.call("reload", str(work / f"step{step}"))
        reloaded = engine.generate()
        record = out.setdefault(str(step), {"fresh": reloaded, "loaded": "reload"})
        record.setdefault("fresh_reloaded", reloaded)
    hosts.stop("fresh-first")
    return out


# -------------------------------------------------------------------------- attacker


def attack(work: Path, store_port: int, generation: int, next_step: int) -> dict[str, Any]:
    """Run the attacker: a process of its own, without the job's secret (another one)."""
    env = {k: v for k, v in os.environ.items() if k != "LAYOUTLANG_JOB_SECRET"}
    out = work / "attacker.json"
    with open(work / "attacker.log", "ab") as log_file:
        subprocess.run(
            [sys.executable, __file__, "attacker", str(work), str(store_port), str(generation), str(next_step)],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=300, check=False,
        )
    return json.loads(out.read_text()) if out.exists() else {"error": "the attacker wrote nothing"}


def attacker(work: Path, store_port: int, generation: int, next_step: int) -> None:
    """Forge what decides membership, and ask to join, with a secret of its own."""
    from elastic.auth import JobSecret, RecordSigner
    from elastic.membership import Membership

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30))
    wrong = JobSecret.generate()
    me = 666
    membership = Membership(store, me, namespace=NAMESPACE, secret=wrong)
    raw = dist.PrefixStore(NAMESPACE, store)
    records = RecordSigner(wrong, NAMESPACE)
    forged = {
        # the next generation's members: without engine A's workers (ranks 2, 3), with the attacker
        f"gen{generation + 1}/members": json.dumps([0, 1, 6, 7, me]).encode(),
        # the next step's commit record of this generation: aborted
        f"gen{generation}/commit/{next_step}": json.dumps({"state": "aborted"}).encode(),
    }
    for key, value in forged.items():
        records.set(raw, key, value)
    requests = []
    end = time.monotonic() + 40
    asked: set[int] = set()
    while time.monotonic() < end:  # ask to join every generation the job reaches meanwhile
        latest = generation
        while raw.check([f"gen{latest + 1}/members"]):
            latest += 1
        if latest + 1 not in asked:
            membership.request_join(latest + 1)
            asked.add(latest + 1)
            requests.append(latest + 1)
        time.sleep(0.2)
    (work / "attacker.json").write_text(json.dumps({"rank": me, "forged": sorted(forged), "join_requests": requests}))


# --------------------------------------------------------------------------- trainer


def trainer(work: Path, rank: int, incarnation: int, store_port: int, trainer_port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from layoutlang.integrations.dtensor import layout_from_state_dict
    from layoutlang.integrations.vllm.trainer import LayoutlangTrainerInitInfo, LayoutlangTrainerWeightTransferEngine

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")  # refused records are logged
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{trainer_port}", rank=rank, world_size=TRAINERS)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=TIMEOUT))
    ctl = dist.PrefixStore(CTL, store)
    torch.manual_seed(0)
    model = new_model("llama")
    if incarnation == 2:  # a restarted trainer resumes from its last checkpoint
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(work / "step5" / "model.safetensors")))
    # Only attention and norms train (embeddings, head and MLPs frozen, as in a LoRA-like or
    # partial fine-tune): the refits are delta refits, and most of what the engines hold does
    # not change from step to step
    for name, parameter in model.named_parameters():
        if "embed_tokens" in name or "lm_head" in name or ".mlp." in name:
            parameter.requires_grad_(False)
    mesh = init_device_mesh("cpu", (TRAINERS,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ports = json.loads((work / "engines.json").read_text())
    program = program_text(work / "step0", layout_from_state_dict(model.state_dict()), MODELS["llama"]["preset"],
                           engines=3)
    record: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "trainer_inits": 0, "steps": {}}

    def client(name: str) -> HostClient:
        return HostClient(int(ports[name]) if name != "B2" else int(bytes(ctl.get("B2")).decode()), name=name)

    def init(text: str, names: list[str], namespace: str) -> Any:
        record["trainer_inits"] += 1
        # [trainer]
        info = LayoutlangTrainerInitInfo(
            rank=rank, master_address="127.0.0.1", master_port=store_port, program=text, namespace=namespace,
            host_store=False, timeout=TIMEOUT, memory_budget=MEMORY_BUDGET, delta=True,
        )
        return LayoutlangTrainerWeightTransferEngine.trainer_init(
            info, client=[client(n) for n in names] if rank == 0 else [], source=model
        )
        # [/trainer]

    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=2e-2)

    def train(step: int) -> None:
        torch.manual_seed(100 + step)
        ids = torch.randint(0, MODELS["llama"]["config"]["vocab_size"], (2, 24))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def observe(step: int, report: Any, serving: dict[str, HostClient], seconds: float) -> None:
        """Save the trainer's weights (every rank gathers); on rank 0 record the engines' tokens."""
        whole = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
        if rank != 0:
            return
        reference = new_model("llama")
        reference.load_state_dict(whole)
        reference.save_pretrained(work / f"step{step}")
        engines = {}
        for name, c in serving.items():
            generated = c.generate()
            generated["transformers"] = transformers_logprobs(reference, generated["tokens"])
            engines[name] = generated
        record["steps"][str(step)] = {"report": report.to_json(), "seconds": seconds, "engines": engines,
                                      "states": {str(e.index): e.state for e in refit.engines},
                                      "versions": {str(e.index): e.version for e in refit.engines}}
        log(f"step {step}: {seconds:.2f} s, report {report.to_json()}")

    if incarnation == 1:
        # 1. a layout the engines do not hold: checkpoint tensors, where vLLM holds fused and
        # tensor-parallel parameters; every rank fails before a byte moves
        mismatched = program_text(work / "step0", layout_from_state_dict(model.state_dict()), None, engines=3)
        try:
            init(mismatched, ["A", "B", "C"], "mismatch")
            record["mismatch_error"] = None
        except Exception as err:
            record["mismatch_error"] = f"{type(err).__name__}: {err}"
        if rank == 0:
            record["after_mismatch"] = {n: client(n).generate() for n in ("A", "B", "C")}
        refit = init(program, ["A", "B", "C"], NAMESPACE)
        if rank == 0:
            record["plan"] = refit.session.plan.stats.to_json()
            record["lost_callbacks"] = []
            # [on-lost]
            refit.on_engines_lost = lambda lost: record["lost_callbacks"].append([e.index for e in lost])
            # [/on-lost]
        engines = {"A": client("A"), "B": client("B"), "C": client("C")}

        train(1)
        begin = time.perf_counter()
        report = refit.send_weights()
        observe(1, report, engines, time.perf_counter() - begin)

        # 2. a worker of engine B dies halfway through the trainer's sends of step 2
        train(2)
        victim = engines["B"].worker_pids()[-1] if rank == 0 else None

        def kill_halfway(done: int, total: int) -> None:
            if victim is not None and done == max(1, total // 2) and not record.get("killed_at"):
                os.kill(victim, signal.SIGKILL)
                record["killed_at"] = {"done": done, "total": total, "time": time.time()}

        begin = time.perf_counter()
        # [lost-engine]
        report = refit.send_weights(progress=kill_halfway)
        # report.lost == [1]: engine B lost a worker mid-refit; A and C applied the step
        # [/lost-engine]
        del engines["B"]
        observe(2, report, engines, time.perf_counter() - begin)

        # 3. B started again (a new process, dummy weights) joins at step 3's boundary
        if rank == 0:
            ctl.set("need-B2", "1")
            while not ctl.check(["B2"]):
                time.sleep(0.2)
            engines["B2"] = client("B2")
        train(3)
        begin = time.perf_counter()
        # [add-engine]
        if rank == 0:  # the sender, which holds the clients
            refit.add_engine(engines["B2"])  # it asks to join at once: admitted at the next step boundary
        report = refit.send_weights()  # on every trainer rank; report.joined == [3]
        # [/add-engine]
        observe(3, report, engines, time.perf_counter() - begin)

        # 4. an attacker forges records and asks to join; a fourth engine D is added
        if rank == 0:
            where = {"generation": refit.session.generation, "next_step": refit.session.next_step}
            ctl.set("attack", json.dumps(where))
            while not ctl.check(["attacked"]):
                time.sleep(0.2)
            engines["D"] = client("D")
            refit.add_engine(engines["D"])
        train(4)
        begin = time.perf_counter()
        report = refit.send_weights()
        observe(4, report, engines, time.perf_counter() - begin)

        # 5. C is removed on purpose: the engine axis shrinks
        train(5)
        begin = time.perf_counter()
        # [remove-engine]
        if rank == 0:
            refit.remove_engine(2)  # engine C leaves on purpose (it keeps serving what it has)
        report = refit.send_weights()  # report.left == [2]
        # [/remove-engine]
        if rank == 0:
            record["removed_engine"] = engines.pop("C").generate()  # it keeps serving what it had
        observe(5, report, engines, time.perf_counter() - begin)
        record["pid_at_end"] = os.getpid()
        (work / f"trainer1-rank{rank}.json").write_text(json.dumps(record))
        dist.barrier()
        if rank == 0:
            ctl.set("done1", "1")
        time.sleep(3600)  # killed by the driver
        return

    # 7. a restarted trainer re-attaches to the running engines
    refit = init(program, ["A", "B2", "D"], NAMESPACE)
    record["engine_ranks"] = {str(e.index): list(e.ranks) for e in refit.engines} if rank == 0 else {}
    engines = {name: client(name) for name in ("A", "B2", "D")}
    train(6)
    begin = time.perf_counter()
    report = refit.send_weights()
    observe(6, report, engines, time.perf_counter() - begin)

    # 8. one worker of D (tensor-parallel rank 0: not the one that answers for the engine) no
    # longer holds what the refit writes: D cannot prepare step 7, and no engine applies it
    train(7)
    if rank == 0:
        engines["D"].call("cast_parameter", "model.norm.weight", 0, "float64")
    begin = time.perf_counter()
    # [prepare-fails]
    report = refit.send_weights()
    # report.refitted == (), report.failed == {2: "... 'model.norm.weight' changed ..."},
    # report.held_back == (0, 1): every engine serves step 6's weights
    # [/prepare-fails]
    seconds = time.perf_counter() - begin
    if rank == 0:
        engines["D"].call("restore_parameter")  # generating needs the model whole again
    observe(7, report, engines, seconds)
    train(8)
    begin = time.perf_counter()
    report = refit.send_weights()
    observe(8, report, engines, time.perf_counter() - begin)
    refit.shutdown()
    (work / f"trainer2-rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    if rank == 0:
        ctl.set("done2", "1")


def main() -> None:
    role, work = sys.argv[1], Path(sys.argv[2])
    if role == "driver":
        work.mkdir(parents=True, exist_ok=True)
        try:
            result = driver(work)
        except BaseException:
            result = {"error": traceback.format_exc()}
        for incarnation in (1, 2):
            for rank in range(TRAINERS):
                path = work / f"trainer{incarnation}-rank{rank}.json"
                result[f"trainer{incarnation}"] = result.get(f"trainer{incarnation}", {})
                if path.exists():
                    result[f"trainer{incarnation}"][str(rank)] = json.loads(path.read_text())
        (work / "result.json").write_text(json.dumps(result))
    elif role == "trainer":
        trainer(work, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
        os._exit(0)
    elif role == "attacker":
        attacker(work, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))


if __name__ == "__main__":
    main()
