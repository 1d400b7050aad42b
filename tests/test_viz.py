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
