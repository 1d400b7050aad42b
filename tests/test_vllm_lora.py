"""LoRA adapters refitted into live vLLM engines (layoutlang.integrations.vllm.lora).

Without engines: the adapter's destination layout gives every worker exactly the slice vLLM's
LoRA layers take (their rules re-derived below from vllm/lora/layers/, not from layoutlang), the
plan moves only adapter bytes and each worker only its slice, and a worker's whole-shape tensors
(its boxes, zeros elsewhere) sliced by those rules are its slices of the trained adapter.

With engines (tests/vllm_lora_job.py, once per module, with the vLLM environment's Python): a
2-rank FSDP2 trainer of a tiny Llama trains two PEFT adapters with real Adam steps and refits
each, by its own trainer engine and session, into 2 engines of tensor parallel 2; the oracle is
a third engine, never refitted, loading ``save_pretrained`` of the trainer's current adapter by
path (vLLM's normal way). A tiny Qwen3-MoE with an adapter on its attention, into 2 engines
of tensor parallel 2, the first of which is also its oracle (it loads each saved adapter by
path under another id): 5 engine starts for the module.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from environments import VLLM_PYTHON, require

from layoutlang.integrations.vllm.lora import (
    AdapterSpec,
    AdapterTargets,
    adapter_program,
    peft_config_dict,
)
from layoutlang.lang import loads
from layoutlang.plan import compile_plan

ROOT = Path(__file__).resolve().parents[1]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, R = 128, 4, 2, 32, 256, 2, 8
MODULES = {  # module -> (in, out) of the base linear layer
    "self_attn.q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "self_attn.o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTER),
    "mlp.up_proj": (HIDDEN, INTER),
    "mlp.down_proj": (INTER, HIDDEN),
}


def adapter_shapes() -> dict[str, tuple[int, int]]:
    """The tensors PEFT's save_pretrained writes for a rank-R adapter on every module."""
    out = {}
    for layer in range(LAYERS):
        for module, (inp, outp) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = (R, inp)
            out[f"{prefix}.lora_B.weight"] = (outp, R)
    return out


def vllm_slice(name: str, tensor: torch.Tensor, tp: int, tp_rank: int, kv_heads: int = KV_HEADS) -> torch.Tensor:
    """What vLLM's LoRA layer keeps of a whole adapter tensor on tensor-parallel rank
    ``tp_rank`` (vllm/lora/layers/column_parallel_linear.py, row_parallel_linear.py; not fully
    sharded LoRAs): ``slice_lora_a`` is the identity for column-parallel layers and cuts the
    input columns of row-parallel ones; ``slice_lora_b`` cuts the output rows of column-parallel
    ones (MergedQKVParallelLinearWithLoRA: q by ``tp_rank``, k and v by ``tp_rank //
    num_kv_head_replicas`` in ``num_kv_heads_per_partition * head_size`` rows;
    MergedColumnParallelLinearWithLoRA: gate and up each by ``tp_rank``) and is the identity
    for row-parallel ones."""
    module = name.split(".")[-3]
    is_a = ".lora_A." in name
    if module in ("o_proj", "down_proj"):
        if not is_a:
            return tensor
        shard = tensor.shape[1] // tp
        return tensor[:, tp_rank * shard : (tp_rank + 1) * shard]
    if is_a:
        return tensor
    if module in ("k_proj", "v_proj"):
        replicas = max(1, tp // kv_heads)
        shard = max(1, kv_heads // tp) * HEAD_DIM
        shard_id = tp_rank // replicas
        return tensor[shard * shard_id : shard * (shard_id + 1)]
    shard = tensor.shape[0] // tp
    return tensor[tp_rank * shard : (tp_rank + 1) * shard]


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The model's config.json (a tiny Llama of the sizes above) and the adapter's
    adapter_config.json (rank R on every module), as transformers and PEFT write them."""
    import transformers
    from peft import LoraConfig

    folder = tmp_path_factory.mktemp("lora-configs")
    transformers.LlamaConfig(
        hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=INTER, num_hidden_layers=LAYERS, vocab_size=256,
    ).save_pretrained(folder / "model")
    modules = [m.split(".")[-1] for m in MODULES]
    LoraConfig(r=R, lora_alpha=16, target_modules=modules).save_pretrained(folder / "adapter")
    return folder / "model" / "config.json", folder / "adapter" / "adapter_config.json"


def program_text(configs: tuple[Path, Path], tp: int, engines: int = 2) -> str:
    train = "mesh train [dp = 2] on ranks 0..1\nlayout train on train {\n    default: dp = shard(0)\n}\n"
    infer = f"mesh infer [dp = {engines}, tp = {tp}] on ranks 2..{1 + engines * tp}"
    return adapter_program(*configs, train, infer_mesh=infer)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_worker_receives_exactly_the_slice_vllms_lora_layers_take(configs, tp):
    program = loads(program_text(configs, tp), "lora.layout")
    layout = program.layout("vllm_lora")
    generator = torch.Generator().manual_seed(0)
    adapter = {n: torch.randn(s, generator=generator) for n, s in adapter_shapes().items()}
    for rank in layout.mesh.ranks:
        tp_rank = layout.mesh.coords(rank)["tp"]
        shapes = layout.storages_on(rank)
        assert set(shapes) == set(adapter)  # every adapter tensor, as a storage of its own
        received = {}
        for name, shape in shapes.items():
            storage = torch.full(shape, float("nan"))
            for box in layout.boxes(name, rank):
                storage[box.storage_index()] = adapter[name][box.slices()]
            received[name] = storage
            want = vllm_slice(name, adapter[name], tp, tp_rank)
            assert math.prod(shape) == want.numel(), (name, rank)  # only its slice
        targets = AdapterTargets(torch.nn.Linear(1, 1), layout, rank, AdapterSpec(1, "a", {"r": R, "lora_alpha": 16,
                                                                                           "target_modules": []}), None)
        assert targets.problems and "enable_lora=True" in targets.problems[0]  # no LoRA manager in a Linear
        whole = targets.whole_tensors(received)
        for name, tensor in whole.items():
            got = vllm_slice(name, tensor, tp, tp_rank)
            assert torch.equal(got, vllm_slice(name, adapter[name], tp, tp_rank)), (name, rank)


def test_the_plan_moves_only_adapter_bytes_each_worker_its_slice(configs):
    tp, engines = 2, 2
    program = loads(program_text(configs, tp, engines), "lora.layout")
    stats = compile_plan(program).stats
    shapes = adapter_shapes()
    assert set(program.tensors) == set(shapes)  # no base weight is a tensor of the refit
    per_worker = {
        tp_rank: sum(vllm_slice(n, torch.empty(s, device="meta"), tp, tp_rank).numel() * 4 for n, s in shapes.items())
        for tp_rank in range(tp)
    }
    for rank in range(2, 2 + engines * tp):
        received = stats.per_rank[rank]["received"]
        assert sum(received.values()) == per_worker[(rank - 2) % tp], rank
    adapter_bytes = sum(math.prod(s) * 4 for s in shapes.values())
    assert stats.moved == stats.lower_bound == engines * sum(per_worker.values())
    assert stats.moved <= adapter_bytes * engines * tp


def test_an_adapter_spec_names_vllms_id_and_the_peft_config():
    from peft import LoraConfig

    config = peft_config_dict(LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 8
    json.dumps(config)
    spec = AdapterSpec(3, "policy", config)
    assert AdapterSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    with pytest.raises(ValueError, match="at least 1"):
        AdapterSpec(0, "policy", config)
    with pytest.raises(ValueError, match="no 'r'"):
        AdapterSpec(1, "policy", {"lora_alpha": 1, "target_modules": []})


def test_adapter_program_refuses_a_path_it_cannot_name_and_a_dtype_it_cannot_declare(configs):
    with pytest.raises(ValueError, match="a path with a quote"):
        adapter_program('a"b/config.json', configs[1], "", infer_mesh="mesh infer [tp = 2]")
    with pytest.raises(ValueError, match="declare fp32, bf16, fp16 or fp64"):
        adapter_program(*configs, "", infer_mesh="mesh infer [tp = 2]", dtype=torch.int8)


def test_a_bf16_adapter_is_declared_bf16(configs):
    program = loads(program_text(configs, 2), "lora.layout")
    assert {t.dtype for t in program.tensors.values()} == {"fp32"}  # PEFT's default
    train = "mesh train [dp = 2] on ranks 0..1\nlayout train on train {\n    default: dp = shard(0)\n}\n"
    infer = "mesh infer [dp = 2, tp = 2] on ranks 2..5"
    text = adapter_program(*configs, train, infer_mesh=infer, dtype=torch.bfloat16)
    assert {t.dtype for t in loads(text, "lora.layout").tensors.values()} == {"bf16"}


def test_adapter_state_dict_takes_the_names_save_pretrained_writes(tmp_path):
    import transformers
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open

    from layoutlang.integrations.vllm.lora import adapter_state_dict

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=50)
    model = get_peft_model(transformers.LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert set(adapter_state_dict(model)) == saved


# ------------------------------------------------------------------------ live engines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require(VLLM_PYTHON)
    scenario = request.param
    work = tmp_path_factory.mktemp(f"vllm-lora-{scenario}")
    command = [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_lora_job.py"), scenario, str(work), str(free_port())]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=1400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    result = work / "result.json"
    assert result.exists(), output[-6000:]
    records = {int(k): v for k, v in json.loads(result.read_text()).items()}
    for rank, record in records.items():
        assert "error" not in record, f"trainer rank {rank}:\n{record['error']}\n{output[-3000:]}"
    return {"scenario": scenario, "record": records[0], "work": work}


def checks(job: dict[str, Any], adapter: str | None = None) -> list[dict[str, Any]]:
    return [c for c in job["record"]["checks"] if adapter is None or c["refitted"] == adapter]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_refit_generates_the_tokens_of_an_engine_loading_the_adapter_by_path(job):
    for check in checks(job):
        for engine, generated in enumerate(check["engines"]):
            assert generated[check["refitted"]] == check["oracle"], (check["label"], engine)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_training_step_changes_the_adapters_tokens(job):
    oracle = [c["oracle"] for c in checks(job, "default")]
    assert len(oracle) >= 3
    for before, after in itertools.pairwise(oracle):
        assert before != after


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_generation_without_an_adapter_is_unchanged(job):
    before = job["record"]["base_before"]
    for check in checks(job):
        assert [e["base"] for e in check["engines"]] == before, check["label"]
    assert [e["default"] for e in checks(job)[-1]["engines"]] != before  # the adapter does change tokens


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_plan_moves_only_adapter_bytes_each_worker_its_vllm_slice(job):
    from safetensors import safe_open

    record = job["record"]
    engines, tp = len(record["base_before"]), 2
    for name, stats in record["plans"].items():
        size = record["adapter_bytes"][name]
        assert stats["moved_bytes"] == stats["lower_bound_bytes"] <= size * engines * tp, name
        # the adapter as save_pretrained wrote it: what each worker's LoRA layers keep of it
        saved = job["work"] / f"{name}-0" / ("" if name == "default" else name) / "adapter_model.safetensors"
        with safe_open(str(saved), framework="pt") as f:
            shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}  # noqa: SIM118
        assert sum(math.prod(s) * 4 for s in shapes.values()) == size
        for rank in range(2, 2 + engines * tp):
            want = sum(vllm_slice(n, torch.empty(s, device="meta"), tp, (rank - 2) % tp).numel() * 4
                       for n, s in shapes.items())
            assert sum(stats["per_rank"][str(rank)]["received"].values()) == want, (name, rank)
        # the refit's logical tensors are the adapter's, exactly as save_pretrained wrote them
        assert set(loads(record["programs"][name], f"{name}.layout").tensors) == set(shapes), name


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_adapters_in_one_engine_are_refitted_independently(job):
    if job["scenario"] != "llama":
        pytest.skip("the qwen3_moe scenario trains one adapter: two adapters are checked on llama")
    second = checks(job, "second")
    default = checks(job, "default")
    # refits of 'default' leave 'second' as it was
    for check in default[1:]:  # default-0 came before second-0
        assert [e["second"] for e in check["engines"]] == [e["second"] for e in second[0]["engines"]]
    # a refit of 'second' changes it and leaves 'default' as it was
    last, trained = default[-1], second[-1]
    assert [e["default"] for e in trained["engines"]] == [e["default"] for e in last["engines"]]
    assert trained["oracle"] != second[0]["oracle"]
    assert all(ids == [[1, 2], [1, 2]] for ids in trained["adapter_ids"])


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_removed_adapter_leaves_the_engines_and_the_other_serves_on(job):
    if job["scenario"] != "llama":
        pytest.skip("the qwen3_moe scenario trains one adapter: two adapters are checked on llama")
    removed = job["record"]["removed"]
    assert removed["failed"] == {}
    assert removed["adapter_ids"] == [[[1], [1]]] * len(removed["adapter_ids"])
    last = checks(job)[-1]
    assert removed["default"] == [e["default"] for e in last["engines"]]
    assert removed["base"] == job["record"]["base_before"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_base_weights_refitted_into_lora_engines_match_vllms_own_reload(job):
    """vLLM's LoRA layers hold the layer they adapt as ``base_layer`` (its weight is
    ``X.base_layer.weight``): a refit of the base weights into LoRA engines reaches them, and
    the engines then generate, without an adapter and with one, what an engine generates that
    reloaded the same checkpoint by vLLM's own ``reload_weights`` and loads the adapter by path."""
    if job["scenario"] != "llama":
        pytest.skip("the base weights are refitted in the llama scenario")
    base = job["record"]["base_refit"]
    assert base["refitted"] == [0, 1], base["report"]
    oracle = base["oracle"]
    assert oracle["base"] != job["record"]["base_before"][0]  # the changed weights change the tokens
    for engine in base["engines"]:
        assert engine["base"] == oracle["base"]
        assert engine["default"] == oracle["default"]
