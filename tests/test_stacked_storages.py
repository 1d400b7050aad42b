"""Stacked and transposed storages: the engines' own parameters, byte for byte.

The oracles are written here from the engines' loading rules, not from layoutlang's model:

- vLLM's FusedMoE (``vllm/model_executor/layers/fused_moe/layer.py``): ``determine_expert_map``
  gives each EP rank its experts (``linear``: a contiguous range, the first ``E % ep`` ranks
  one more; ``round_robin``: ``e % ep == rank``, local id ``e // ep``); ``_load_w13`` narrows
  gate (``w1``) and up (``w3``) to the TP rank's rows along dim 0 (the bias along its last
  dim) and writes gate into the first half of the expert's ``w13``, up into the second;
  ``_load_w2`` narrows down along dim 1 (the input dim) and copies ``w2_bias`` whole.
- Megatron-core's legacy ``GroupedMLP`` (``megatron/core/transformer/moe/experts.py``):
  ``weight1`` is ``[hidden, local_experts * 2 * ffn / tp]`` and is used as
  ``weight1.view(local_experts, hidden, -1)``, each expert's ``[gate_r | up_r]`` transposed to
  ``[in, out]``; ``weight2`` is ``[local_experts * ffn / tp, hidden]``, used as
  ``view(local_experts, -1, hidden)``.
"""

from __future__ import annotations

import pytest
import stacked_jobs
import torch
from vllm_rules import expert_map, fused_moe

import layoutlang
from layoutlang.cli.main import main
from layoutlang.core import _core
from layoutlang.errors import LayoutError
from layoutlang.transport.nccl.copies import copy_pairs

E, H, F = 8, 16, 12  # experts, hidden, intermediate (ffn) size per expert


def vllm_program(ep: int, tp: int, placement: str = "linear", bias: bool = False) -> str:
    where = f"ep[e // {E // ep}]" if placement == "linear" else f"ep[e % {ep}]"
    bias_tensors = bias_rules = bias_storages = ""
    if bias:
        bias_tensors = f"""
tensor "mlp.experts.{{e}}.gate_proj.bias" [{F}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.up_proj.bias" [{F}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.down_proj.bias" [{H}] fp32 for e in 0..{E - 1}"""
        bias_rules = f"""
  "mlp.experts.{{e}}.gate_proj.bias": {where}, tp = shard(0)
  "mlp.experts.{{e}}.up_proj.bias": {where}, tp = shard(0)
  "mlp.experts.{{e}}.down_proj.bias": {where}"""
        bias_storages = """
  storage "mlp.experts.w13_bias" = stack e of "mlp.experts.{e}.gate_proj.bias" | "mlp.experts.{e}.up_proj.bias"
  storage "mlp.experts.w2_bias" = stack e of "mlp.experts.{e}.down_proj.bias\""""
    return f"""
mesh infer [ep = {ep}, tp = {tp}]
tensor "mlp.experts.{{e}}.gate_proj.weight" [{F}, {H}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.up_proj.weight" [{F}, {H}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.down_proj.weight" [{H}, {F}] fp32 for e in 0..{E - 1}{bias_tensors}
layout vllm on infer {{
  "mlp.experts.{{e}}.gate_proj.weight": {where}, tp = shard(0)
  "mlp.experts.{{e}}.up_proj.weight": {where}, tp = shard(0)
  "mlp.experts.{{e}}.down_proj.weight": {where}, tp = shard(1){bias_rules}
  storage "mlp.experts.w13_weight" [{E // ep}, {2 * F // tp}, {H}] =
      stack e of "mlp.experts.{{e}}.gate_proj.weight" | "mlp.experts.{{e}}.up_proj.weight"
  storage "mlp.experts.w2_weight" = stack e of "mlp.experts.{{e}}.down_proj.weight"{bias_storages}
}}
"""


def full_weights(program: layoutlang.Program | layoutlang.Layout) -> dict[str, torch.Tensor]:
    """Every logical tensor, random (the checkpoint an engine would load)."""
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(t.shape, generator=gen) for n, t in program.tensors.items()}


def placed_by_layoutlang(layout: layoutlang.Layout, rank: int, full: dict[str, torch.Tensor]) -> dict:
    """The rank's storages, each box written where layoutlang places it."""
    out = {name: torch.full(shape, float("nan")) for name, shape in layout.storages_on(rank).items()}
    for name in layout.tensors:
        for box in layout.boxes(name, rank):
            # box offsets index the shape the parts make (a storage viewed 'as' another shape)
            region = out[box.storage].view(layout.parts_shape(box.storage, rank))[box.storage_index()]
            (region.transpose(-1, -2) if box.transposed else region).copy_(full[name][box.slices()])
    return out


# ------------------------------------------------------------------- vLLM's rules


def vllm_storages(full, ep_rank: int, ep: int, tp_rank: int, tp: int, placement: str, bias: bool) -> dict:
    """What vLLM's FusedMoE weight_loader leaves in the rank's parameters."""
    experts = expert_map(ep_rank, ep, E, placement)
    shard = F // tp
    w13 = torch.empty(len(experts), 2 * shard, H)
    w2 = torch.empty(len(experts), H, shard)
    w13_bias = torch.empty(len(experts), 2 * shard)
    w2_bias = torch.empty(len(experts), H)
    for local, e in enumerate(experts):
        p = f"mlp.experts.{e}"
        w13[local].narrow(0, 0, shard).copy_(full[f"{p}.gate_proj.weight"].narrow(0, shard * tp_rank, shard))
        w13[local].narrow(0, shard, shard).copy_(full[f"{p}.up_proj.weight"].narrow(0, shard * tp_rank, shard))
        w2[local].copy_(full[f"{p}.down_proj.weight"].narrow(1, shard * tp_rank, shard))
        if bias:
            w13_bias[local].narrow(-1, 0, shard).copy_(full[f"{p}.gate_proj.bias"].narrow(-1, shard * tp_rank, shard))
            w13_bias[local].narrow(-1, shard, shard).copy_(full[f"{p}.up_proj.bias"].narrow(-1, shard * tp_rank, shard))
            w2_bias[local].copy_(full[f"{p}.down_proj.bias"])
    out = {"mlp.experts.w13_weight": w13, "mlp.experts.w2_weight": w2}
    if bias:
        out |= {"mlp.experts.w13_bias": w13_bias, "mlp.experts.w2_bias": w2_bias}
    return out


VLLM_CASES = [
    pytest.param(1, 2, "linear", False, id="tp-only"),
    pytest.param(2, 1, "linear", False, id="ep-only"),
    pytest.param(2, 2, "linear", False, id="ep-x-tp"),
    pytest.param(4, 1, "round_robin", False, id="round-robin"),
    pytest.param(2, 2, "round_robin", True, id="round-robin-ep-x-tp-biases"),
    pytest.param(2, 2, "linear", True, id="biases"),
]


@pytest.mark.parametrize(("ep", "tp", "placement", "bias"), VLLM_CASES)
def test_vllm_fused_moe_storages_hold_what_its_weight_loader_writes(ep, tp, placement, bias):
    program = layoutlang.loads(vllm_program(ep, tp, placement, bias), path="vllm.layout")
    layout = program.layout("vllm")
    layout.check()
    full = full_weights(program)
    for rank in layout.mesh.ranks:
        ep_rank, tp_rank = divmod(rank, tp)
        expected = vllm_storages(full, ep_rank, ep, tp_rank, tp, placement, bias)
        # storages_on gives the engine's own N-D parameter shapes
        assert layout.storages_on(rank) == {name: tuple(t.shape) for name, t in expected.items()}
        got = placed_by_layoutlang(layout, rank, full)
        for name, want in expected.items():
            assert torch.equal(got[name], want), (rank, name)


def test_a_stacked_storage_is_one_storage_per_layer():
    text = (
        vllm_program(2, 1)
        .replace('"mlp.experts.{e}', '"layers.{l}.mlp.experts.{e}')
        .replace(f"for e in 0..{E - 1}", f"for l in 0..1, e in 0..{E - 1}")
        .replace('storage "mlp.experts', 'storage "layers.{l}.mlp.experts')
    )
    layout = layoutlang.loads(text, path="layers.layout").layout("vllm")
    assert layout.storages_on(0) == {
        "layers.0.mlp.experts.w13_weight": (4, 2 * F, H),
        "layers.0.mlp.experts.w2_weight": (4, H, F),
        "layers.1.mlp.experts.w13_weight": (4, 2 * F, H),
        "layers.1.mlp.experts.w2_weight": (4, H, F),
    }
    parts = layout.storage_of("layers.1.mlp.experts.5.up_proj.weight").parts
    assert parts[3] == "layers.1.mlp.experts.1.up_proj.weight"


# ------------------------------------------------------------ Megatron's GroupedMLP


def megatron_program(ep: int, tp: int) -> str:
    """Megatron-core's legacy GroupedMLP: weight1 [H, local * 2F / tp], weight2 [local * F / tp, H]."""
    local = E // ep
    return f"""
mesh train [ep = {ep}, tp = {tp}]
tensor "mlp.experts.{{e}}.gate_proj.weight" [{F}, {H}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.up_proj.weight" [{F}, {H}] fp32 for e in 0..{E - 1}
tensor "mlp.experts.{{e}}.down_proj.weight" [{H}, {F}] fp32 for e in 0..{E - 1}
layout megatron on train {{
  "mlp.experts.{{e}}.gate_proj.weight": ep[e // {local}], tp = shard(0)
  "mlp.experts.{{e}}.up_proj.weight": ep[e // {local}], tp = shard(0)
  "mlp.experts.{{e}}.down_proj.weight": ep[e // {local}], tp = shard(1)
  storage "decoder.layers.0.mlp.experts.weight1" as [{H}, {local * 2 * F // tp}] =
      stack e of transposed "mlp.experts.{{e}}.gate_proj.weight" | transposed "mlp.experts.{{e}}.up_proj.weight" along 1
  storage "decoder.layers.0.mlp.experts.weight2" as [{local * F // tp}, {H}] =
      stack e of transposed "mlp.experts.{{e}}.down_proj.weight"
}}
"""


def megatron_storages(full, ep_rank: int, ep: int, tp_rank: int, tp: int) -> dict:
    """GroupedMLP's parameters on one rank: weight1.view(local, H, -1)[l] is expert l's
    [gate_r | up_r] as [in, out]; weight2.view(local, -1, H)[l] its down_r as [in, out]."""
    local, shard = E // ep, F // tp
    weight1 = torch.empty(H, local * 2 * shard)
    weight2 = torch.empty(local * shard, H)
    w1, w2 = weight1.view(local, H, -1), weight2.view(local, -1, H)
    for i in range(local):
        p = f"mlp.experts.{ep_rank * local + i}"
        rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
        w1[i].copy_(torch.cat([full[f"{p}.gate_proj.weight"][rows], full[f"{p}.up_proj.weight"][rows]]).T)
        w2[i].copy_(full[f"{p}.down_proj.weight"][:, rows].T)
    return {"decoder.layers.0.mlp.experts.weight1": weight1, "decoder.layers.0.mlp.experts.weight2": weight2}


@pytest.mark.parametrize(("ep", "tp"), [(2, 2), (1, 2), (4, 1)])
def test_megatron_legacy_grouped_mlp_storages_hold_transposed_experts(ep, tp):
    program = layoutlang.loads(megatron_program(ep, tp), path="megatron.layout")
    layout = program.layout("megatron")
    layout.check()
    full = full_weights(program)
    for rank in layout.mesh.ranks:
        ep_rank, tp_rank = divmod(rank, tp)
        expected = megatron_storages(full, ep_rank, ep, tp_rank, tp)
        assert layout.storages_on(rank) == {name: tuple(t.shape) for name, t in expected.items()}
        got = placed_by_layoutlang(layout, rank, full)
        for name, want in expected.items():
            assert torch.equal(got[name], want), (rank, name)
    box = layout.boxes("mlp.experts.1.up_proj.weight", 0)[0]
    assert box.transposed and str(box).endswith(".T")
    assert layout.parts_shape("decoder.layers.0.mlp.experts.weight1", 0) == (E // ep, H, 2 * F // tp)


def test_a_view_of_another_size_is_refused():
    text = megatron_program(2, 2).replace(f"as [{H}, {4 * 2 * F // 2}]", f"as [{H}, {8 * F}]")
    wrong = r"its parts make \[4, 16, 12\] \(768 elements\), which cannot be viewed as \[16, 96\]"
    with pytest.raises(LayoutError, match=wrong):
        layoutlang.loads(text, path="bad.layout").layout("megatron").check()


@pytest.mark.timeout(120)
@pytest.mark.workers(6)
def test_a_refit_from_megatrons_grouped_mlp_into_vllm_is_bit_exact(pool):
    """Megatron's transposed, viewed weight1/weight2 (ep = 2, ranks 0-1) into vLLM's w13/w2
    (ep = 2 x tp = 2, ranks 2-5), each side's storages computed by its engine's rules."""
    megatron = megatron_program(2, 1).replace("[ep = 2, tp = 1]", "[ep = 2, tp = 1] on ranks 0..1")
    vllm = vllm_program(2, 2).replace("mesh infer [ep = 2, tp = 2]", "mesh infer [ep = 2, tp = 2] on ranks 2..5")
    vllm = vllm.replace("tensor ", "# tensor ")  # the tensors are declared once, by the Megatron side
    text = megatron + vllm + "reshard megatron -> vllm\n"
    program = layoutlang.loads(text, path="refit.layout")
    full = full_weights(program)
    sources = {rank: megatron_storages(full, rank, 2, 0, 1) for rank in (0, 1)}
    results = [r for r in pool.run(stacked_jobs.refit_given, text, list(range(6)), sources) if r]
    for result in results[2:]:
        ep_rank, tp_rank = divmod(result["rank"] - 2, 2)
        expected = vllm_storages(full, ep_rank, 2, tp_rank, 2, "linear", False)
        assert sorted(result["destinations"]) == sorted(expected) == result["completed"]
        for name, want in expected.items():
            assert torch.equal(result["destinations"][name], want), (result["rank"], name)
    assert [r["rank"] for r in results] == list(range(6))


# ------------------------------------------------------------------- mistakes


def test_a_declared_stack_shape_that_does_not_hold_names_the_storage_and_rank():
    text = vllm_program(2, 2).replace(f"[{E // 2}, {2 * F // 2}, {H}]", f"[{E}, {F}, {H}]")
    with pytest.raises(LayoutError) as err:
        layoutlang.loads(text, path="bad.layout").layout("vllm").check()
    assert "storage 'mlp.experts.w13_weight' of layout 'vllm' on rank 0" in str(err.value)
    assert f"the stacked parts make [{E // 2}, {F}, {H}], the storage is declared [{E}, {F}, {H}]" in str(err.value)
    assert "bad.layout:" in str(err.value)


def test_a_stack_by_a_name_the_parts_do_not_capture_is_refused():
    text = vllm_program(2, 1).replace("stack e of", "stack x of", 1)
    with pytest.raises(LayoutError, match=r"stacks by 'x', which the first part .* does not capture") as err:
        layoutlang.loads(text, path="bad.layout")
    assert err.value.span is not None and err.value.span.path == "bad.layout"


def test_a_stacked_storage_named_after_its_element_is_refused():
    text = vllm_program(2, 1).replace('storage "mlp.experts.w2_weight"', 'storage "mlp.experts.{e}.w2"')
    with pytest.raises(LayoutError, match="uses its stack capture 'e'"):
        layoutlang.loads(text, path="bad.layout")


def test_parts_of_one_element_on_different_ranks_are_refused():
    up = '"mlp.experts.{e}.up_proj.weight": ep'
    text = vllm_program(2, 1).replace(f"{up}[e // 4]", f"{up}[1 - e // 4]")
    with pytest.raises(LayoutError, match="parts of one element must live on the same ranks"):
        layoutlang.loads(text, path="bad.layout").layout("vllm").check()


# ------------------------------------------------------------------- refit


def refit_program(ep: int, tp: int, placement: str) -> str:
    """torchtitan's stacked experts (ep = 2, ranks 0-1) into vLLM's FusedMoE (ranks 2...)."""
    vllm = vllm_program(ep, tp, placement).replace(
        f"mesh infer [ep = {ep}, tp = {tp}]", f"mesh infer [ep = {ep}, tp = {tp}] on ranks 2..{1 + ep * tp}"
    )
    return (
        vllm
        + f"""
mesh train [ep = 2] on ranks 0..1
layout titan on train {{
  "mlp.experts.{{e}}.*": ep[e // {E // 2}]
  storage "moe.experts.w1" = stack e of "mlp.experts.{{e}}.gate_proj.weight"
  storage "moe.experts.w3" = stack e of "mlp.experts.{{e}}.up_proj.weight"
  storage "moe.experts.w2" = stack e of "mlp.experts.{{e}}.down_proj.weight"
}}
reshard titan -> vllm
"""
    )


@pytest.mark.timeout(120)
@pytest.mark.workers(6)
@pytest.mark.parametrize(("ep", "tp", "placement"), [(2, 2, "round_robin"), (1, 4, "linear"), (4, 1, "linear")])
def test_a_refit_from_torchtitans_stacked_experts_into_vllms_w13_and_w2_is_bit_exact(pool, ep, tp, placement):
    text = refit_program(ep, tp, placement)
    participants = list(range(2 + ep * tp))
    results = [r for r in pool.run(stacked_jobs.refit_stacked, text, participants, [0, 1], (E, H, F)) if r]
    titan = stacked_jobs.titan_full(E, H, F)
    full = {}
    for e in range(E):  # torchtitan's stacked tensors, read as the per-expert logical tensors
        full[f"mlp.experts.{e}.gate_proj.weight"] = titan["moe.experts.w1"][e]
        full[f"mlp.experts.{e}.up_proj.weight"] = titan["moe.experts.w3"][e]
        full[f"mlp.experts.{e}.down_proj.weight"] = titan["moe.experts.w2"][e]
    checked = 0
    for result in results:
        rank = result["rank"]
        if rank < 2:
            assert result["destinations"] == {}
            continue
        ep_rank, tp_rank = divmod(rank - 2, tp)
        expected = vllm_storages(full, ep_rank, ep, tp_rank, tp, placement, False)
        assert sorted(result["destinations"]) == sorted(expected)
        for name, want in expected.items():
            got = result["destinations"][name]
            assert got.shape == want.shape and torch.equal(got, want), (rank, name)
            checked += 1
        assert result["completed"] == sorted(expected)
    assert checked == 2 * ep * tp


def test_plan_explain_gives_the_places_in_stacked_and_transposed_storages(tmp_path, capsys):
    megatron = megatron_program(2, 1).replace("[ep = 2, tp = 1]", "[ep = 2, tp = 1] on ranks 0..1")
    vllm = vllm_program(2, 2).replace("mesh infer [ep = 2, tp = 2]", "mesh infer [ep = 2, tp = 2] on ranks 2..5")
    path = tmp_path / "refit.layout"
    path.write_text(megatron + vllm.replace("tensor ", "# tensor ") + "reshard megatron -> vllm\n")
    assert main(["plan", str(path), "--no-compare", "--explain", "mlp.experts.5.up_proj.weight"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if "r1 -> r4" in line]
    # expert 5: element 1 on Megatron's ep rank 1 (rows 12:18 of its [16, 2 * 12] element,
    # transposed), and element 1 on vLLM's ep rank 1 (up's half of w13, tp rank 0's rows)
    move = f"mlp.experts.5.up_proj.weight[0:6, 0:{H}] r1 -> r4 network (bucket 0, stage 0)"
    places = f"from decoder.layers.0.mlp.experts.weight1[1, 0:{H}, 12:18].T into mlp.experts.w13_weight[1, 6:12, 0:{H}]"
    assert lines == [f"{move} {places}"]


def test_plan_explain_says_where_a_relay_reads_from(tmp_path, capsys):
    # vLLM replicas (dp) side by side in one domain: one receives each expert over the
    # network, the other gets it from the first one's storage (a relay)
    megatron = megatron_program(2, 1).replace("[ep = 2, tp = 1]", "[ep = 2, tp = 1] on ranks 0..1")
    vllm = (vllm_program(2, 1).replace("mesh infer [ep = 2, tp = 1]", "mesh infer [ep = 2, dp = 2] on ranks 2..5")
            .replace("tp = shard(0)", "dp = replicate").replace("tp = shard(1)", "dp = replicate"))
    path = tmp_path / "refit.layout"
    path.write_text("topology { domain_size = 2 }\n" + megatron + vllm.replace("tensor ", "# tensor ")
                    + "reshard megatron -> vllm\n")
    assert main(["plan", str(path), "--no-compare", "--explain", "mlp.experts.5.up_proj.weight"]) == 0
    (relay,) = [line.strip() for line in capsys.readouterr().out.splitlines() if "relay" in line]
    place = f"mlp.experts.w13_weight[1, {F}:{2 * F}, 0:{H}]"
    assert relay.endswith(f"(bucket 0, stage 1, relay) from {place} into {place}")


def test_the_native_box_copies_write_transposed_and_stacked_regions():
    """The device path's pitched copies (CudaMock: host memory) take the executor's views of
    a stacked, transposed storage as they are: strides swapped, one element of the stack."""
    layout = layoutlang.loads(megatron_program(2, 1), path="megatron.layout").layout("megatron")
    full = full_weights(layout)
    engine = torch.zeros(layout.storages_on(1)["decoder.layers.0.mlp.experts.weight1"])
    parts = engine.view(layout.parts_shape("decoder.layers.0.mlp.experts.weight1", 1))
    names = [f"mlp.experts.{e}.{p}_proj.weight" for e in range(E // 2, E) for p in ("gate", "up")]
    pairs = [
        (parts[box.storage_index()].transpose(-1, -2), full[name][box.slices()].contiguous())
        for name in names
        for box in layout.boxes(name, 1)
    ]
    copy_pairs(pairs, cuda=_core.nccl.CudaMock())
    assert torch.equal(engine, megatron_storages(full, 1, 2, 0, 1)["decoder.layers.0.mlp.experts.weight1"])


STACK_MISTAKES = [
    (
        'tensor "x.{e}.w" [4, 2] fp32 for e in 0..1\ntensor "x.2.w" [4, 3] fp32',
        'storage "x.stack" = stack e of "x.{e}.w"',
        r"element 2 of the stack has local shape \[4, 3\], the first has \[4, 2\]; stacked elements must",
    ),
    (
        'tensor "x.{e}.b" [4] fp32 for e in 0..1',
        'storage "x.stack" = stack e of transposed "x.{e}.b"',
        "storage 'x.stack' transposes tensor 'x.0.b', which has 1 dims",
    ),
    (
        'tensor "x.{e}.w" [4, 2] fp32 for e in 0..1',
        'storage "x.stack" = stack e of "x.{e}.w" blocks(2)',
        r"interleaved parts \(blocks\) can be neither stacked nor transposed",
    ),
]


@pytest.mark.parametrize(("tensors", "storage", "message"), STACK_MISTAKES)
def test_stack_mistakes_are_layout_errors_at_the_storage(tensors, storage, message):
    text = f"mesh m [tp = 1]\n{tensors}\nlayout l on m {{\n  default: replicate\n  {storage}\n}}\n"
    with pytest.raises(LayoutError, match=message) as err:
        layoutlang.loads(text, path="bad.layout").layout("l").check()
    assert err.value.span is not None and err.value.span.path == "bad.layout"
    assert err.value.span.line == text.splitlines().index(f"  {storage}") + 1


@pytest.mark.timeout(120)
@pytest.mark.workers(6)
def test_a_flattened_engine_parameter_is_refused_on_every_rank(pool):
    """The runtime takes the engine's 3-D parameter as it is; a view(-1, H) of it is a
    mistake that stops every rank before a byte moves, naming the storage and both shapes."""
    megatron = megatron_program(2, 1).replace("[ep = 2, tp = 1]", "[ep = 2, tp = 1] on ranks 0..1")
    vllm = vllm_program(2, 2).replace("mesh infer [ep = 2, tp = 2]", "mesh infer [ep = 2, tp = 2] on ranks 2..5")
    text = megatron + vllm.replace("tensor ", "# tensor ") + "reshard megatron -> vllm\n"
    full = full_weights(layoutlang.loads(text, path="refit.layout"))
    sources = {rank: megatron_storages(full, rank, 2, 0, 1) for rank in (0, 1)}
    args = (text, list(range(6)), sources, "mlp.experts.w13_weight", 3)
    messages = pool.run(stacked_jobs.refit_into_flattened, *args)[:6]
    assert all(m is not None for m in messages)
    wanted = f"'mlp.experts.w13_weight' has shape [{4 * F}, {H}], layout 'vllm' needs [4, {F}, {H}]"
    assert wanted in messages[3]
    assert all("rank 3" in m for m in messages)


# ------------------------------------------------------------ empty stacks

FEW = 3  # experts, fewer than the EP ranks below


def few_experts_program(mesh: str, where: str, layers: int = 1, declared: str = "") -> str:
    """vLLM's FusedMoE with more EP ranks than experts (``where`` places expert e of layer l)."""
    return f"""
mesh infer [{mesh}]
tensor "layers.{{l}}.experts.{{e}}.gate_proj.weight" [{F}, {H}] fp32 for l in 0..{layers - 1}, e in 0..{FEW - 1}
tensor "layers.{{l}}.experts.{{e}}.up_proj.weight" [{F}, {H}] fp32 for l in 0..{layers - 1}, e in 0..{FEW - 1}
tensor "layers.{{l}}.experts.{{e}}.down_proj.weight" [{H}, {F}] fp32 for l in 0..{layers - 1}, e in 0..{FEW - 1}
layout vllm on infer {{
  "layers.{{l}}.experts.{{e}}.*": {where}
  storage "layers.{{l}}.experts.w13_weight"{declared} =
      stack e of "layers.{{l}}.experts.{{e}}.gate_proj.weight" | "layers.{{l}}.experts.{{e}}.up_proj.weight"
  storage "layers.{{l}}.experts.w2_weight" = stack e of "layers.{{l}}.experts.{{e}}.down_proj.weight"
}}
"""


def few_experts_in_vllm(full: dict, experts: list[int], layer: int = 0) -> dict[str, torch.Tensor]:
    """An EP rank's w13_weight and w2_weight after FusedMoE's loaders (whole experts)."""
    p = f"layers.{layer}.experts"
    names = [tuple(f"{p}.{e}.{w}_proj.weight" for w in ("gate", "up", "down")) for e in experts]
    w13, w2 = fused_moe(full, names, 1, 0, full[f"{p}.0.gate_proj.weight"])
    return {f"{p}.w13_weight": w13, f"{p}.w2_weight": w2}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mesh", "where", "strategy"),
    [
        # determine_expert_map with 3 experts on 4 EP ranks: base 0, remainder 3, so expert e on
        # EP rank e under both strategies, and EP rank 3 has none
        pytest.param("ep = 4", "ep[max(e // 1, (e - 3) // 1)]", "linear", id="ep4-linear"),
        pytest.param("ep = 4", "ep[e % 4]", "round_robin", id="ep4-round-robin"),
        # EP over dp x tp (EP rank dp_rank * tp + tp_rank): dp rank 1 holds only expert 2
        pytest.param("dp = 2, tp = 2", "dp[e // 2], tp[e % 2]", "linear", id="dp2-x-tp2"),
    ],
)
def test_a_rank_with_no_expert_holds_vllms_empty_stack(mesh, where, strategy):
    layout = layoutlang.loads(few_experts_program(mesh, where), path="few.layout").layout("vllm")
    layout.check()
    full = full_weights(layout)
    for rank in layout.mesh.ranks:
        want = few_experts_in_vllm(full, expert_map(rank, 4, FEW, strategy))
        assert layout.storages_on(rank) == {n: tuple(t.shape) for n, t in want.items()}, rank
        got = placed_by_layoutlang(layout, rank, full)
        assert all(torch.equal(got[n], t) for n, t in want.items()), rank
    assert layout.storage_shape("layers.0.experts.w13_weight", 3) == (0, 2 * F, H)
    assert layout.parts_shape("layers.0.experts.w2_weight", 3) == (0, H, F)


@pytest.mark.timeout(60)
def test_an_axis_whose_coordinate_does_not_read_the_stack_capture_keeps_the_storage_off_its_other_ranks():
    # two experts, both on dp rank 0: dp still spreads the stack (its coordinate reads e), so dp
    # rank 1 holds it empty; pp (read from l only) keeps layer 0's storage on stage 0
    text = few_experts_program("pp = 2, dp = 2, tp = 2", "pp[l], dp[e // 2], tp[e % 2]", layers=2)
    text = text.replace(f"e in 0..{FEW - 1}", "e in 0..1")
    layout = layoutlang.loads(text, path="few.layout").layout("vllm")
    layout.check()
    mesh = layout.mesh
    for rank in mesh.ranks:
        coords = mesh.coords(rank)
        held = {n: s[0] for n, s in layout.storages_on(rank).items()}
        experts = 1 if coords["dp"] == 0 else 0
        layer = coords["pp"]
        assert held == {f"layers.{layer}.experts.w13_weight": experts, f"layers.{layer}.experts.w2_weight": experts}


@pytest.mark.timeout(60)
def test_an_empty_stack_that_contradicts_its_declared_shape_names_the_storage_and_rank():
    text = few_experts_program("ep = 4", "ep[e]", declared=f" [1, {2 * F}, {H}]")
    with pytest.raises(LayoutError) as err:
        layoutlang.loads(text, path="few.layout").layout("vllm").check()
    message = str(err.value)
    assert f"storage 'layers.0.experts.w13_weight' of layout 'vllm' on rank 3 is [0, {2 * F}, {H}]" in message
    assert "holds no element of the stack" in message and f"declared [1, {2 * F}, {H}]" in message


@pytest.mark.timeout(120)
@pytest.mark.workers(5)
def test_a_refit_into_more_ep_ranks_than_experts_writes_and_announces_the_empty_stacks(pool):
    # torchtitan's stacked experts whole on rank 0, into vLLM over 4 EP ranks (1..4) of 3 experts
    vllm = few_experts_program("ep = 4", "ep[e]").replace("[ep = 4]", "[ep = 4] on ranks 1..4")
    text = (
        vllm
        + """
mesh train [ep = 1] on ranks 0..0
layout titan on train {
  "layers.{l}.experts.{e}.*": ep[0]
  storage "moe.experts.w1" = stack e of "layers.{l}.experts.{e}.gate_proj.weight"
  storage "moe.experts.w3" = stack e of "layers.{l}.experts.{e}.up_proj.weight"
  storage "moe.experts.w2" = stack e of "layers.{l}.experts.{e}.down_proj.weight"
}
reshard titan -> vllm
"""
    )
    results = [r for r in pool.run(stacked_jobs.refit_stacked, text, list(range(5)), [0], (FEW, H, F)) if r]
    titan = stacked_jobs.titan_full(FEW, H, F)
    full = {}
    for e in range(FEW):  # torchtitan's stacked tensors, read as the per-expert logical tensors
        full[f"layers.0.experts.{e}.gate_proj.weight"] = titan["moe.experts.w1"][e]
        full[f"layers.0.experts.{e}.up_proj.weight"] = titan["moe.experts.w3"][e]
        full[f"layers.0.experts.{e}.down_proj.weight"] = titan["moe.experts.w2"][e]
    assert sorted(r["rank"] for r in results) == list(range(5))
    for result in results[1:]:
        want = few_experts_in_vllm(full, expert_map(result["rank"] - 1, 4, FEW))
        got = result["destinations"]
        assert got.keys() == want.keys(), result["rank"]
        for name, tensor in want.items():
            assert got[name].shape == tensor.shape and torch.equal(got[name], tensor), (result["rank"], name)
        assert result["completed"] == sorted(want)
