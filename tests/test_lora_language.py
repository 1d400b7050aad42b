"""LoRA adapters in the language: ``tensors from peft ... over cfg as lora`` and preset:lora/vllm.

The oracles are independent of layoutlang:

- the tensors: PEFT itself. Tiny transformers models (Llama, Qwen3-MoE), wrapped by peft's
  ``get_peft_model(LoraConfig(...))`` and written by ``save_pretrained``: the names, shapes and
  dtypes of ``adapter_model.safetensors`` are what the statement must declare, from
  ``adapter_config.json`` and the model's ``config.json`` alone.
- the vLLM presets: vLLM 0.32's LoRA layers, written out here from its source
  (vllm/lora/layers/): ``MergedQKVParallelLinearWithLoRA.slice_lora_b`` (q rows of the rank,
  k and v rows of kv head ``tp_rank // num_kv_head_replicas``), ``MergedColumnParallelLinear
  WithLoRA.slice_lora_b`` (each of gate and up narrowed to the rank's rows), their
  ``slice_lora_a`` (whole), ``RowParallelLinearWithLoRA`` (lora_A's dim 1 narrowed, lora_B
  whole); with ``fully_sharded_loras`` the ``...WithShardedLoRA`` classes: lora_A rows
  ``[tp_rank * max_lora_rank / tp, ...)`` in a slot of ``max_lora_rank / tp`` rows for the
  column-parallel layers, lora_B rows ``[tp_rank * out / tp, ...)`` for the row-parallel ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import layoutlang
from layoutlang.cli.main import main
from layoutlang.errors import LayoutError

pytestmark = pytest.mark.timeout(180)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "tie_word_embeddings": False,
}
QWEN3_MOE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "tie_word_embeddings": False,
}
QWEN3 = LLAMA | {"head_dim": 8}
QWEN2 = LLAMA
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]

#: name: (model family, LoraConfig arguments, model dtype, get_peft_model's autocast_adapter_dtype)
ADAPTERS = {
    "llama_list": ("llama", {"target_modules": ALL}, torch.float32, True),
    "llama_regex": ("llama", {"target_modules": r".*\.(q|v|down)_proj"}, torch.float32, True),
    "llama_all_linear": ("llama", {"target_modules": "all-linear"}, torch.float32, True),
    "llama_patterns": (
        "llama",
        {
            "target_modules": ALL,
            "rank_pattern": {"o_proj": 4, r"layers\.1\.mlp\.up_proj": 2},
            "alpha_pattern": {"o_proj": 8},
            "exclude_modules": ["gate_proj"],
            "layers_to_transform": [1],
        },
        torch.float32,
        True,
    ),
    # PEFT upcasts the adapter of a bf16 model to fp32 by default
    "llama_bf16": ("llama", {"target_modules": ["q_proj", "v_proj"]}, torch.bfloat16, True),
    "llama_bf16_kept": ("llama", {"target_modules": ["q_proj", "v_proj"]}, torch.bfloat16, False),
    "llama_all_linear_ranks": (
        "llama",
        {"target_modules": "all-linear", "rank_pattern": {"mlp.down_proj": 3, "layers.0.self_attn.q_proj": 5}},
        torch.float32,
        True,
    ),
    "qwen2_list": ("qwen2", {"target_modules": ALL}, torch.float32, True),
    "qwen3_all_linear": ("qwen3", {"target_modules": "all-linear"}, torch.float32, True),
    "qwen3_moe_attention": ("qwen3_moe", {"target_modules": ATTENTION}, torch.float32, True),
    "qwen3_moe_regex": ("qwen3_moe", {"target_modules": r".*self_attn\.(k|o)_proj"}, torch.float32, True),
}


#: family: (transformers' config and model classes, the tiny config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN2),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", QWEN3_MOE),
}


def _model(family: str, dtype: torch.dtype):
    torch.manual_seed(0)
    config, model, sizes = FAMILIES[family]
    return getattr(transformers, model)(getattr(transformers, config)(**sizes)).to(dtype)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Every adapter of ADAPTERS written by PEFT: a folder with the model's config.json and
    PEFT's adapter_config.json and adapter_model.safetensors."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, (family, settings, dtype, autocast) in ADAPTERS.items():
        model = _model(family, dtype)
        folder = root / name
        model.config.save_pretrained(folder)
        wrapped = peft.get_peft_model(
            model, peft.LoraConfig(r=8, lora_alpha=16, **settings), autocast_adapter_dtype=autocast
        )
        wrapped.save_pretrained(folder)
        out[name] = folder
    return out


def stored(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """What PEFT wrote: name -> (shape, dtype short name), read with the safetensors library."""
    from safetensors import safe_open

    short = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        names = f.keys()
        return {k: (tuple(f.get_slice(k).get_shape()), short[f.get_slice(k).get_dtype()]) for k in names}


def declared(program: layoutlang.Program) -> dict[str, tuple[tuple[int, ...], str]]:
    return {name: (t.shape, t.dtype) for name, t in program.tensors.items() if name.startswith("base_model.")}


def config_only(folder: Path, dest: Path) -> Path:
    """The adapter's and the model's configs, without the adapter's weights."""
    dest.mkdir()
    for name in ("config.json", "adapter_config.json"):
        shutil.copy(folder / name, dest / name)
    return dest


def program_text(extra: str = "", *, model: str = "hf", dtype: str = "") -> str:
    adapter = f'tensors from peft "adapter_config.json" over cfg as lora{dtype}'
    return f'tensors from {model} "config.json" as cfg\n{adapter}\n{extra}'


def load(folder: Path, extra: str = "", **kwargs) -> layoutlang.Program:
    path = folder / "program.layout"
    path.write_text(program_text(extra, **kwargs))
    return layoutlang.load(path)


# -------------------------------------------------------------------- the tensors


@pytest.mark.parametrize("name", [n for n in ADAPTERS if n != "llama_bf16_kept"])
def test_declared_tensors_are_what_peft_saves(saved, tmp_path, name):
    want = stored(saved[name])
    assert want  # PEFT saved something
    # from the configs alone (fp32: PEFT's default, whatever the model's dtype)
    got = declared(load(config_only(saved[name], tmp_path / "configs")))
    assert got == want
    # with the adapter's checkpoint beside its config: the same, its header confirming them
    assert declared(load(saved[name])) == want


def test_all_linear_written_as_such_is_every_linear_layer_but_the_head(saved, tmp_path):
    # PEFT saves "all-linear" expanded; a config that says "all-linear" means the same modules
    folder = config_only(saved["llama_all_linear"], tmp_path / "configs")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert isinstance(config["target_modules"], list)
    config["target_modules"] = "all-linear"
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert declared(load(folder)) == stored(saved["llama_all_linear"])
    assert declared(load(saved["llama_list"])) == stored(saved["llama_all_linear"])


def test_dtype_of_an_adapter_kept_in_the_models_dtype(saved, tmp_path):
    want = stored(saved["llama_bf16_kept"])
    assert {dtype for _, dtype in want.values()} == {"bf16"}
    folder = config_only(saved["llama_bf16_kept"], tmp_path / "configs")
    # the config alone says fp32 (PEFT's default); the dtype clause says what this one holds
    assert {t.dtype for t in load(folder).tensors.values() if "lora" in t.name} == {"fp32"}
    assert declared(load(folder, dtype=" dtype bf16")) == want
    # the checkpoint beside gives the dtypes it stores
    assert declared(load(saved["llama_bf16_kept"])) == want
    # and a body, per pattern, as for tensors from hf
    mixed = load(folder, dtype=' { "*.lora_B.weight": bf16 }')
    assert {t.dtype for n, t in mixed.tensors.items() if n.endswith("lora_B.weight")} == {"bf16"}
    assert {t.dtype for n, t in mixed.tensors.items() if n.endswith("lora_A.weight")} == {"fp32"}


def test_adapter_constants(saved, tmp_path):
    program = load(saved["llama_patterns"], model="hf_constants")
    assert program.constants["lora.r"] == 8 and program.constants["lora.lora_alpha"] == 16
    assert program.constants["lora.max_rank"] == 8
    assert program.constants["cfg.num_key_value_heads"] == 2
    # hf_constants: the adapter's tensors only
    assert set(program.tensors) == set(stored(saved["llama_patterns"]))


def test_a_checkpoint_that_disagrees_with_the_config_is_an_error(saved, tmp_path):
    folder = tmp_path / "mixed"
    shutil.copytree(saved["llama_regex"], folder)
    shutil.copy(saved["llama_list"] / "adapter_model.safetensors", folder / "adapter_model.safetensors")
    with pytest.raises(LayoutError, match=r"adapter_model\.safetensors holds .* tensors the config does not describe"):
        load(folder)


# ------------------------------------------------------------------------ errors

BASE = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj"],
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
}

ERRORS = {
    "dora": ({"use_dora": True}, "'use_dora'", "DoRA"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "'modules_to_save'", "not supported"),
    "bias": ({"bias": "all"}, "'bias'", "only 'none'"),
    "lora_bias": ({"lora_bias": True}, "'lora_bias'", "not supported"),
    "peft_type": ({"peft_type": "IA3"}, "'peft_type'", "only LoRA"),
    "missing_module": ({"target_modules": ["q_proj", "qq_proj"]}, "'target_modules'", "'qq_proj' names no module"),
    "regex_matches_nothing": ({"target_modules": r".*\.w1"}, "'target_modules'", "matches no module"),
    "bad_regex": ({"target_modules": "(q_proj"}, "'target_modules'", "not a regular expression"),
    "embedding": ({"target_modules": ["embed_tokens"]}, "'target_modules'", "token embedding"),
    "head": ({"target_modules": ["lm_head"]}, "'target_modules'", "output head"),
    "norm": ({"target_modules": ["input_layernorm"]}, "'target_modules'", "is a norm"),
    "block": ({"target_modules": ["self_attn"]}, "'target_modules'", "is a block"),
    "no_targets": ({"target_modules": None}, "'target_modules'", "is missing"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 0}}, "'rank_pattern'", "positive integer"),
    "rank": ({"r": "8"}, "'r'", "positive integer"),
    "target_parameters": ({"target_parameters": ["gate_up_proj"]}, "'target_parameters'", "fused experts"),
    "layers": ({"layers_to_transform": "1"}, "'layers_to_transform'", "layer index"),
    "layers_with_regex": (
        {"target_modules": ".*q_proj", "layers_to_transform": [0]},
        "'layers_to_transform'",
        "target_modules is a string",
    ),
}


def write_adapter(folder: Path, config: dict, model: dict | None = None, model_type: str = "llama") -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type, **(model or LLAMA)}))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    path = folder / "program.layout"
    path.write_text(program_text())
    return path


def cli(argv: list[str], capsys) -> tuple[int, str]:
    status = main(argv)
    captured = capsys.readouterr()
    return status, captured.out + captured.err


@pytest.mark.parametrize("case", list(ERRORS))
def test_unsupported_adapters_are_errors_naming_the_file_and_key(tmp_path, capsys, case):
    change, key, words = ERRORS[case]
    path = write_adapter(tmp_path, BASE | change)
    status, out = cli(["check", str(path)], capsys)
    assert status == 2, out
    assert f"{tmp_path / 'adapter_config.json'}: {key}" in out and words in out, out
    assert "Traceback" not in out and ":2:" in out  # at the statement's path, line 2


@pytest.mark.parametrize("targets", [["gate_proj", "up_proj"], "all-linear", ["gate"], ["down_proj"]])
def test_the_mlp_of_an_moe_model_is_refused(tmp_path, capsys, targets):
    # PEFT 0.21 turns these into target_parameters on the fused experts (expert LoRA)
    path = write_adapter(tmp_path, BASE | {"target_modules": targets}, QWEN3_MOE, "qwen3_moe")
    status, out = cli(["check", str(path)], capsys)
    assert status == 2 and "'target_modules'" in out and "mixture-of-experts" in out, out
    assert "Traceback" not in out


def test_over_names_the_model(tmp_path, capsys):
    write_adapter(tmp_path, BASE)
    model = 'tensors from hf "config.json" as cfg\n'
    for text, words in [
        (model + 'tensors from peft "adapter_config.json" as lora', "needs the model"),
        (model + 'tensors from peft "adapter_config.json" over cgf', "did you mean 'cfg'"),
        ('tensors from hf "config.json" over cfg', "takes none"),
        (model + 'tensors from peft "adapter_config.json" over cfg as cfg', "model's names"),
    ]:
        path = tmp_path / "bad.layout"
        path.write_text(text + "\n")
        status, out = cli(["check", str(path)], capsys)
        assert status == 2 and words in out, out


# ------------------------------------------------------------- the vLLM presets


def heads(cfg: dict) -> tuple[int, int, int]:
    return cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]


def vllm_slices(
    full: dict[str, torch.Tensor], cfg: dict, tp: int, tp_rank: int, fully_sharded: bool, max_lora_rank: int
) -> dict[str, tuple[torch.Tensor, tuple[int, ...]]]:
    """What vLLM's LoRA layers copy into an adapter's slot on one rank, per logical tensor, and
    the shape of that slot: (the sliced tensor, the slot's [rows, columns])."""
    q_heads, kv_heads, head_dim = heads(cfg)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    # QKVParallelLinear: num_kv_heads per rank and num_kv_head_replicas
    replicas = max(1, tp // kv_heads)
    q_size, kv_size = q_heads // tp * head_dim, max(1, kv_heads // tp) * head_dim
    out = {}
    for name, tensor in full.items():
        module = name.split(".")[-3]
        a = name.endswith("lora_A.weight")
        rank_slot = max_lora_rank // tp if fully_sharded else max_lora_rank
        if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # column-parallel
            if a:
                if fully_sharded and tp > 1:  # slice_lora_a of the ...WithShardedLoRA classes
                    piece = tensor[tp_rank * rank_slot : tp_rank * rank_slot + rank_slot]
                else:
                    piece = tensor
                slot = (rank_slot, tensor.shape[1])
            else:
                size, shard = {
                    "q_proj": (q_size, tp_rank),
                    "k_proj": (kv_size, tp_rank // replicas),
                    "v_proj": (kv_size, tp_rank // replicas),
                    "gate_proj": (inter // tp, tp_rank),
                    "up_proj": (inter // tp, tp_rank),
                }[module]
                piece = tensor[size * shard : size * (shard + 1)]
                slot = (size, max_lora_rank)
        else:  # row-parallel: o_proj, down_proj
            if a:
                size = tensor.shape[1] // tp
                piece = tensor[:, tp_rank * size : (tp_rank + 1) * size]
                slot = (max_lora_rank, size)
            elif fully_sharded:
                size = hidden // tp
                piece = tensor[tp_rank * size : (tp_rank + 1) * size]
                slot = (size, max_lora_rank)
            else:
                piece, slot = tensor, (hidden, max_lora_rank)
        out[name] = (piece, slot)
    return out


def placed(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's storages, each box written where layoutlang places it (padding: NaN)."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()].copy_(
                full[name][box.slices()]
            )
    return out


SERVE = """
let vllm_max_lora_rank = {max_rank}
mesh infer [engine = 2, tp = {tp}]
include "preset:lora/vllm"
include "preset:lora/vllm_fully_sharded"
"""


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4 exceeds the 2 kv heads: each on 2 ranks
@pytest.mark.parametrize("fully_sharded", [False, True])
@pytest.mark.parametrize("adapter", ["llama_list", "llama_patterns", "qwen3_moe_attention"])
def test_vllm_presets_hold_what_vllms_lora_layers_load(saved, tp, fully_sharded, adapter):
    max_rank = 16  # the adapter's r is 8 (4 and 2 where rank_pattern says): the slot pads it
    program = load(saved[adapter], SERVE.format(tp=tp, max_rank=max_rank), model="hf_constants")
    layout = program.layout("vllm_lora_fully_sharded" if fully_sharded else "vllm_lora")
    layout.check()
    cfg = FAMILIES[ADAPTERS[adapter][0]][2]
    gen = torch.Generator().manual_seed(0)
    full = {name: torch.randn(t.shape, generator=gen) for name, t in program.tensors.items()}
    for rank in layout.mesh.ranks:
        tp_rank = rank % tp
        want = vllm_slices(full, cfg, tp, tp_rank, fully_sharded, max_rank)
        got = placed(layout, rank, full)
        assert set(got) == set(want), rank
        for name, (piece, slot) in want.items():
            storage = got[name]
            # what set_lora copies into the slot's [:rows, :columns]; the rest of the slot is zeros
            assert torch.equal(storage[: piece.shape[0], : piece.shape[1]], piece), (rank, name)
            if fully_sharded and name.endswith("lora_A.weight") and name.split(".")[-3] not in ("o_proj", "down_proj"):
                # the slot's rows: max_lora_rank / tp, the adapter's past its r only padding
                assert tuple(storage.shape) == slot and torch.isnan(storage[piece.shape[0] :]).all(), (rank, name)
            else:
                # unpadded: the logical tensor's own rank, where the slot has max_lora_rank
                assert tuple(storage.shape) == tuple(piece.shape), (rank, name)
                assert all(s <= m for s, m in zip(storage.shape, slot)), (rank, name)


def test_vllm_presets_require_what_vllm_asserts(saved):
    with pytest.raises(LayoutError, match="tp must divide num_attention_heads"):
        load(saved["llama_list"], SERVE.format(tp=8, max_rank=16), model="hf_constants")
    with pytest.raises(LayoutError, match="exceeds max_lora_rank"):
        load(saved["llama_list"], SERVE.format(tp=2, max_rank=4), model="hf_constants")
    with pytest.raises(LayoutError, match="tp must divide it"):
        load(saved["llama_list"], SERVE.format(tp=4, max_rank=10), model="hf_constants")


REFIT = """
mesh train [dp = 2] on ranks 0..1
mesh infer [engine = 2, tp = 2] on ranks 2..5
include "preset:lora/vllm"
# FSDP2 of the adapter: fully_shard cuts dim 0 of every parameter over the data-parallel ranks
layout fsdp2 on train { default: dp = shard(0) }
reshard refit: fsdp2 -> vllm_lora
"""


def test_refit_of_an_adapter_from_the_command_line(saved, tmp_path, capsys):
    folder = config_only(saved["llama_list"], tmp_path / "refit")
    path = folder / "refit.layout"
    path.write_text(program_text(REFIT, model="hf_constants"))
    status, out = cli(["check", str(path)], capsys)
    assert status == 0 and "28 tensors" in out, out
    status, out = cli(["plan", str(path), "--json"], capsys)
    assert status == 0, out
    result = json.loads(out)["result"]
    # only the adapter moves: what the four vLLM ranks hold of it, no byte of the model
    program = layoutlang.load(path)
    assert set(program.tensors) == set(stored(saved["llama_list"]))
    layout = program.layout("vllm_lora")
    held = sum(
        box.numel * 4 for name in program.tensors for rank in layout.mesh.ranks for box in layout.boxes(name, rank)
    )
    assert result["stats"]["bytes"] == {"local": 0, "domain": 0, "network": held}
    assert result["lower_bound_bytes"] == held


def test_a_device_or_a_link_out_of_the_folder_is_refused(saved, tmp_path, capsys):
    write_adapter(tmp_path / "device", BASE)
    path = tmp_path / "device" / "program.layout"
    path.write_text('tensors from hf "config.json" as cfg\ntensors from peft "/dev/zero" over cfg\n')
    status, out = cli(["check", str(path)], capsys)
    assert status == 2 and "/dev/zero: PEFT adapter config is a character device" in out, out
    # adapter_model.safetensors beside the config is confined to the folder, as a model's checkpoint
    folder = config_only(saved["llama_list"], tmp_path / "linked")
    (folder / "adapter_model.safetensors").symlink_to(saved["llama_list"] / "adapter_model.safetensors")
    (folder / "program.layout").write_text(program_text())
    status, out = cli(["check", str(folder / "program.layout")], capsys)
    assert status == 2 and "adapter_model.safetensors is a symbolic link" in out and "outside the folder" in out, out
