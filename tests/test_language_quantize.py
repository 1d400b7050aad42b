"""``quantize`` statements: FP8 and MXFP8 destinations, their derived scale tensors, where each
rank's scales go, and the mistakes refused before any plan is made (issue 16)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import layoutlang
from layoutlang.errors import LayoutError, LayoutNameError, LayoutSyntaxError, LayoutValueError
from layoutlang.model import LogicalTensor

pytestmark = pytest.mark.timeout(60)

MODEL = """
mesh infer [tp = 4]
tensor "layers.{l}.mlp.gate_proj.weight" [2048, 7168] bf16 for l in 0..1
tensor "layers.{l}.mlp.up_proj.weight" [2048, 7168] bf16 for l in 0..1
tensor "layers.{l}.mlp.down_proj.weight" [7168, 2000] bf16 for l in 0..1
tensor "norm.weight" [7168] bf16
"""


def load(body: str, model: str = MODEL) -> layoutlang.Program:
    program = layoutlang.loads(model + body, "q.layout")
    program.check()
    return program


def box_text(boxes: list) -> list[str]:
    return [str(b) for b in boxes]


def test_deepseek_blocks_sharded_like_the_weight() -> None:
    program = load("""
layout serve on infer {
  default: replicate
  "*.gate_proj.weight": tp = shard(0)
  "*.up_proj.weight": tp = shard(0)
  "*.down_proj.weight": tp = shard(0)
  quantize "layers.*.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""")
    layout = program.layout("serve")
    quantized = layout.quantized()
    assert sorted(quantized) == sorted(n for n in program.tensors if n != "norm.weight")
    q = layout.quantization("layers.0.mlp.down_proj.weight")
    assert q is not None and q.block == (128, 128) and q.values == "fp8_e4m3" and q.fmax == 448.0
    # DeepSeek-V3's name and shape: [ceil(N / 128), ceil(K / 128)] in fp32
    assert q.scale == LogicalTensor("layers.0.mlp.down_proj.weight_scale_inv", (56, 16), "fp32")
    assert q.nbytes == 7168 * 2000 + 56 * 16 * 4
    assert layout.quantization("norm.weight") is None
    assert len(layout.scale_tensors()) == 6
    # 2048 rows over tp = 4: 512 each, 4 blocks; 7168 columns: 56 blocks
    for rank in range(4):
        (box,) = layout.boxes("layers.0.mlp.gate_proj.weight", rank)
        (scale,) = layout.scale_boxes("layers.0.mlp.gate_proj.weight", rank)
        assert scale.offsets == (box.offsets[0] // 128, 0)
        assert scale.sizes == (math.ceil((box.offsets[0] + box.sizes[0]) / 128) - box.offsets[0] // 128, 56)
        assert scale.storage == "layers.0.mlp.gate_proj.weight_scale_inv" and scale.storage_offsets == (0, 0)
        assert layout.scale_storages_on(rank)["layers.0.mlp.gate_proj.weight_scale_inv"] == (4, 56)


def test_a_shard_that_splits_a_block_is_refused_naming_tensor_and_rank() -> None:
    # down_proj [7168, 2000] sharded by columns: torch.chunk gives 500 columns per rank
    with pytest.raises(LayoutValueError) as info:
        load("""
layout serve on infer {
  default: replicate
  "*.down_proj.weight": tp = shard(1)
  quantize "*.down_proj.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""")
    err = info.value
    assert err.tensor == "layers.0.mlp.down_proj.weight" and err.rank == 0
    assert "rank 0 holds 0:500 of dim 1, which cuts its 128 x 128 blocks at 500" in err.message
    assert "no rank holds that block whole" in err.message
    assert err.span is not None and (err.span.path, err.span.line, err.span.column) == ("q.layout", 11, 3)
    assert str(err).startswith("q.layout:11:3: error: tensor 'layers.0.mlp.down_proj.weight'")


def test_tp_of_100_rows_with_128_row_blocks() -> None:
    with pytest.raises(LayoutValueError, match=r"rank 0 holds 0:100 of dim 0, which cuts its 128 x 128 blocks at 100"):
        load(
            """
layout serve on infer {
  default: tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""",
            'mesh infer [tp = 4]\ntensor "w" [400, 256] bf16\n',
        )


def test_partial_blocks_at_the_end_are_fine() -> None:
    """511 rows on tp = 2: torch.chunk gives 256 and 255, so the last rank ends on the tensor's
    end, in a partial block; 300 columns end in a partial block too."""
    program = load(
        """
layout serve on infer {
  default: tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""",
        'mesh infer [tp = 2]\ntensor "w" [511, 300] bf16\n',
    )
    layout = program.layout("serve")
    assert layout.scale_tensors()["w_scale_inv"].shape == (4, 3)
    assert box_text(layout.scale_boxes("w", 1)) == ["w_scale_inv[2:4, 0:3] at w_scale_inv[0:2, 0:3]"]
    assert layout.scale_storages_on(1) == {"w_scale_inv": (2, 3)}


def test_scale_storage_shape_must_match_the_blocks() -> None:
    body = """
layout serve on infer {{
  default: tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32 into "w_scale_inv" [{shape}]
}}
"""
    model = 'mesh infer [tp = 2]\ntensor "w" [512, 300] bf16\n'
    layout = load(body.format(shape="2, 3"), model).layout("serve")
    assert layout.scale_storages_on(1) == {"w_scale_inv": (2, 3)}
    with pytest.raises(LayoutValueError) as info:
        load(body.format(shape="2, 2"), model)
    assert info.value.message == (
        "scale storage 'w_scale_inv' of tensor 'w' in layout 'serve' on rank 0: the blocks make it [2, 3] "
        "(128 x 128 blocks), it is declared [2, 2]"
    )
    assert info.value.rank == 0 and info.value.span is not None and info.value.span.line == 6


@pytest.mark.parametrize(
    ("statement", "error", "message", "column"),
    [
        ('quantize "w" as fp4 blocks 128 x 128 scale_inv fp32', LayoutValueError, "unsupported format 'fp4'", 19),
        ('quantize "w" as fp8_e4m3 blocks 128 x 128 scale fp16', LayoutValueError, "keeps its scales in fp32", 3),
        ('quantize "w" as mxfp8 blocks 1 x 32 scale_inv fp32', LayoutValueError, "keeps its scales in e8m0", 3),
        ('quantize "w" as mxfp8 blocks 1 x 64 scale_inv e8m0', LayoutValueError, "its block is 1 x 32", 3),
        ('quantize "w" as fp8_e4m3 per_row scale_inv fp32', LayoutNameError, "unknown block shape 'per_row'", 28),
        ('quantize "w" as fp8_e4m3 blocks 0 x 128 scale_inv fp32', LayoutValueError, "between 1 and", 28),
        ('quantize "w" as fp8_e4m3 blocks 128 x 128 scaled fp32', LayoutValueError, "convention 'scaled'", 45),
        ('quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv f32x', LayoutValueError, "scale dtype 'f32x'", 55),
        ('quantize "v" as fp8_e4m3 blocks 128 x 128 scale_inv fp32', LayoutNameError, "matches no tensor", 12),
        ('quantize "w" as fp8_e4m3 blocks 1 x 128 x 128 scale_inv fp32', LayoutValueError, "gives a block of 3", 3),
        ('quantize "i" as fp8_e4m3 per_tensor scale_inv fp32', LayoutValueError, "'i' is int32", 3),
    ],
)
def test_mistakes_point_at_the_statement(statement: str, error: type, message: str, column: int) -> None:
    model = 'mesh m [tp = 2]\ntensor "w" [256, 256] bf16\ntensor "i" [4] int32\n'
    with pytest.raises(error, match=message) as info:
        load(f"layout l on m {{\n  default: replicate\n  {statement}\n}}\n", model)
    span = info.value.span
    assert span is not None and (span.path, span.line, span.column) == ("q.layout", 6, column)


def test_syntax_errors_are_layout_errors() -> None:
    with pytest.raises(LayoutSyntaxError):
        load('layout l on m { default: replicate quantize "w" fp8_e4m3 blocks 128 x 128 scale_inv fp32 }')
    with pytest.raises(LayoutSyntaxError):
        load('layout l on m { default: replicate quantize "w" as fp8_e4m3 blocks 128 x scale_inv fp32 }')


def test_named_blocks_replicated_scales_and_conventions() -> None:
    program = load(
        """
let k = 32
layout serve on m {
  default: tp = shard(0)
  quantize "*.o_proj.weight" as fp8_e4m3 per_channel scale fp32
  quantize "*.lm_head.weight" as fp8_e5m2 per_tensor scale_inv fp32 replicate
  quantize "*.experts.*" as mxfp8 blocks 1 x k scale_inv e8m0
}
""",
        """
mesh m [tp = 2]
tensor "model.o_proj.weight" [64, 100] bf16
tensor "model.lm_head.weight" [64, 100] fp32
tensor "model.experts.w" [8, 64, 96] bf16
""",
    )
    layout = program.layout("serve")
    o = layout.quantization("model.o_proj.weight")
    assert o is not None and o.block == (1, 100)
    assert o.scale == LogicalTensor("model.o_proj.weight_scale", (64, 1), "fp32")
    head = layout.quantization("model.lm_head.weight")
    assert head is not None and head.block == (64, 100) and head.scale.shape == (1, 1) and head.replicated
    for rank in (0, 1):
        (box,) = layout.scale_boxes("model.lm_head.weight", rank)
        assert (box.offsets, box.sizes, box.storage) == ((0, 0), (1, 1), "model.lm_head.weight_scale_inv")
    experts = layout.quantization("model.experts.w")
    assert experts is not None and experts.block == (1, 1, 32) and experts.values == "fp8_e4m3"
    assert experts.scale == LogicalTensor("model.experts.w_scale_inv", (8, 64, 3), "e8m0")
    assert box_text(layout.scale_boxes("model.experts.w", 1)) == [
        "model.experts.w_scale_inv[4:8, 0:64, 0:3] at model.experts.w_scale_inv[0:4, 0:64, 0:3]"
    ]


def test_fused_storage_gets_a_fused_scale_storage() -> None:
    """vLLM's gate_up_proj.weight beside gate_up_proj.weight_scale_inv: each part's scales at
    its place, the storage offset divided by the block."""
    program = load(
        """
layout serve on infer {
  default: replicate
  "*.gate_proj.weight": tp = shard(0)
  "*.up_proj.weight": tp = shard(0)
  "*.down_proj.weight": tp = shard(0)
  storage "layers.{l}.mlp.gate_up_proj.weight" = "layers.{l}.mlp.gate_proj.weight" | "layers.{l}.mlp.up_proj.weight"
  quantize "layers.*.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
"""
    )
    layout = program.layout("serve")
    assert box_text(layout.scale_boxes("layers.1.mlp.up_proj.weight", 2)) == [
        "layers.1.mlp.up_proj.weight_scale_inv[8:12, 0:56] at layers.1.mlp.gate_up_proj.weight_scale_inv[4:8, 0:56]"
    ]
    assert layout.scale_storages_on(2)["layers.1.mlp.gate_up_proj.weight_scale_inv"] == (8, 56)


def test_fused_parts_must_be_quantized_alike() -> None:
    with pytest.raises(LayoutValueError, match="fuses 'gate' and 'up', which are not quantized alike"):
        load(
            """
layout serve on m {
  default: replicate
  storage "gate_up" = "gate" | "up"
  quantize "gate" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""",
            'mesh m [tp = 1]\ntensor "gate" [256, 256] bf16\ntensor "up" [256, 256] bf16\n',
        )


def test_fused_part_off_the_block_grid_is_refused() -> None:
    with pytest.raises(LayoutValueError, match="its box starts at 200 of dim 0 of storage 'gate_up'"):
        load(
            """
layout serve on m {
  default: replicate
  storage "gate_up" = "gate" | "up"
  quantize "*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
""",
            'mesh m [tp = 1]\ntensor "gate" [200, 256] bf16\ntensor "up" [200, 256] bf16\n',
        )


def test_extends_replaces_the_same_pattern() -> None:
    program = load("""
layout base on infer {
  default: replicate
  quantize "layers.*.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
layout serve on infer extends base {
  quantize "layers.*.weight" as fp8_e5m2 blocks 128 x 128 scale fp32
}
""")
    q = program.layout("serve").quantization("layers.0.mlp.up_proj.weight")
    assert q is not None and (q.format, q.convention, q.scale.name) == (
        "fp8_e5m2",
        "scale",
        "layers.0.mlp.up_proj.weight_scale",
    )
    assert program.layout("base").quantization("layers.0.mlp.up_proj.weight").format == "fp8_e4m3"  # type: ignore[union-attr]


def test_a_layout_without_quantize_is_unchanged() -> None:
    program = load('layout serve on infer { default: tp = shard(0) }')
    layout = program.layout("serve")
    assert layout.quantize == () and layout.quantized() == {} and layout.scale_tensors() == {}
    with pytest.raises(LayoutValueError, match="not quantized"):
        layout.scale_boxes("norm.weight", 0)


def test_a_reshard_from_a_quantized_layout_is_refused() -> None:
    """Into a quantized layout a reshard is planned (tests/test_fp8_refit.py); out of one it is
    refused where it is declared: refits dequantize nothing."""
    text = """
layout train on infer { default: replicate }
layout serve on infer {
  default: replicate
  quantize "layers.*.weight" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard {arrow}
"""
    load(text.replace("{arrow}", "train -> serve"))
    with pytest.raises(LayoutError, match=r"source layout 'serve' stores tensors quantized \(line \d+\)"):
        load(text.replace("{arrow}", "serve -> train"))


def test_a_scale_name_taken_by_a_declared_tensor() -> None:
    with pytest.raises(LayoutValueError, match="would be named 'w_scale_inv', a tensor the program declares"):
        load(
            'layout l on m { default: replicate quantize "w" as fp8_e4m3 per_tensor scale_inv fp32 }',
            'mesh m [tp = 1]\ntensor "w" [4, 4] bf16\ntensor "w_scale_inv" [1, 1] fp32\n',
        )


STACKED = """
mesh infer [tp = 2]
tensor "experts.{{e}}.gate" [{rows}, 128] bf16 for e in 0..3
tensor "experts.{{e}}.up" [{rows}, 128] bf16 for e in 0..3
layout serve on infer {{
  default: tp = shard(0)
  storage "w13" = stack e of "experts.{{e}}.gate" | "experts.{{e}}.up"
  quantize "experts.*" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}}
"""


def test_a_stacked_storage_keeps_its_scales_stacked() -> None:
    """vLLM's w13_weight [experts, 2 * I / tp, H] beside w13_weight_scale_inv [experts, 2 * I / tp / 128, H / 128]."""
    layout = load("", STACKED.format(rows=256)).layout("serve")
    assert box_text(layout.scale_boxes("experts.2.up", 1)) == [
        "experts.2.up_scale_inv[1:2, 0:1] at w13_scale_inv[2:3, 1:2, 0:1]"
    ]
    assert layout.scale_storages_on(0) == {"w13_scale_inv": (4, 2, 1)}


@pytest.mark.parametrize("expert", [0, 3])
def test_every_element_of_a_stack_is_checked(expert: int) -> None:
    """The elements' blocks are checked once per kind of element: one placed otherwise (strided
    halves of 64 rows, the same local shape) is still caught, first or last."""
    model = STACKED.format(rows=256).replace(
        "  default: tp = shard(0)\n", f'  default: tp = shard(0)\n  "experts.{expert}.up": tp = shard(0, blocks = 2)\n'
    )
    with pytest.raises(LayoutValueError, match=rf"tensor 'experts\.{expert}\.up' in layout 'serve': rank 0 holds 0:64"):
        load("", model)


def test_a_mistake_of_the_statement_names_a_tensor_it_quantizes() -> None:
    with pytest.raises(LayoutValueError) as info:
        load('layout serve on infer { default: replicate quantize "*.up_proj.weight" as int4 per_tensor scale fp32 }')
    assert info.value.tensor == "layers.0.mlp.up_proj.weight"
    assert info.value.message.endswith("(the statement quantizes 'layers.0.mlp.up_proj.weight', ...)")


@pytest.mark.parametrize(
    ("mesh", "rule", "placements", "shape"),
    [
        ("[tp = 4]", "tp = shard(0)", "S0", (1024, 300)),
        ("[tp = 4]", "tp = shard(1)", "S1", (200, 1022)),  # 256 columns each, the last 254
        ("[dp = 2, tp = 4]", "dp = shard(0), tp = shard(0)", "S0S0", (2048, 130)),
        ("[dp = 2, tp = 2]", "dp = shard(1), tp = shard(0)", "S1S0", (512, 511)),
    ],
)
def test_scales_placed_like_the_weight_are_dtensors_placement_of_the_scale_tensor(
    mesh: str, rule: str, placements: str, shape: tuple[int, int]
) -> None:
    """Where every shard holds whole blocks, each rank's scales are what DTensor's placement of
    the scale tensor itself gives the rank (the oracle: DTensor's own shard math)."""
    pytest.importorskip("torch")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    program = load(
        f'layout serve on m {{ default: {rule} quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32 }}',
        f'mesh m {mesh}\ntensor "w" [{shape[0]}, {shape[1]}] bf16\n',
    )
    layout = program.layout("serve")
    scale = layout.scale_tensors()["w_scale_inv"]
    dims = [int(p) for p in placements.split("S")[1:]]
    torch_placements = [Shard(d) for d in dims] or [Replicate()]
    mesh_shape = program.layout("serve").mesh.shape
    for rank in layout.mesh.ranks:
        coords = [rank // mesh_shape[1], rank % mesh_shape[1]] if len(mesh_shape) == 2 else [rank]
        local, offset = _compute_local_shape_and_global_offset(scale.shape, mesh_shape, coords, torch_placements)
        (box,) = layout.scale_boxes("w", rank)
        assert (box.offsets, box.sizes) == (tuple(offset), tuple(local)), (rank, box)


def test_replicated_scales_of_a_sharded_weight_are_refused_by_the_plan_with_a_hint_that_works():
    """The docs' per-channel ``replicate`` beside a row-parallel shard is a storage layout
    that check reads; a plan refuses it (no rank holds a row whole), and the hint no longer
    sends the user to a layout that check refuses in turn."""
    from layoutlang.plan import compile_plan

    snippet = (Path(__file__).resolve().parent.parent / "docs" / "snippets" / "quantize.layout").read_text()
    text = snippet + (
        "mesh train [dp = 2] on ranks 2..3\nlayout fsdp on train { default: dp = shard(0) }\nreshard fsdp -> serve\n"
    )
    program = layoutlang.loads(text)
    with pytest.raises(LayoutValueError) as caught:
        compile_plan(program)
    err = caught.value
    assert err.tensor == "model.layers.0.self_attn.o_proj.weight"
    assert "its scales are replicated in 'serve' but rank 0 holds 131,072 of its 262,144 elements" in err.message
    assert "not planned yet" in err.hint and "128 x 128" in err.hint
    # the hint's way works: blocks inside each rank's shard, scales placed like the weight
    fixed = text.replace("per_channel scale_inv fp32 replicate", "blocks 128 x 128 scale_inv fp32")
    assert compile_plan(layoutlang.loads(fixed)).quantization is not None
