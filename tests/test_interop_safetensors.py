"""Logical tensors from safetensors headers and sharded-checkpoint indexes, written by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from layoutlang.errors import ModelDescriptionError
from layoutlang.io import safetensors
from layoutlang.io.safetensors import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    read_safetensors_header,
    tensors_from_safetensors,
)

pytestmark = pytest.mark.timeout(60)

ITEMSIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}
ITEMSIZES |= {"I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1, "F8_E8M0": 1}


def encode_file(header: dict[str, Any], data_size: int) -> bytes:
    """A safetensors file: length, header JSON, then ``data_size`` zero bytes of data."""
    raw = json.dumps(header).encode("utf-8")
    return len(raw).to_bytes(8, "little") + raw + bytes(data_size)


def write_safetensors(
    path: Path,
    tensors: list[tuple[str, str, list[int]]],
    *,
    metadata: dict[str, str] | None = None,
    header_order: list[str] | None = None,
) -> Path:
    """Lay out ``tensors`` (name, dtype, shape) back to back in the given order.

    ``header_order`` lists the names in the order the header JSON should hold them, to show
    that the data order, not the JSON order, decides.
    """
    entries: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * ITEMSIZES[dtype]
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header: dict[str, Any] = {"__metadata__": metadata} if metadata is not None else {}
    header |= {name: entries[name] for name in (header_order or entries)}
    path.write_bytes(encode_file(header, offset))
    return path


def write_index(path: Path, weight_map: dict[str, str]) -> Path:
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}), encoding="utf-8")
    return path


# --- single files ---------------------------------------------------------------------


def test_single_file_in_data_order(tmp_path: Path) -> None:
    tensors = [
        ("model.embed_tokens.weight", "BF16", [32, 8]),
        ("model.layers.0.self_attn.q_proj.weight", "BF16", [8, 8]),
        ("model.norm.weight", "F32", [8]),
    ]
    path = write_safetensors(
        tmp_path / "model.safetensors",
        tensors,
        metadata={"format": "pt"},
        header_order=["model.norm.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"],
    )
    assert tensors_from_safetensors(path) == [
        ("model.embed_tokens.weight", (32, 8), "bf16"),
        ("model.layers.0.self_attn.q_proj.weight", (8, 8), "bf16"),
        ("model.norm.weight", (8,), "fp32"),
    ]


def test_every_safetensors_dtype_maps_to_a_short_name(tmp_path: Path) -> None:
    tensors = [(f"t_{dtype}", dtype, [2, 3]) for dtype in SAFETENSORS_DTYPES]
    path = write_safetensors(tmp_path / "all.safetensors", tensors)
    expected = ["bf16", "fp16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2"]
    expected += ["int8", "uint8", "int16", "int32", "int64", "bool", "e8m0"]
    assert [dtype for _, _, dtype in tensors_from_safetensors(path)] == expected


def test_scalar_and_empty_tensors(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", [("scale", "F32", []), ("empty", "BF16", [0, 4])])
    assert tensors_from_safetensors(path) == [("scale", (), "fp32"), ("empty", (0, 4), "bf16")]


def test_read_header_returns_header_and_data_start(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", [("w", "F16", [4, 4])], metadata={"format": "pt"})
    header, data_start = read_safetensors_header(path)
    header_length = int.from_bytes(path.read_bytes()[:8], "little")
    assert data_start == 8 + header_length
    assert header["__metadata__"] == {"format": "pt"}
    assert header["w"] == {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}
    assert path.stat().st_size == data_start + 32


def test_header_padding_is_allowed(tmp_path: Path) -> None:
    # writers pad the header with spaces to align the data
    raw = json.dumps({"w": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}).encode() + b"     "
    path = tmp_path / "padded.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(3))
    assert tensors_from_safetensors(path) == [("w", (3,), "uint8")]


def test_model_folder_with_a_single_file(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model.safetensors", [("w", "BF16", [2])])
    assert tensors_from_safetensors(tmp_path) == [("w", (2,), "bf16")]


# --- sharded checkpoints --------------------------------------------------------------


def write_two_shards(tmp_path: Path) -> Path:
    first = "model-00001-of-00002.safetensors"
    second = "model-00002-of-00002.safetensors"
    write_safetensors(
        tmp_path / first,
        [("model.embed_tokens.weight", "BF16", [16, 4]), ("model.layers.0.mlp.up_proj.weight", "BF16", [8, 4])],
    )
    write_safetensors(
        tmp_path / second,
        [("model.layers.1.mlp.up_proj.weight", "BF16", [8, 4]), ("lm_head.weight", "BF16", [16, 4])],
    )
    return write_index(
        tmp_path / "model.safetensors.index.json",
        {
            "lm_head.weight": second,
            "model.embed_tokens.weight": first,
            "model.layers.0.mlp.up_proj.weight": first,
            "model.layers.1.mlp.up_proj.weight": second,
        },
    )


def test_two_shard_index(tmp_path: Path) -> None:
    index = write_two_shards(tmp_path)
    assert tensors_from_safetensors(index) == [
        ("model.embed_tokens.weight", (16, 4), "bf16"),
        ("model.layers.0.mlp.up_proj.weight", (8, 4), "bf16"),
        ("model.layers.1.mlp.up_proj.weight", (8, 4), "bf16"),
        ("lm_head.weight", (16, 4), "bf16"),
    ]


def test_each_shard_header_is_read_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    index = write_two_shards(tmp_path)
    reads: list[str] = []

    def counting_read(path: Path) -> tuple[dict[str, Any], int]:
        reads.append(Path(path).name)
        return read_safetensors_header(path)

    monkeypatch.setattr(safetensors, "read_safetensors_header", counting_read)
    tensors_from_safetensors(index)
    assert reads == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_model_folder_prefers_the_index(tmp_path: Path) -> None:
    write_two_shards(tmp_path)
    assert len(tensors_from_safetensors(tmp_path)) == 4


def test_any_json_with_a_weight_map_is_an_index(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "shard.safetensors", [("w", "F32", [2])])
    index = write_index(tmp_path / "custom.json", {"w": "shard.safetensors"})
    assert tensors_from_safetensors(index) == [("w", (2,), "fp32")]


# --- errors ---------------------------------------------------------------------------


def error_for(path: Path) -> str:
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_safetensors(path)
    return error.value.message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.safetensors"
    message = error_for(path)
    assert str(path) in message and "not found" in message


def test_missing_file_for_read_header(tmp_path: Path) -> None:
    path = tmp_path / "absent.safetensors"
    with pytest.raises(ModelDescriptionError) as error:
        read_safetensors_header(path)
    assert str(path) in error.value.message


def test_truncated_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x10\x00\x00")
    message = error_for(path)
    assert str(path) in message and "truncated" in message


def test_truncated_header(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "cut.safetensors", [("w", "BF16", [4, 4])])
    path.write_bytes(path.read_bytes()[:20])
    message = error_for(path)
    assert str(path) in message and "truncated" in message


def test_truncated_data(tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "cut.safetensors", [("w", "BF16", [4, 4])])
    path.write_bytes(path.read_bytes()[:-1])
    message = error_for(path)
    assert str(path) in message and "truncated" in message and "'w'" in message


def test_header_length_over_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    path.write_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
    message = error_for(path)
    assert str(path) in message and str(MAX_HEADER_BYTES) in message


def test_header_not_json(tmp_path: Path) -> None:
    raw = b'{"w": {"dtype": "BF16",'
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    message = error_for(path)
    assert str(path) in message and "not JSON" in message


def test_header_not_utf8(tmp_path: Path) -> None:
    raw = b'{"w\xff": {}}'
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    message = error_for(path)
    assert str(path) in message and "UTF-8" in message


def test_header_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(encode_file([], 0))  # type: ignore[arg-type]
    message = error_for(path)
    assert str(path) in message and "JSON object" in message


def test_unknown_dtype(tmp_path: Path) -> None:
    header = {"w": {"dtype": "U16", "shape": [4], "data_offsets": [0, 8]}}
    path = tmp_path / "bad.safetensors"
    path.write_bytes(encode_file(header, 8))
    message = error_for(path)
    assert str(path) in message and "'U16'" in message and "BF16" in message


def test_torch_spelling_is_not_a_safetensors_dtype(tmp_path: Path) -> None:
    header = {"w": {"dtype": "float32", "shape": [1], "data_offsets": [0, 4]}}
    path = tmp_path / "bad.safetensors"
    path.write_bytes(encode_file(header, 4))
    assert "'float32'" in error_for(path)


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        pytest.param({"shape": [2], "data_offsets": [0, 4]}, "dtype", id="no-dtype"),
        pytest.param({"dtype": "BF16", "shape": [2.0], "data_offsets": [0, 4]}, "shape", id="float-dim"),
        pytest.param({"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}, "shape", id="negative-dim"),
        pytest.param({"dtype": "BF16", "shape": [2], "data_offsets": [0]}, "data_offsets", id="one-offset"),
        pytest.param({"dtype": "BF16", "shape": [2], "data_offsets": [4, 0]}, "data_offsets", id="reversed"),
        pytest.param({"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}, "needs 6 bytes", id="size-mismatch"),
    ],
)
def test_malformed_entry(tmp_path: Path, entry: dict[str, Any], fragment: str) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(encode_file({"w": entry}, 8))
    message = error_for(path)
    assert str(path) in message and "'w'" in message and fragment in message


def test_index_not_json(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": ', encoding="utf-8")
    message = error_for(index)
    assert str(index) in message and "not JSON" in message


def test_json_without_weight_map(tmp_path: Path) -> None:
    index = tmp_path / "config.json"
    index.write_text('{"model_type": "llama"}', encoding="utf-8")
    message = error_for(index)
    assert str(index) in message and "weight_map" in message


def test_index_names_missing_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", [("a", "BF16", [2])])
    index = write_index(
        tmp_path / "model.safetensors.index.json",
        {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    )
    message = error_for(index)
    assert str(index) in message and "'model-00002-of-00002.safetensors'" in message and "missing" in message


def test_weight_map_entry_absent_from_its_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "s1.safetensors", [("a", "BF16", [2])])
    write_safetensors(tmp_path / "s2.safetensors", [("b", "BF16", [2])])
    index = write_index(tmp_path / "model.safetensors.index.json", {"a": "s1.safetensors", "c": "s2.safetensors"})
    message = error_for(index)
    assert str(index) in message and "'c'" in message and "'s2.safetensors'" in message


def test_weight_map_points_at_the_wrong_shard(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "s1.safetensors", [("a", "BF16", [2])])
    write_safetensors(tmp_path / "s2.safetensors", [("b", "BF16", [2])])
    index = write_index(tmp_path / "model.safetensors.index.json", {"a": "s2.safetensors", "b": "s2.safetensors"})
    # s1 is never named, so 'a' is not found at all; naming both shards finds it in the other
    assert "'a'" in error_for(index)
    index = write_index(
        tmp_path / "model.safetensors.index.json",
        {"a": "s2.safetensors", "b": "s2.safetensors", "x": "s1.safetensors"},
    )
    message = error_for(index)
    assert str(index) in message and "it is in 's1.safetensors'" in message


def test_tensor_stored_in_two_shards(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "s1.safetensors", [("a", "BF16", [2])])
    write_safetensors(tmp_path / "s2.safetensors", [("a", "BF16", [2])])
    index = write_index(tmp_path / "model.safetensors.index.json", {"a": "s1.safetensors", "b": "s2.safetensors"})
    message = error_for(index)
    assert str(index) in message and "both" in message


def test_error_in_a_shard_names_the_shard(tmp_path: Path) -> None:
    shard = tmp_path / "s1.safetensors"
    shard.write_bytes(b"\x00")
    index = write_index(tmp_path / "model.safetensors.index.json", {"a": "s1.safetensors"})
    message = error_for(index)
    assert str(shard) in message and "truncated" in message


# --- what a checkpoint lacks, and the prefix it may use instead ---------------------------

@pytest.mark.parametrize(
    ("missing", "spare", "expected"),
    [
        (["layers.0.w", "norm.w"], ["model.layers.0.w", "model.norm.w"], ("", "model.")),
        (["model.layers.0.w", "model.norm.w"], ["layers.0.w", "norm.w", "extra"], ("model.", "")),
        (["module.layers.0.w"], ["decoder.layers.0.w"], ("module.", "decoder.")),
        # no one prefix explains both names
        (["layers.0.w", "norm.w"], ["model.layers.0.w", "other.norm.w"], None),
        (["layers.0.w"], ["layers.0.v"], None),
        (["w"], [], None),
    ],
)
def test_renamed_prefix(missing: list[str], spare: list[str], expected: tuple[str, str] | None) -> None:
    assert safetensors.renamed_prefix(missing, spare) == expected
    if expected is not None:
        ours, theirs = expected
        assert {theirs + name[len(ours):] for name in missing} <= set(spare)
