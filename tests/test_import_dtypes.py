"""Dtypes declared by pattern in the body of ``tensors from``.

The oracle is the rule the language reference states, applied here by hand to the names the
import declares: a tensor a body pattern matches takes that pattern's dtype (the most specific
pattern when several match), every other tensor keeps the dtype it has without the body.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from layoutlang.errors import LayoutError
from layoutlang.lang import load

pytestmark = pytest.mark.timeout(60)

#: a tiny DeepSeek-V3 (2 layers, the second with 4 routed experts)
CONFIG = {
    "model_type": "deepseek_v3",
    "hidden_size": 16,
    "intermediate_size": 24,
    "moe_intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 8,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 2,
    "v_head_dim": 4,
    "vocab_size": 64,
    "torch_dtype": "bfloat16",
}


def program(tmp_path: Path, text: str) -> dict[str, str]:
    """Name -> dtype of the tensors of ``text`` (beside the config, no checkpoint)."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    (tmp_path / "import.layout").write_text(text, encoding="utf-8")
    return {name: t.dtype for name, t in load(tmp_path / "import.layout").tensors.items()}


def error(tmp_path: Path, text: str) -> LayoutError:
    with pytest.raises(LayoutError) as caught:
        program(tmp_path, text)
    return caught.value


def test_a_pattern_gives_its_dtype_to_the_tensors_it_matches_only(tmp_path):
    plain = program(tmp_path, 'tensors from hf "config.json"\n')
    declared = program(tmp_path, 'tensors from hf "config.json" {\n  "model.layers.{l}.mlp.experts.*": fp16\n}\n')
    experts = re.compile(r"model\.layers\.[0-9]+\.mlp\.experts\..*")
    assert len([n for n in plain if experts.fullmatch(n)]) == 12
    assert declared == {n: "fp16" if experts.fullmatch(n) else dtype for n, dtype in plain.items()}
    # the correction bias keeps the fp32 it has from the config alone
    assert declared["model.layers.1.mlp.gate.e_score_correction_bias"] == "fp32"


def test_the_body_wins_over_the_dtype_clause_and_the_most_specific_pattern_wins(tmp_path):
    text = (
        'tensors from hf "config.json" dtype fp16 {\n'
        '  "model.layers.{l}.mlp.*": fp32\n'
        '  "model.layers.{l}.mlp.experts.{e}.down_proj.weight": bf16\n'
        "}\n"
    )
    declared = program(tmp_path, text)
    for name, dtype in declared.items():
        if re.fullmatch(r"model\.layers\.[0-9]+\.mlp\.experts\.[0-9]+\.down_proj\.weight", name):
            assert dtype == "bf16", name
        elif re.fullmatch(r"model\.layers\.[0-9]+\.mlp\..*", name):
            assert dtype == "fp32", name
        else:
            assert dtype == "fp16", name


def test_dtype_spellings_of_the_language_are_accepted(tmp_path):
    declared = program(tmp_path, 'tensors from hf "config.json" {\n  "lm_head.weight": float32\n}\n')
    assert declared["lm_head.weight"] == "fp32"


def test_a_safetensors_import_takes_the_body_too(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(2, 2), "b.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "import.layout").write_text('tensors from safetensors "model.safetensors" { "a.*": bf16 }\n')
    tensors = load(tmp_path / "import.layout").tensors
    assert {n: t.dtype for n, t in tensors.items()} == {"a.weight": "bf16", "b.weight": "fp32"}


@pytest.mark.parametrize(
    ("body", "line", "column", "fragments"),
    [
        pytest.param(
            '"model.layers.{l}.mlp.router.weight": fp32',
            2,
            3,
            [
                "dtype pattern \"model.layers.{l}.mlp.router.weight\" matches no tensor that 'tensors from hf'",
                'did you mean "model.layers.{l}.mlp.gate.weight"?',
            ],
            id="matches-nothing",
        ),
        pytest.param(
            '"lm_head.weight": fp23',
            2,
            21,
            ["unknown dtype 'fp23'", "did you mean 'fp32'?"],
            id="unknown-dtype",
        ),
        pytest.param(
            '"lm_head.weight": fp32\n  "lm_head.weight": bf16',
            3,
            3,
            ['pattern "lm_head.weight" is given a dtype twice (first at line 2)'],
            id="twice",
        ),
        pytest.param(
            '"model.layers.1.m*": fp32\n  "*.mlp.gate.weight": bf16',
            3,
            3,
            [
                "tensor 'model.layers.1.mlp.gate.weight' is matched by two dtype patterns of equal specificity",
                "more literal characters wins",
            ],
            id="equal-specificity",
        ),
        pytest.param('"model.layers.{l.mlp": fp32', 2, 3, ["unbalanced brace"], id="bad-pattern"),
    ],
)
def test_body_mistakes_are_errors_at_the_entry(tmp_path, body, line, column, fragments):
    caught = error(tmp_path, f'tensors from hf "config.json" {{\n  {body}\n}}\n')
    text = str(caught)
    for fragment in fragments:
        assert fragment in text
    assert caught.span is not None and (caught.span.line, caught.span.column) == (line, column)


def test_constants_only_import_refuses_a_body(tmp_path):
    caught = error(tmp_path, 'tensors from hf_constants "config.json" as cfg { "lm_head.weight": fp32 }\n')
    assert "'dtype' has nothing to apply to" in str(caught)
