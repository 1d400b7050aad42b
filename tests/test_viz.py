"""layoutlang.cli.viz: a valid PNG for every example, read back by matplotlib."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

import layoutlang
from layoutlang.cli import viz
from layoutlang.errors import LayoutNameError, LayoutValueError
from layoutlang.plan import compile_plan

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.layout"))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def read_png(path: Path):
    import matplotlib.image

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    return image


def tensor_to_draw(program) -> str:
    """A tensor with moves when the program has a plan, else the first tensor."""
    if program.reshards:
        plan = compile_plan(program)
        moved = {m.tensor for m in plan.moves()}
        return next((t for t in program.tensors if t in moved), next(iter(program.tensors)))
    return next(iter(program.tensors))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_draws_a_png(path, tmp_path):
    program = layoutlang.load(path)
    out = tmp_path / "out.png"
    assert viz.draw(program, tensor_to_draw(program), str(out)) == str(out)
    image = read_png(out)
    assert image[..., :3].std() > 0.05  # not a blank page


def test_ownership_groups_replicas():
    program = layoutlang.load(ROOT / "examples" / "tp_to_dp.layout")
    assert viz.ownership(program.layout("tp"), "w") == [((0, 0), (512, 1024), (0,)), ((512, 0), (512, 1024), (1,))]
    assert viz.ownership(program.layout("dp"), "w") == [((0, 0), (1024, 1024), (8, 9, 10, 11))]


def test_ranks_label():
    assert viz._ranks_label([0]) == "r0"
    assert viz._ranks_label([8, 9, 10, 11, 3]) == "r3,8-11"
    assert viz._ranks_label(list(range(0, 64, 2))) == "r0..62 (32)"


def test_command(tmp_path):
    parser = argparse.ArgumentParser()
    viz.add_arguments(parser)
    out = tmp_path / "w.png"
    args = parser.parse_args(
        [str(ROOT / "examples" / "tp_to_dp.layout"), "--tensor", "w", "--out", str(out), "--policy", "broadcast"]
    )
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert viz.run(args) == 0
    assert text.getvalue() == f"wrote {out}\n"
    read_png(out)


def test_no_moves_and_unwritable_file(tmp_path):
    program = layoutlang.loads(
        """
        mesh m [tp = 2]
        tensor "w" [4, 4] bf16
        layout a on m { "w": tp = shard(0) }
        layout b on m { "w": tp = shard(0) }
        reshard a -> b
        """
    )
    out = tmp_path / "same.png"
    viz.draw(program, "w", str(out))  # local copies only
    read_png(out)
    with pytest.raises(LayoutValueError, match="cannot write"):
        viz.draw(program, "w", str(tmp_path / "missing" / "x.png"))


def test_unknown_tensor(tmp_path):
    program = layoutlang.load(ROOT / "examples" / "tp_to_dp.layout")
    with pytest.raises(LayoutNameError, match="unknown tensor 'v'"):
        viz.draw(program, "v", str(tmp_path / "x.png"))


# ----------------------------------------------------- storages: stacked and transposed

SNIPPETS = ROOT / "docs" / "snippets"


def _places(places) -> dict[str, tuple[tuple[tuple[int, int], ...], bool]]:
    """part -> (its place in the parts' shape as (start, stop) per dim, transposed)."""
    return {
        part: (tuple((s.start, s.stop) for s in box.storage_slices()), box.transposed)
        for part, box in places.places
    }


def test_storage_places_follow_the_engines_loading_rules():
    """The places viz draws, against the engines' own rules re-derived here: vLLM's
    FusedMoE._load_w13 puts tp rank r's rows of w1 (gate) at w13_weight[e, 0:I/tp] and of
    w3 (up) at [e, I/tp:2I/tp] (all experts local without EP, so e is the local id);
    Megatron's legacy GroupedMLP uses weight1.view(local experts, H, -1)[j] as
    [gate^T | up^T] for local expert j = e - ep_rank * local experts."""
    program = layoutlang.load(SNIPPETS / "storage_refit.layout")
    experts, hidden, inter, tp = 4, 6, 4, 2  # the snippet's sizes: gate/up [4, 6], 4 experts
    local = experts // 2  # ep = 2 on the training side
    for e in range(experts):
        tensor = f"experts.{e}.gate_proj.weight"
        # vLLM, destination ranks 2..3 (tp rank r = rank - 2)
        for r in range(tp):
            rows = inter // tp
            places = viz.storage_places(program.layout("vllm"), tensor, 2 + r)
            assert places is not None
            assert (places.storage, places.parts_shape, places.index) == (
                "experts.w13_weight", (experts, 2 * rows, hidden), (e,)
            )
            assert _places(places) == {
                tensor: (((e, e + 1), (0, rows), (0, hidden)), False),
                f"experts.{e}.up_proj.weight": (((e, e + 1), (rows, 2 * rows), (0, hidden)), False),
            }
        # Megatron, source ranks 0..1: expert e on ep rank e // local
        owner, j = divmod(e, local)
        assert viz.storage_places(program.layout("megatron"), tensor, 1 - owner) is None
        places = viz.storage_places(program.layout("megatron"), tensor, owner)
        assert places is not None
        assert (places.storage, places.parts_shape, places.engine_shape, places.index) == (
            "mlp.experts.weight1", (local, hidden, 2 * inter), (hidden, local * 2 * inter), (j,)
        )
        assert _places(places) == {
            tensor: (((j, j + 1), (0, hidden), (0, inter)), True),
            f"experts.{e}.up_proj.weight": (((j, j + 1), (0, hidden), (inter, 2 * inter)), True),
        }


def test_storage_places_of_a_stacked_bias():
    """A stack of 1-D biases is a 2-D storage, drawn whole: vLLM's w13_bias [local experts,
    2 * I / tp] with round-robin experts (expert e on ep rank e % 2, local id e // 2)."""
    program = layoutlang.load(SNIPPETS / "storage_stack.layout")
    layout = program.layout("vllm")  # mesh [ep = 2, tp = 2], rank = 2 * ep_rank + tp_rank
    half = 8 // 2
    for rank in range(4):
        ep_rank, tp_rank = divmod(rank, 2)
        mine = [e for e in range(4) if e % 2 == ep_rank]
        places = viz.storage_places(layout, f"experts.{mine[0]}.up_proj.bias", rank)
        assert places is not None
        assert (places.storage, places.parts_shape, places.index) == ("experts.w13_bias", (2, 2 * half), ())
        expected = {}
        for e in mine:
            j = e // 2
            expected[f"experts.{e}.gate_proj.bias"] = (((j, j + 1), (0, half)), False)
            expected[f"experts.{e}.up_proj.bias"] = (((j, j + 1), (half, 2 * half)), False)
        assert _places(places) == expected
        boxes = dict(places.places)
        assert boxes[f"experts.{mine[0]}.up_proj.bias"].offsets == (tp_rank * half,)


def test_draw_storage_panels(tmp_path):
    program = layoutlang.load(SNIPPETS / "storage_refit.layout")
    tensor = "experts.3.gate_proj.weight"
    plain = read_png(Path(viz.draw(program, tensor, str(tmp_path / "plain.png"))))
    # rank 1 holds expert 3 on the source side (transposed, stacked), rank 3 on the destination
    both = read_png(Path(viz.draw(program, tensor, str(tmp_path / "both.png"), ranks=[1, 3])))
    assert both.shape[0] > plain.shape[0]  # one more row of panels
    with pytest.raises(LayoutValueError, match=r"rank 0 holds no element of tensor 'experts\.3\.gate_proj\.weight'"):
        viz.draw(program, tensor, str(tmp_path / "x.png"), ranks=[0])
    parser = argparse.ArgumentParser()
    viz.add_arguments(parser)
    out = tmp_path / "cli.png"
    args = parser.parse_args(
        [str(SNIPPETS / "storage_refit.layout"), "--tensor", tensor, "--out", str(out), "--rank", "1", "--rank", "3"]
    )
    assert args.rank == [1, 3]
    with contextlib.redirect_stdout(io.StringIO()):
        assert viz.run(args) == 0
    assert read_png(out).shape == both.shape


# ------------------------------------------------------------------ the guide's pictures

#: the pictures the guide "Choosing an inference layout" shows: (image, file, tensor, policy)
_EXPERT = "model.layers.3.mlp.experts.0.down_proj.weight"
_K_PROJ = "model.layers.0.self_attn.k_proj.weight"
GUIDE_PICTURES = [
    ("sim-tp-to-dp.png", "examples/tp_to_dp.layout", "w", None),
    ("sim-llama3-70b-gate.png", "docs/snippets/sim-llama3-70b.layout", "model.layers.0.mlp.gate_proj.weight", None),
    ("sim-deepseek-v3-expert.png", "docs/snippets/sim/deepseek-v3.layout", _EXPERT, None),
    ("sim-deepseek-v3-ep-expert.png", "docs/snippets/sim/deepseek-v3-ep.layout", _EXPERT, None),
    ("sim-qwen3-235b-k-proj.png", "docs/snippets/sim/qwen3-235b.layout", _K_PROJ, None),
    ("sim-qwen3-235b-k-proj-reshard.png", "docs/snippets/sim/qwen3-235b.layout", _K_PROJ, "reshard"),
]


def update_pictures() -> None:
    """Re-draw the guide's pictures into docs/images (minutes of CPU: full plans)."""
    import os

    images = ROOT / "docs" / "images"
    images.mkdir(exist_ok=True)
    last: tuple = (None, None, None)  # (file, policy, plan): one plan in memory at a time
    for image, file, tensor, policy in GUIDE_PICTURES:
        path = ROOT / file
        previous = os.getcwd()
        os.chdir(path.parent)
        try:
            program = layoutlang.load(path.name)
            if last[:2] != (file, policy):
                last = (file, policy, None)
                last = (file, policy, compile_plan(program, policy=policy))
            viz.draw(program, tensor, str(images / image), plan=last[2])
        finally:
            os.chdir(previous)
        print(f"drew docs/images/{image}", flush=True)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--update"]:
        update_pictures()
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_a_long_tensor_name_is_wrapped_inside_the_figure(tmp_path, monkeypatch):
    """An MoE expert's name and shape make a title wider than the figure: every line of it
    stays within the figure's edges (it used to be cut on both sides)."""
    from matplotlib.figure import Figure

    name = "model.layers.{l}.mlp.experts.gate_up_proj_weight_of_a_very_long_descriptive_name_{e}"
    program = layoutlang.loads(
        f"""
        mesh m [ep = 2]
        tensor "{name}" [64, 32, 16] bf16 for l in 0..0, e in 0..1
        layout experts on m {{ default: ep = shard(0) }}
        """
    )
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    tensor = name.replace("{l}", "0").replace("{e}", "1")
    viz.draw(program, tensor, str(tmp_path / "e.png"))
    (fig,) = drawn
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle
    assert title is not None and "\n" in title.get_text()  # wrapped
    extent = title.get_window_extent(renderer)
    assert extent.x0 >= 0 and extent.x1 <= fig.bbox.x1, (extent, fig.bbox)
