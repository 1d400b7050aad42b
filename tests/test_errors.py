"""Every kind of user mistake: its error class, its message, its exact place, its hint.

Each test loads a small program (``layoutlang.loads(text, path="t.layout")``, or files in
``tmp_path`` for includes and encodings) and checks the exception class, a key part of the
message (naming the offending mesh, axis, tensor, rule or storage), the 1-based line and
column of ``err.span``, and the did-you-mean hint where one is obvious. Errors found while
resolving layouts (rule matching, sub-mesh indices, storage shapes on every rank) surface
from ``program.check()``; the others already from ``loads``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lark
import pytest

import layoutlang
from layoutlang import (
    LayoutError,
    LayoutIncludeError,
    LayoutNameError,
    LayoutSyntaxError,
    LayoutValueError,
)
from layoutlang.lang import parser

pytestmark = pytest.mark.timeout(120)


def error_of(text: str, *, resolve: bool = False) -> LayoutError:
    """The error ``text`` raises: from loading, or (``resolve``) only from ``check()``."""
    if resolve:
        program = layoutlang.loads(text, path="t.layout")  # loading alone must succeed
        with pytest.raises(LayoutError) as info:
            program.check()
    else:
        with pytest.raises(LayoutError) as info:
            layoutlang.loads(text, path="t.layout")
    return info.value


def assert_error(
    err: LayoutError,
    cls: type[LayoutError],
    message: str,
    line: int,
    column: int,
    *,
    end_column: int | None = None,
    hint: str | None = None,
    path: str = "t.layout",
) -> None:
    assert type(err) is cls, f"{type(err).__name__}: {err}"
    assert message in err.message
    assert err.span is not None, f"no place for: {err}"
    assert (err.span.path, err.span.line, err.span.column) == (path, line, column), str(err)
    if end_column is not None:
        assert err.span.end_column == end_column, str(err)
    if hint is not None:
        assert err.hint is not None and hint in err.hint, f"hint {err.hint!r}"


TINY = 'mesh m [tp = 2]\ntensor "w" [4, 6] fp32\n'

# ============================================================================ syntax


def test_missing_colon_after_pattern_points_at_the_next_token():
    err = error_of(TINY + 'layout l on m {\n  "w" tp = shard(0)\n}\n')
    assert_error(
        err,
        LayoutSyntaxError,
        "unexpected 'tp'; expected ':'",
        4,
        7,
        end_column=9,
        hint="a rule is written",
    )


def test_unquoted_pattern_suggests_quoting_it():
    err = error_of(TINY + "layout l on m {\n  w: tp = shard(0)\n}\n")
    assert_error(err, LayoutSyntaxError, "unexpected 'w'", 4, 3, hint='quoted: "w"')
    assert "a quoted name" in err.message


def test_single_slash_division_suggests_double_slash():
    err = error_of("let heads = 8\nlet groups = heads / 2\n")
    assert_error(err, LayoutSyntaxError, "unexpected character '/'", 2, 20, hint="'//'")


def test_unclosed_layout_brace_points_at_the_end_of_the_file():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0)\n')
    assert_error(
        err, LayoutSyntaxError, "unexpected end of the file", 4, 21, hint="'{' block is not closed"
    )
    assert "'}'" in err.message


def test_stray_character_is_named_and_placed():
    err = error_of("mesh m [tp = 2] $\n")
    assert_error(err, LayoutSyntaxError, "unexpected character '$'", 1, 17, end_column=18)


def test_statement_truncated_at_end_of_file():
    err = error_of('mesh m [tp = 2]\ntensor "w" [4]')
    assert_error(err, LayoutSyntaxError, "unexpected end of the file", 2, 15)
    assert "a name" in err.message  # the dtype that should follow


def test_expression_truncated_at_end_of_file_lists_what_may_follow():
    err = error_of("let a = 1\nlet b =")
    assert_error(err, LayoutSyntaxError, "unexpected end of the file", 2, 8)
    assert "an integer" in err.message and "a name" in err.message


def test_unclosed_quote_says_the_name_is_not_closed():
    err = error_of('mesh m [tp = 2]\ntensor "w [4] fp32\n')
    assert_error(err, LayoutSyntaxError, "quoted name is not closed", 2, 8)


def test_single_quotes_suggest_double_quotes():
    err = error_of("tensor 'w' [4] fp32\n")
    assert_error(err, LayoutSyntaxError, "unexpected character", 1, 8, hint="double quotes")


def test_capitalized_placement_suggests_lower_case():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = Shard(0)\n}\n')
    assert_error(
        err, LayoutSyntaxError, "unexpected 'Shard'", 4, 13, end_column=18, hint="lower case"
    )


def test_colon_instead_of_equals_in_placement():
    err = error_of(TINY + 'layout l on m {\n  "w": tp : shard(0)\n}\n')
    assert_error(err, LayoutSyntaxError, "unexpected ':'", 4, 11, hint="placed with '='")


def test_expression_nested_too_deeply_is_a_syntax_error_not_a_crash():
    err = error_of("let a = 1\nlet b = " + "+".join(["1"] * 3000) + "\n")
    assert_error(err, LayoutSyntaxError, "nests too deeply", 2, 1, hint="'let'")


def test_integer_with_thousands_of_digits_is_rejected_with_its_place():
    err = error_of("let a = " + "9" * 5000 + "\n")
    assert_error(err, LayoutSyntaxError, "5000 digits is too long", 1, 9)


def test_bad_expression_inside_storage_name_points_into_the_string():
    err = error_of(
        'mesh m [tp = 2]\ntensor "a{l}" [4] fp32 for l in 0..1\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "s{l / 2}" = "a{l}"\n}\n'
    )
    assert_error(
        err, LayoutSyntaxError, "cannot read the expression 'l / 2'", 5, 16, hint="//"
    )  # at the '/'


@pytest.mark.parametrize(
    ("hint", "example"),
    [(hint, example) for hint, examples in parser._MISTAKES for example in examples],
)
def test_every_example_of_a_common_mistake_gets_its_hint(hint, example):
    # the table of mistakes is matched by parser state: each example must fail, and get its own hint
    with pytest.raises(lark.exceptions.UnexpectedToken) as info:
        parser._parse_program(example)
    expected = hint(info.value.token)
    assert expected is not None
    err = error_of(example)
    assert type(err) is LayoutSyntaxError
    assert err.hint == expected
    # and the same mistake later in a file, one statement deeper in the parser's stack
    assert error_of(TINY + example).hint == expected


def test_malformed_capture_in_pattern_points_at_the_braces():
    err = error_of(TINY + 'layout l on m {\n  "w{1}": tp = shard(0)\n}\n')
    assert_error(err, LayoutSyntaxError, "a capture is a plain name", 4, 5, end_column=8)


# ============================================================================= names


def test_unknown_mesh_in_layout_with_did_you_mean():
    err = error_of(
        'mesh train [tp = 2]\ntensor "w" [4] fp32\nlayout l on trian { "w": tp = shard(0) }\n'
    )
    assert_error(
        err,
        LayoutNameError,
        "unknown mesh 'trian' in layout 'l' (meshes: train)",
        3,
        13,
        end_column=18,
    )
    assert err.hint == "did you mean 'train'?"


def test_unknown_axis_points_at_the_axis_name_only():
    err = error_of(
        'mesh train [pp = 2, tp = 2]\ntensor "w" [4] fp32\nlayout l on train {\n  "w": tpp = shard(0)\n}\n'
    )
    assert_error(
        err,
        LayoutNameError,
        "unknown axis 'tpp' in mesh 'train' (axes: pp, tp)",
        4,
        8,
        end_column=11,
        hint="did you mean 'tp'?",
    )


def test_unknown_axis_in_sub_mesh_selection():
    err = error_of(
        'mesh train [pp = 2, tp = 2]\ntensor "w" [4] fp32\nlayout l on train {\n  "w": ppp[0], tp = shard(0)\n}\n'
    )
    assert_error(
        err, LayoutNameError, "unknown axis 'ppp'", 4, 8, end_column=11, hint="did you mean 'pp'?"
    )


def test_unknown_axis_in_explicit_order_points_at_that_axis():
    err = error_of(
        'mesh m [dp = 2, tp = 2]\ntensor "w" [8] fp32\nlayout l on m {\n  "w": (tp, dpp) = shard(0)\n}\n'
    )
    assert_error(
        err, LayoutNameError, "unknown axis 'dpp' in mesh 'm'", 4, 13, end_column=16, hint="'dp'"
    )


def test_unknown_layout_in_reshard_with_did_you_mean():
    err = error_of(
        "mesh a [tp = 2]\nmesh b [tp = 2] on ranks 2..3\n"
        "layout train on a { default: replicate }\nlayout infer on b { default: replicate }\n"
        "reshard refit: train -> infre\n"
    )
    assert_error(
        err, LayoutNameError, "unknown layout 'infre' (layouts: train, infer)", 5, 25, end_column=30
    )
    assert err.hint == "did you mean 'infer'?"


def test_unknown_source_layout_in_reshard():
    err = error_of(
        "mesh a [tp = 2]\nlayout train on a { default: replicate }\nreshard trian -> train\n"
    )
    assert_error(err, LayoutNameError, "unknown layout 'trian'", 3, 9, hint="'train'")


def test_unknown_tensor_in_storage_parts_with_did_you_mean():
    err = error_of(
        'mesh m [tp = 2]\ntensor "mlp.gate" [8, 4] fp32\ntensor "mlp.up" [8, 4] fp32\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "mlp.gate_up" = "mlp.gate" | "mlp.upp"\n}\n',
        resolve=True,
    )
    assert_error(
        err,
        LayoutNameError,
        "storage 'mlp.gate_up' of layout 'l' names tensor 'mlp.upp', which is not declared",
        6,
        3,
        hint="did you mean 'mlp.up'?",
    )


def test_storage_whose_first_part_matches_no_tensor():
    err = error_of(
        TINY + 'layout l on m {\n  default: replicate\n  storage "s" = "x{l}"\n}\n', resolve=True
    )
    assert_error(err, LayoutNameError, "no tensor matches its first part 'x{l}'", 5, 3)


def test_unknown_constant_in_expression_with_did_you_mean():
    err = error_of("let heads = 8\nlet q = head * 64\n")
    assert_error(err, LayoutNameError, "unknown name 'head'", 2, 9, end_column=13, hint="'heads'")


def test_unknown_capture_in_sub_mesh_expression():
    err = error_of(
        'mesh m [pp = 2]\ntensor "l.{l}" [4] fp32 for l in 0..3\nlayout x on m {\n  "l.{l}": pp[k // 2]\n}\n'
    )
    assert_error(err, LayoutNameError, "unknown name 'k' (captures of the pattern: l)", 4, 15)


def test_placeholder_in_tensor_name_not_bound_by_for_clause():
    err = error_of('tensor "layers.{l}.w" [4] fp32\n')
    assert_error(
        err,
        LayoutNameError,
        "'{l}' in tensor name 'layers.{l}.w' is not bound",
        1,
        8,
        hint="for l in 0..N",
    )


@pytest.mark.parametrize(
    ("text", "kind", "name", "line"),
    [
        ("mesh m [tp = 2]\nmesh m [tp = 4]\n", "mesh", "m", 2),
        ('tensor "w" [4] fp32\nlet a = 1\ntensor "w" [8] bf16\n', "tensor", "w", 3),
        (
            "mesh m [tp = 2]\nlayout l on m { default: replicate }\nlayout l on m { default: replicate }\n",
            "layout",
            "l",
            3,
        ),
        ("let a = 1\nlet a = 2\n", "constant", "a", 2),
    ],
    ids=["mesh", "tensor", "layout", "constant"],
)
def test_duplicate_declaration_points_at_the_second_and_names_the_first(text, kind, name, line):
    err = error_of(text)
    assert_error(
        err, LayoutNameError, f"{kind} '{name}' is declared twice (first at t.layout:", line, 1
    )


def test_tensor_generated_twice_by_overlapping_for_clauses():
    err = error_of('tensor "l{i}" [4] fp32 for i in 0..3\ntensor "l{i}" [4] fp32 for i in 3..5\n')
    assert_error(
        err, LayoutNameError, "tensor 'l3' is declared twice (first at t.layout:1:1)", 2, 1
    )


def test_unknown_dtype_with_did_you_mean():
    err = error_of('mesh m [tp = 2]\ntensor "w" [4] fp33\n')
    assert_error(
        err,
        LayoutValueError,
        "unknown dtype 'fp33'",
        2,
        16,
        end_column=20,
        hint="did you mean 'fp32'?",
    )


def test_unknown_shard_option_with_did_you_mean():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0, chunk = 2)\n}\n')
    assert_error(
        err,
        LayoutNameError,
        "unknown shard option 'chunk' (options: blocks, chunks, pad)",
        4,
        22,
        end_column=31,
        hint="did you mean 'chunks'?",
    )


def test_unknown_topology_setting_with_did_you_mean():
    err = error_of("topology {\n  domain_size = 4\n  domain_sise = 4\n}\n")
    assert_error(
        err,
        LayoutNameError,
        "unknown topology setting 'domain_sise'",
        3,
        3,
        hint="did you mean 'domain_size'?",
    )


def test_unknown_model_description_kind_with_did_you_mean():
    err = error_of('tensors from hff "config.json"\n')
    assert_error(err, LayoutNameError, "unknown model description 'hff'", 1, 14, hint="'hf'")


# ============================================================================ values


def test_axis_placed_twice_in_one_rule_points_at_the_second():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0), tp = shard(1)\n}\n')
    assert_error(
        err,
        LayoutValueError,
        "axis 'tp' is placed twice in one rule of layout 'l' (first at column 8)",
        4,
        23,
    )


def test_axis_both_selected_and_placed_in_one_rule():
    err = error_of(
        'mesh m [pp = 2]\ntensor "w" [4] fp32\nlayout l on m {\n  "w": pp[0], pp = shard(0)\n}\n'
    )
    assert_error(err, LayoutValueError, "axis 'pp' is placed twice", 4, 15)


def test_shard_dim_out_of_range_surfaces_from_check():
    err = error_of(
        'mesh m [tp = 2]\ntensor "w" [4, 6] fp32\ntensor "b" [6] fp32\n'
        'layout l on m {\n  "*": tp = shard(1)\n}\n',
        resolve=True,
    )
    # "w" has dim 1; "b" has only dim 0: the rule is right for one tensor and wrong for the other.
    assert_error(err, LayoutValueError, "tensor 'b' has 1 dims; axis 'tp' cannot shard dim 1", 5, 3)


def test_negative_shard_dim_out_of_range():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(-3)\n}\n', resolve=True)
    assert_error(
        err, LayoutValueError, "tensor 'w' has 2 dims; axis 'tp' cannot shard dim -3", 4, 3
    )


def test_mesh_axis_sizes_do_not_match_its_ranks():
    err = error_of("mesh train [dp = 2, tp = 2] on ranks 0..2\n")
    assert_error(
        err, LayoutValueError, "mesh 'train' (dp=2 x tp=2) has 4 positions but 3 ranks", 1, 29
    )


def test_mesh_rank_list_too_long():
    err = error_of("mesh m [tp = 2]\n  on ranks [0, 1, 2]\n")
    assert_error(err, LayoutValueError, "mesh 'm' (tp=2) has 2 positions but 3 ranks", 2, 3)


def test_mesh_lists_a_rank_twice():
    err = error_of("mesh m [dp = 2, tp = 2] on ranks [0, 1, 3, 3]\n")
    assert_error(err, LayoutValueError, "mesh 'm' lists rank 3 twice", 1, 25)


def test_mesh_lists_a_negative_rank():
    err = error_of("mesh m [tp = 2] on ranks [-1, 0]\n")
    assert_error(err, LayoutValueError, "mesh 'm' lists negative rank -1", 1, 17)


def test_mesh_axis_of_size_zero():
    err = error_of("mesh m [dp = 2, tp = 0]\n")
    assert_error(
        err, LayoutValueError, "axis 'tp' of mesh 'm' has size 0; sizes are at least 1", 1, 17
    )


def test_mesh_declares_an_axis_twice():
    err = error_of("mesh m [tp = 2, tp = 2]\n")
    assert_error(err, LayoutNameError, "mesh 'm' declares axis 'tp' twice", 1, 17)


def test_empty_rank_range():
    err = error_of("mesh m [tp = 2] on ranks 3..2\n")
    assert_error(err, LayoutValueError, "empty rank range 3..2", 1, 26)


def test_tensor_matched_by_no_rule_and_no_default():
    err = error_of(
        'mesh m [tp = 2]\ntensor "w" [4] fp32\ntensor "bias" [4] fp32\nlayout l on m {\n  "w": tp = shard(0)\n}\n',
        resolve=True,
    )
    assert_error(
        err,
        LayoutValueError,
        "tensor 'bias' is matched by no rule of layout 'l' and the layout has no default",
        4,
        1,
        hint="default: replicate",
    )


def test_two_rules_of_equal_specificity_matching_one_tensor_are_ambiguous():
    err = error_of(
        'mesh m [tp = 2]\ntensor "layers.weight" [4] fp32\n'
        'layout l on m {\n  "layers.*": tp = shard(0)\n  "*.weight": replicate\n}\n',
        resolve=True,
    )
    assert_error(
        err,
        LayoutValueError,
        "tensor 'layers.weight' is matched by two rules of equal specificity",
        5,
        3,
    )
    assert '"layers.*" (line 4)' in err.message and '"*.weight"' in err.message
    assert "more specific" in err.hint


def test_same_pattern_twice_in_one_layout():
    err = error_of(TINY + 'layout l on m {\n  "w": replicate\n  "w": tp = shard(0)\n}\n')
    assert_error(
        err,
        LayoutNameError,
        "pattern \"w\" appears twice in layout 'l' (first at t.layout:4:3)",
        5,
        3,
    )


def test_storage_parts_do_not_add_up_to_its_declared_shape():
    err = error_of(
        'mesh m [tp = 2]\ntensor "q" [8, 16] bf16\ntensor "k" [4, 16] bf16\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "qk" [8, 16] = "q" | "k"\n}\n',
        resolve=True,
    )
    # on every rank: 4 rows of q and 2 rows of k = [6, 16], not the declared [8, 16]
    assert_error(
        err,
        LayoutValueError,
        "storage 'qk' of layout 'l' on rank 0: parts add up to [6, 16], the storage is declared [8, 16]",
        6,
        3,
    )


def test_storage_declared_with_negative_size():
    err = error_of(
        'mesh m [tp = 2]\ntensor "a" [4] fp32\nlayout l on m {\n  default: replicate\n  storage "s" [-1] = "a"\n}\n'
    )
    assert_error(
        err, LayoutValueError, "storage 's' is declared with an impossible shape [-1]", 5, 3
    )


def test_interleaved_blocks_that_do_not_divide_the_local_parts():
    err = error_of(
        'mesh m [tp = 2]\ntensor "q" [12, 8] bf16\ntensor "k" [6, 8] bf16\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "qk" = "q" | "k" blocks(4, 2)\n}\n',
        resolve=True,
    )
    # rank 0 holds 6 rows of q: not a multiple of q's block of 4
    assert_error(
        err,
        LayoutValueError,
        "storage 'qk' of layout 'l' on rank 0: "
        "part 0 has 6 local elements along dim 0, not a multiple of its block size 4",
        6,
        3,
    )


def test_interleaved_parts_with_different_numbers_of_blocks():
    err = error_of(
        'mesh m [tp = 2]\ntensor "q" [8, 8] bf16\ntensor "k" [8, 8] bf16\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "qk" = "q" | "k" blocks(2, 4)\n}\n',
        resolve=True,
    )
    assert_error(err, LayoutValueError, "part 1 has 1 blocks, the earlier parts have 2", 6, 3)


def test_interleaved_blocks_count_differs_from_parts():
    err = error_of(
        'mesh m [tp = 2]\ntensor "q" [8] bf16\ntensor "k" [8] bf16\n'
        'layout l on m {\n  default: tp = shard(0)\n  storage "qk" = "q" | "k" blocks(2)\n}\n'
    )
    assert_error(err, LayoutValueError, "storage 'qk' has 2 parts but 1 block sizes", 6, 3)


def test_tensor_in_two_storages():
    err = error_of(
        TINY
        + 'layout l on m {\n  default: replicate\n  storage "s" = "w"\n  storage "t" = "w"\n}\n',
        resolve=True,
    )
    assert_error(err, LayoutValueError, "tensor 'w' is a part of two storages: 's' and 't'", 6, 3)


def test_sub_mesh_index_out_of_range_names_the_tensor_and_capture():
    err = error_of(
        'mesh m [pp = 2, tp = 2]\ntensor "layers.{l}.w" [4] fp32 for l in 0..9\n'
        'layout x on m {\n  "layers.{l}.w": pp[l // 2]\n}\n',
        resolve=True,
    )
    # l = 0..3 land on stages 0 and 1; l = 4 is the first to ask for stage 2 of 2
    assert_error(
        err,
        LayoutValueError,
        "sub-mesh index 2 is out of range for axis 'pp' of size 2 (tensor 'layers.4.w', l=4)",
        4,
        3,
    )


def test_negative_sub_mesh_index():
    err = error_of(
        'mesh m [pp = 2]\ntensor "w" [4] fp32\nlayout x on m {\n  "w": pp[-1]\n}\n', resolve=True
    )
    assert_error(
        err, LayoutValueError, "sub-mesh index -1 is out of range for axis 'pp' of size 2", 4, 3
    )


def test_chunks_that_do_not_divide_the_axis():
    err = error_of(
        'mesh m [tp = 4]\ntensor "k" [8] fp32\nlayout l on m {\n  "k": tp = shard(0, chunks = 3)\n}\n',
        resolve=True,
    )
    assert_error(
        err, LayoutValueError, "tensor 'k': 3 chunks do not divide axis 'tp' of size 4", 4, 3
    )


def test_shard_option_below_one():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0, pad = 0)\n}\n')
    assert_error(err, LayoutValueError, "shard option 'pad' must be at least 1, not 0", 4, 22)


def test_shard_option_given_twice():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0, pad = 2, pad = 4)\n}\n')
    assert_error(err, LayoutNameError, "shard option 'pad' is given twice", 4, 31)


def test_negative_tensor_size():
    err = error_of('tensor "w" [4, -2] fp32\n')
    assert_error(err, LayoutValueError, "tensor 'w' has negative size -2 in dim 1", 1, 1)


def test_topology_domain_size_must_be_a_whole_number():
    err = error_of("topology { domain_size = 2.5 }\n")
    assert_error(err, LayoutValueError, "'domain_size' is a whole number of ranks", 1, 12)


def test_topology_bandwidth_needs_a_unit():
    err = error_of("topology {\n  network_bandwidth = 50\n}\n")
    assert_error(err, LayoutValueError, "'network_bandwidth' needs a unit", 2, 3)
    assert "GB/s" in err.message


def test_second_topology():
    err = error_of("topology { domain_size = 8 }\ntopology { domain_size = 4 }\n")
    assert_error(err, LayoutNameError, "a second topology (the first is at t.layout:1:1)", 2, 1)


# --------------------------------------------------------------- division by zero


def test_division_by_zero_in_a_constant():
    err = error_of("let stages = 0\nlet per_stage = 4 // stages\n")
    assert_error(err, LayoutValueError, "division by zero in '//'", 2, 17, end_column=28)


def test_modulo_by_zero_in_a_mesh_axis():
    err = error_of("mesh m [tp = 4 % 0]\n")
    assert_error(err, LayoutValueError, "division by zero in '%'", 1, 14, end_column=19)


def test_division_by_zero_in_a_sub_mesh_expression_surfaces_from_check():
    err = error_of(
        'let stages = 0\nmesh m [pp = 2]\ntensor "l.{l}" [4] fp32 for l in 0..3\n'
        'layout x on m {\n  "l.{l}": pp[l // stages]\n}\n',
        resolve=True,
    )
    assert_error(err, LayoutValueError, "division by zero in '//'", 5, 15)


def test_division_by_zero_in_a_storage_name():
    err = error_of(
        'mesh m [tp = 2]\ntensor "a{l}" [4] fp32 for l in 0..1\n'
        'layout x on m {\n  default: tp = shard(0)\n  storage "s{l // 0}" = "a{l}"\n}\n',
        resolve=True,
    )
    assert_error(err, LayoutValueError, "division by zero in '//'", 5, 14)


# ---------------------------------------------------- numbers too large to be right


def test_mesh_with_too_many_positions_points_at_the_largest_axis():
    err = error_of("mesh m [dp = 2,\n        tp = 99999999999]\n")
    assert_error(
        err, LayoutValueError, "mesh 'm' has 199999999998 positions; a mesh has at most", 2, 9
    )


def test_huge_rank_range_is_rejected_before_it_is_built():
    err = error_of("mesh m [tp = 4] on ranks 0..99999999999\n")
    assert_error(err, LayoutValueError, "mesh 'm' (tp=4) has 4 positions but more ranks", 1, 26)


def test_rank_beyond_64_bits():
    # refused at the number itself, as every value past the 64-bit integers is
    err = error_of("mesh m [tp = 2] on ranks [0, 99999999999999999999999]\n")
    assert_error(
        err, LayoutValueError, "the integer 99999999999999999999999 is outside the 64-bit integers", 1, 30
    )


def test_for_clause_generating_too_many_tensors():
    err = error_of('let layers = 99999999999\ntensor "l.{l}" [4] fp32 for l in 0..layers - 1\n')
    assert_error(err, LayoutValueError, "generates 99999999999 tensors", 2, 29)


def test_tensor_of_more_than_2_to_63_bytes():
    err = error_of('tensor "w" [99999999999, 99999999999] bf16\n')
    assert_error(
        err, LayoutValueError, "tensor 'w' of shape [99999999999, 99999999999] is too large", 1, 1
    )


def test_shard_blocks_beyond_32_bits():
    err = error_of(TINY + 'layout l on m {\n  "w": tp = shard(0, blocks = 99999999999)\n}\n')
    assert_error(
        err, LayoutValueError, "shard option 'blocks' is 99999999999; at most 2147483647", 4, 22
    )


def test_infinite_topology_value():
    err = error_of("topology { network_bandwidth = 1e999 GB/s }\n")
    assert_error(err, LayoutValueError, "'network_bandwidth' = inf is not a finite number", 1, 12)


# ====================================================================== files


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def load_error(path: Path) -> LayoutError:
    with pytest.raises(LayoutError) as info:
        layoutlang.load(path).check()
    return info.value


def test_include_cycle_names_the_chain_and_points_at_the_closing_include(tmp_path):
    main = write(tmp_path / "a.layout", 'include "b.layout"\nmesh m [tp = 2]\n')
    write(tmp_path / "b.layout", '# b includes a back\ninclude "a.layout"\n')
    err = load_error(main)
    assert_error(
        err,
        LayoutIncludeError,
        "include cycle: a.layout -> b.layout -> a.layout",
        2,
        1,
        path=str(tmp_path / "b.layout"),
    )


def test_file_including_itself(tmp_path):
    main = write(tmp_path / "self.layout", 'let a = 1\ninclude "self.layout"\n')
    err = load_error(main)
    assert_error(
        err, LayoutIncludeError, "include cycle: self.layout -> self.layout", 2, 1, path=str(main)
    )


def test_missing_include_with_did_you_mean(tmp_path):
    write(tmp_path / "models" / "tiny_llama.layout", "let layers = 4\n")
    main = write(tmp_path / "main.layout", 'let x = 1\ninclude "models/tiny_lama.layout"\n')
    err = load_error(main)
    assert_error(
        err,
        LayoutIncludeError,
        "cannot include 'models/tiny_lama.layout': no such file",
        2,
        1,
        path=str(main),
        hint="did you mean 'tiny_llama.layout'?",
    )


def test_including_a_directory(tmp_path):
    (tmp_path / "models").mkdir()
    main = write(tmp_path / "main.layout", 'include "models"\n')
    err = load_error(main)
    assert_error(
        err, LayoutIncludeError, "cannot include 'models': it is a directory", 1, 1, path=str(main)
    )


def test_error_inside_an_included_file_points_into_that_file(tmp_path):
    write(tmp_path / "models" / "bad.layout", "let layers = 4\nlet per_stage = layers // stagse\n")
    main = write(tmp_path / "main.layout", 'let stages = 2\ninclude "models/bad.layout"\n')
    err = load_error(main)
    assert_error(
        err,
        LayoutNameError,
        "unknown name 'stagse'",
        2,
        27,
        path=str(tmp_path / "models" / "bad.layout"),
        hint="'stages'",
    )
    assert "let per_stage = layers // stagse" in str(err)


def test_empty_file(tmp_path):
    err = load_error(write(tmp_path / "empty.layout", ""))
    assert_error(
        err,
        LayoutSyntaxError,
        "the file holds no statements",
        1,
        1,
        path=str(tmp_path / "empty.layout"),
    )
    assert "mesh" in err.hint


def test_file_of_only_comments_and_blank_lines():
    err = error_of("# a layout to be written\n\n   \n")
    assert_error(err, LayoutSyntaxError, "the file holds no statements", 1, 1)


def test_non_utf8_file_points_at_the_bad_byte_in_characters(tmp_path):
    # "# café " is 7 characters (8 bytes) before the stray byte 0xff
    path = write(tmp_path / "latin.layout", b"mesh m [tp = 2]\n# caf\xc3\xa9 \xff\n")
    err = load_error(path)
    assert_error(
        err, LayoutSyntaxError, "the file is not UTF-8 text (byte 0xff)", 2, 8, path=str(path)
    )


def test_non_utf8_included_file(tmp_path):
    write(tmp_path / "inc.layout", b"let a = 1 # caf\xe9\n")
    main = write(tmp_path / "main.layout", 'include "inc.layout"\n')
    err = load_error(main)
    assert_error(
        err,
        LayoutSyntaxError,
        "not UTF-8 text (byte 0xe9)",
        1,
        16,
        path=str(tmp_path / "inc.layout"),
    )


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    path = write(tmp_path / "bom.layout", b"\xef\xbb\xbfmesh m [tp = 2]\nlet a = 4 / 2\n")
    err = load_error(path)
    # the mark is not an error; the real mistake on line 2 is found at its usual column
    assert_error(err, LayoutSyntaxError, "unexpected character '/'", 2, 11, path=str(path))


def test_missing_top_level_file_is_a_layout_error(tmp_path):
    with pytest.raises(LayoutSyntaxError, match="no such file"):
        layoutlang.load(tmp_path / "nope.layout")


# ================================================================== rendering


def test_str_shows_place_source_line_caret_and_hint():
    err = error_of(
        'mesh train [pp = 2, tp = 2]\ntensor "w" [4] fp32\nlayout l on train {\n  "w": tpp = shard(0)\n}\n'
    )
    assert str(err).splitlines() == [
        "t.layout:4:8: error: unknown axis 'tpp' in mesh 'train' (axes: pp, tp)",
        '    4 |   "w": tpp = shard(0)',
        "      |        ^~~",
        "  hint: did you mean 'tp'?",
    ]


def test_to_json_carries_kind_place_and_hint():
    err = error_of('mesh m [tp = 2]\ntensor "w" [4] fp33\n')
    data = json.loads(json.dumps(err.to_json()))
    assert data == {
        "error": "value",
        "message": err.message,
        "file": "t.layout",
        "line": 2,
        "column": 16,
        "end_line": 2,
        "end_column": 20,
        "hint": "did you mean 'fp32'?",
    }


def test_every_error_is_a_value_error_for_python_callers():
    err = error_of("let a = 1 // 0\n")
    assert isinstance(err, ValueError)


# ============================================================ composing expressions


def test_unknown_function_with_did_you_mean():
    err = error_of("let a = mn(1, 2)\n")
    assert_error(err, LayoutNameError, "unknown function 'mn' (functions: min, max, cdiv)", 1, 9,
                 end_column=11, hint="'min'")


def test_function_with_too_few_arguments():
    err = error_of("let a = 1\nlet b = max(a)\n")
    assert_error(err, LayoutValueError, "'max' takes at least 2 arguments, not 1", 2, 9)


def test_ceiling_division_with_three_arguments():
    err = error_of("let a = cdiv(7, 2, 1)\n")
    assert_error(err, LayoutValueError, "'cdiv' takes 2 arguments, not 3", 1, 9)


def test_ceiling_division_by_zero_in_a_constant():
    err = error_of("let z = 0\nlet a = 1 + cdiv(7, z)\n")
    assert_error(err, LayoutValueError, "division by zero in 'cdiv'", 2, 13)


def test_ceiling_division_by_zero_in_a_sub_mesh_expression_surfaces_from_check():
    text = (
        'mesh m [pp = 2]\nlet z = 0\ntensor "layers.{l}.w" [4] fp32 for l in 0..1\n'
        'layout a on m {\n  "layers.{l}.w": pp[cdiv(l, z)]\n}\n'
    )
    err = error_of(text, resolve=True)
    assert_error(err, LayoutValueError, "division by zero in 'cdiv'", 5, 22)


def test_unknown_function_in_a_sub_mesh_expression_is_found_when_loading():
    text = (
        'mesh m [pp = 2]\ntensor "layers.{l}.w" [4] fp32 for l in 0..1\n'
        'layout a on m { "layers.{l}.w": pp[mix(l, 1)] }\n'
    )
    err = error_of(text)
    assert_error(err, LayoutNameError, "unknown function 'mix'", 3, 36, hint="'min'")


def test_unknown_axis_size_of_a_mesh_lists_the_axes_with_did_you_mean():
    err = error_of("mesh infer [dp = 2, tp = 4]\nlet k = infer.tpp * 2\n")
    assert_error(err, LayoutNameError, "unknown name 'infer.tpp' ('infer.' names: infer.dp, infer.tp)", 2, 9,
                 end_column=18, hint="'infer.tp'")


def test_axis_size_of_a_mesh_declared_later_is_unknown():
    err = error_of("let k = infer.tp\nmesh infer [tp = 4]\n")
    assert_error(err, LayoutNameError, "unknown name 'infer.tp'", 1, 9)


def test_mesh_named_like_the_constants_of_a_model_description(tmp_path):
    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "qwen3_tiny" / "config.json"
    write(tmp_path / "config.json", config.read_text("utf-8"))
    main = write(tmp_path / "main.layout", 'tensors from hf "config.json" as infer\nmesh infer [tp = 2]\n')
    err = load_error(main)
    assert_error(err, LayoutNameError, "mesh 'infer' has the name of the constants of a model description", 2, 1,
                 path=str(main))


def test_model_description_imported_under_the_name_of_a_mesh(tmp_path):
    config = Path(__file__).resolve().parent.parent / "examples" / "configs" / "qwen3_tiny" / "config.json"
    write(tmp_path / "config.json", config.read_text("utf-8"))
    main = write(tmp_path / "main.layout", 'mesh cfg [tp = 2]\ntensors from hf "config.json" as cfg\n')
    err = load_error(main)
    assert_error(err, LayoutNameError, "'cfg' is a mesh (at", 2, 17, path=str(main))
    assert "under another name (as ...)" in err.message


# ====================================================== patterns that match nothing

MISSPELLED = (
    'mesh m [tp = 2]\n'
    'tensor "model.layers.{l}.self_attn.o_proj.weight" [4, 4] fp32 for l in 0..3\n'
    'tensor "model.layers.{l}.mlp.experts.{e}.w1" [4, 4] fp32 for l in 0..3, e in 0..7\n'
    "layout a on m {\n"
    '  "model.layers.{l}.mlp.experts.{e}.w1": tp = shard(0)\n'
    '  "model.layers.{l}.self_attn.o_prj.weight": tp = shard(1)\n'
    "  default: replicate\n"
    "}\n"
)


def test_rule_whose_pattern_matches_no_tensor_with_did_you_mean():
    err = error_of(MISSPELLED)
    assert_error(
        err,
        LayoutNameError,
        "pattern \"model.layers.{l}.self_attn.o_prj.weight\" of layout 'a' matches no tensor of the program",
        6,
        3,
        end_column=44,
        hint='did you mean "model.layers.{l}.self_attn.o_proj.weight"?',
    )


def test_pattern_with_a_literal_digit_that_matches_no_tensor():
    text = TINY + 'tensor "layers.3.w" [4] fp32\nlayout a on m {\n'
    text += '  "layers.4.w": tp = shard(0)\n  default: replicate\n}\n'
    err = error_of(text)
    assert_error(err, LayoutNameError, 'pattern "layers.4.w" of layout \'a\' matches no tensor', 5, 3)


def test_pattern_matching_only_some_digit_runs_is_fine():
    text = TINY + 'tensor "layers.3.w" [4] fp32\nlayout a on m {\n'
    text += '  "layers.3.w": tp = shard(0)\n  default: replicate\n}\n'
    assert layoutlang.loads(text).layouts["a"].placement("layers.3.w").placements[0].dim == 0


def test_unmatched_pattern_in_an_included_layout_names_the_including_file(tmp_path):
    write(tmp_path / "layouts" / "a.layout", 'layout a on m {\n  "w": tp = shard(0)\n  "v": tp = shard(0)\n}\n')
    main = write(tmp_path / "main.layout", TINY + 'include "layouts/a.layout"\n')
    err = load_error(main)
    assert_error(err, LayoutNameError, 'pattern "v" of layout \'a\' matches no tensor', 3, 3,
                 path=str(tmp_path / "layouts" / "a.layout"))
    assert [(s.path, s.line, s.column) for s in err.span.included_from] == [(str(main), 3, 1)]


def tied_qwen3(tmp_path: Path) -> Path:
    config = json.loads((Path(__file__).resolve().parent.parent / "examples" / "configs" / "qwen3_tiny" /
                         "config.json").read_text("utf-8"))
    config["tie_word_embeddings"] = True  # no lm_head.weight
    return write(tmp_path / "config.json", json.dumps(config))


def test_rules_of_a_preset_are_generic_and_may_match_nothing(tmp_path):
    tied_qwen3(tmp_path)
    main = write(
        tmp_path / "main.layout",
        'tensors from hf "config.json" as cfg\nlet infer_tp = 2\nmesh infer [tp = 2]\ninclude "preset:llama/vllm"\n',
    )
    program = layoutlang.load(main)
    assert "lm_head.weight" not in program.tensors
    assert program.layouts["vllm"].placement("model.embed_tokens.weight").placements[0].dim == 0
    # the same rule written in the program itself is checked
    write(main, main.read_text("utf-8") + 'layout own on infer {\n  "lm_head.weight": tp = shard(0)\n}\n')
    err = load_error(main)
    assert_error(err, LayoutNameError, 'pattern "lm_head.weight" of layout \'own\' matches no tensor', 6, 3,
                 path=str(main))


# ========================================================== errors in included files


def test_error_in_a_nested_include_names_every_including_file(tmp_path):
    write(tmp_path / "bad.layout", "let layers = 4\nlet per_stage = layers // stagse\n")
    write(tmp_path / "mid.layout", '# the model\ninclude "bad.layout"\n')
    main = write(tmp_path / "main.layout", 'let stages = 2\n\ninclude "mid.layout"\n')
    err = load_error(main)
    assert_error(err, LayoutNameError, "unknown name 'stagse'", 2, 27, path=str(tmp_path / "bad.layout"))
    text = str(err)
    assert f"  included from {tmp_path / 'mid.layout'}:2:1\n  included from {main}:3:1\n  hint:" in text
    assert err.to_json()["included_from"] == [
        {"file": str(tmp_path / "mid.layout"), "line": 2, "column": 1},
        {"file": str(main), "line": 3, "column": 1},
    ]


def test_syntax_error_in_an_included_file_names_the_including_file(tmp_path):
    write(tmp_path / "bad.layout", "let a = 4 / 2\n")
    main = write(tmp_path / "main.layout", 'let b = 1\ninclude "bad.layout"\n')
    err = load_error(main)
    assert_error(err, LayoutSyntaxError, "unexpected character '/'", 1, 11, path=str(tmp_path / "bad.layout"))
    assert [(s.path, s.line) for s in err.span.included_from] == [(str(main), 2)]


def test_error_found_when_resolving_a_preset_layout_names_the_including_file(tmp_path):
    """Rule matching runs lazily, long after the include was read: the span keeps the chain."""
    tied_qwen3(tmp_path)
    main = write(
        tmp_path / "main.layout",
        'tensors from hf "config.json" as cfg\nlet infer_tp = 3\nmesh infer [tp = 3]\ninclude "preset:llama/vllm"\n',
    )
    err = load_error(main)  # 3 ranks cannot split q_proj's heads evenly, or kv into chunks
    assert err.span is not None and err.span.path.endswith("vllm.layout")
    assert [(s.path, s.line, s.column) for s in err.span.included_from] == [(str(main), 4, 1)]
    assert f"included from {main}:4:1" in str(err)


def test_file_not_utf8_included_names_the_including_file(tmp_path):
    write(tmp_path / "latin1.layout", "let caf\xe9 = 1\n".encode("latin-1"))
    main = write(tmp_path / "main.layout", 'let a = 1\ninclude "latin1.layout"\n')
    err = load_error(main)
    assert_error(err, LayoutSyntaxError, "not UTF-8", 1, 8, path=str(tmp_path / "latin1.layout"))
    assert [(s.path, s.line) for s in err.span.included_from] == [(str(main), 2)]


# ======================================================================== extends

_EXTENDS = 'mesh m [tp = 2]\ntensor "w" [4] fp32\nlayout base on m {\n  "w": tp = shard(0)\n}\n'


def test_layout_extending_an_unknown_layout_with_did_you_mean():
    err = error_of(_EXTENDS + "layout child on m extends bse {\n  default: replicate\n}\n")
    assert_error(err, LayoutNameError, "layout 'child' extends an unknown layout 'bse'", 6, 27, hint="'base'")


def test_layouts_extending_each_other_in_a_cycle():
    err = error_of(_EXTENDS + "layout a on m extends b {}\nlayout b on m extends a {}\n")
    assert_error(err, LayoutNameError, "layouts extend each other in a cycle: a -> b -> a", 7, 23)


def test_inherited_rule_on_a_mesh_without_its_axis_points_at_the_rule():
    err = error_of(_EXTENDS + "mesh d [dp = 2]\nlayout child on d extends base {}\n")
    assert_error(err, LayoutNameError, "unknown axis 'tp'", 4, 8)


def test_a_constant_a_preset_reads_is_hinted_as_a_let_before_the_include(tmp_path):
    """The fix is a 'let' before the include, not a near name such as the mesh's 'train.pp'."""
    path = tmp_path / "refit.layout"
    path.write_text('include "preset:qwen3_30b_a3b"\nmesh train [pp = 2, ep = 4, tp = 2]\n'
                    'include "preset:qwen3_moe/megatron"\n')
    with pytest.raises(LayoutNameError) as caught:
        layoutlang.load(path)
    err = caught.value
    assert err.message == "unknown name 'train_pp'"
    assert err.hint == f"define it before the include at {path}:3:1: let train_pp = ..."
    path.write_text(path.read_text().replace("include \"preset:qwen3_moe", "let train_pp = 2\nlet train_ep = 4\n"
                                             "let train_tp = 2\ninclude \"preset:qwen3_moe"))
    assert "megatron" in layoutlang.load(path).layouts


def test_a_generic_layout_may_match_nothing_and_the_others_are_still_checked():
    """``generic layout``: a user's family layout, as generic as a preset's (issue 29)."""
    text = (
        'mesh m [tp = 2]\ntensor "embed" [8, 4] fp32\n'
        'generic layout family on m {\n  "embed": tp = shard(0)\n  "lm_head": tp = shard(0)\n}\n'
    )
    program = layoutlang.loads(text)
    assert program.layout("family").rule_for("embed") is not None
    # extending it keeps its rules generic; a rule of the child is checked
    child = 'layout wide on m extends family {\n  "embedd": tp = shard(1)\n}\n'
    with pytest.raises(LayoutNameError) as caught:
        layoutlang.loads(text + child, path="family.layout")
    assert caught.value.message == 'pattern "embedd" of layout \'wide\' matches no tensor of the program'
    assert (caught.value.span.line, caught.value.hint) == (8, 'did you mean "embed"?')
    # without the word, the family's own unmatched pattern is an error
    with pytest.raises(LayoutNameError, match='pattern "lm_head" of layout \'family\' matches no tensor'):
        layoutlang.loads(text.replace("generic layout", "layout"))
    # 'generic' is a word only where a statement starts: a name elsewhere
    assert layoutlang.loads("let generic = 2\nmesh generic [tp = generic]\n").meshes["generic"].size == 2


def test_a_preset_extending_an_unincluded_one_names_the_preset_to_include(tmp_path):
    path = tmp_path / "ep.layout"
    path.write_text('include "preset:qwen3_30b_a3b"\nmesh infer [dp = 2, tp = 4]\nlet num_experts = cfg.num_experts\n'
                    'include "preset:qwen3_moe/vllm_fused_ep"\n')
    with pytest.raises(LayoutNameError) as caught:
        layoutlang.load(path)
    assert caught.value.message.startswith("layout 'vllm_fused_ep' extends an unknown layout 'vllm_fused'")
    assert caught.value.hint == "include \"preset:qwen3_moe/vllm_fused\" before this preset (it declares 'vllm_fused')"
    ep = 'include "preset:qwen3_moe/vllm_fused_ep"'
    path.write_text(path.read_text().replace(ep, 'include "preset:qwen3_moe/vllm_fused"\n' + ep))
    assert "vllm_fused_ep" in layoutlang.load(path).layouts


def test_a_mesh_axis_a_preset_reads_is_hinted_as_an_axis_of_the_mesh(tmp_path):
    """A preset reading 'infer.dp' of a mesh without that axis: the fix is the axis in the
    mesh's own declaration, not the preset's near name 'infer.tp'."""
    path = tmp_path / "refit.layout"
    path.write_text('include "preset:qwen3_30b_a3b"\nlet num_experts = cfg.num_experts\n'
                    'mesh infer [ep = 2, tp = 2] on ranks 0..3\ninclude "preset:qwen3_moe/vllm_fused"\n'
                    'include "preset:qwen3_moe/vllm_fused_ep"\n')
    with pytest.raises(LayoutNameError) as caught:
        layoutlang.load(path)
    err = caught.value
    assert err.message == "unknown name 'infer.dp' ('infer.' names: infer.ep, infer.tp)"
    assert err.hint == (
        "the included file reads the size of axis 'dp' of mesh 'infer': give the mesh that axis (of size 1 if "
        f"it does not split) where it is declared, before the include at {path}:5:1"
    )
    # declared after the include: the hint says to declare it first
    path.write_text('include "preset:qwen3_30b_a3b"\nlet num_experts = cfg.num_experts\n'
                    'include "preset:qwen3_moe/vllm_fused_ep"\nmesh infer [dp = 1, tp = 2] on ranks 0..1\n')
    with pytest.raises(LayoutNameError) as caught:
        layoutlang.load(path)
    assert caught.value.hint == (
        f"the included file reads 'infer.dp': declare mesh 'infer' with axis 'dp' before the include at {path}:3:1"
    )


def test_a_config_key_a_preset_reads_is_hinted_as_missing_from_the_config(tmp_path):
    """Not the near key of the config ('num_key_value_head'): the preset's name is right."""
    config = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_head": 2, "vocab_size": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "refit.layout"
    path.write_text(f'tensors from hf "{tmp_path / "config.json"}" as cfg\nmesh infer [tp = 2] on ranks 0..1\n'
                    'include "preset:llama/vllm_fused"\n')
    with pytest.raises(LayoutError) as caught:
        layoutlang.load(path)
    assert caught.value.hint == (
        "the model description 'cfg' has no 'num_key_value_heads', which the included file reads: "
        'add "num_key_value_heads" to its config.json'
    )


def test_another_size_of_a_preset_model_is_not_suggested():
    """'llama3_8b' is not 'llama3_70b': the hint says how to describe the model instead."""
    with pytest.raises(LayoutIncludeError) as caught:
        layoutlang.loads('include "preset:llama3_8b"')
    assert caught.value.hint == (
        "there is no preset of the model 'llama3_8b': describe it from its own config "
        '(tensors from hf "PATH/config.json" as cfg) and include its family\'s layouts ("preset:llama/...")'
    )
    with pytest.raises(LayoutIncludeError) as caught:  # a typo of that very model is still suggested
        layoutlang.loads('include "preset:llama3-70b"')
    assert caught.value.hint == "did you mean 'llama3_70b'?"


def test_a_fused_storage_split_inside_a_block_is_hinted_as_too_many_ranks():
    """Megatron's linear_qkv is cut by query group: tp 4 on 2 groups splits one."""
    text = (
        'include "preset:llama3_70b"\nmesh train [pp = 1, tp = 16] on ranks 0..15\n'
        'include "preset:llama/megatron_core"\n'
    )
    with pytest.raises(LayoutValueError) as caught:
        layoutlang.loads(text).layout("megatron_core").check()
    assert "not a multiple of its block size" in caught.value.message
    assert caught.value.hint is not None and "use fewer ranks on that axis" in caught.value.hint


def test_a_requirement_that_does_not_hold_is_an_error_in_its_own_words():
    err = error_of('let heads = 4\nmesh infer [tp = 8]\nrequire heads % infer.tp == 0: "tp must divide the heads"\n')
    assert_error(
        err, LayoutValueError,
        "tp must divide the heads (required heads % infer.tp == 0, with heads = 4, infer.tp = 8)", 3, 1,
    )
    err = error_of("let a = 2\nrequire a < 1\n")
    assert_error(err, LayoutValueError, "a requirement of the program does not hold (required a < 1, with a = 2)", 2, 1)


@pytest.mark.parametrize("op, holds", [("==", False), ("!=", True), ("<", False), ("<=", False), (">", True),
                                       (">=", True)])
def test_every_comparison_of_require(op, holds):
    text = f"let a = 3\nlet b = 2\nrequire a {op} b + 0 * a\ntensor \"w\" [a] bf16\n"
    if holds:
        assert "w" in layoutlang.loads(text).tensors
    else:
        with pytest.raises(LayoutValueError, match=rf"required a {re.escape(op)} b \+ 0 \* a, with a = 3, b = 2\)"):
            layoutlang.loads(text)


def test_a_vllm_preset_refuses_more_tensor_parallel_ranks_than_heads(tmp_path):
    """vLLM asserts that tp divides the query heads and that one of tp and the kv heads
    divides the other: the presets say so at check time, not half a head per rank."""
    config = {
        "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "serve.layout"

    def load(tp: int, kv_heads: int = 2) -> None:
        (tmp_path / "config.json").write_text(json.dumps(config | {"num_key_value_heads": kv_heads}))
        path.write_text(f'tensors from hf "{tmp_path / "config.json"}" as cfg\nmesh infer [tp = {tp}]\n'
                        'include "preset:llama/vllm_fused"\n')
        layoutlang.load(path).check()

    load(4)
    load(2)
    with pytest.raises(LayoutValueError) as caught:
        load(8)
    assert "tp must divide num_attention_heads" in caught.value.message
    assert "with cfg.num_attention_heads = 4, infer.tp = 8" in caught.value.message
    assert caught.value.span.included_from  # at the preset's statement, included from the user's file
    with pytest.raises(LayoutValueError, match="one of tp and num_key_value_heads must divide the other"):
        load(4, kv_heads=3)
