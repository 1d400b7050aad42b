"""Safe checkpoints (issue 14, case 6): strict safetensors headers, index files confined to
their folder, bit-level verification (NaN), atomic ``--to`` writes and the refusal of a folder
holding an earlier run's files.

Every bad file is written here byte by byte from the format's own rules (an 8-byte
little-endian length, a JSON header, the data), not with layoutlang's writer; CLI cases run
``layoutlang`` in a subprocess and check the exit code and that no traceback is printed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from layoutlang.errors import ExitCode, LayoutValueError, ModelDescriptionError, RuntimeFailure
from layoutlang.io import weights
from layoutlang.io.output import WrittenFile, read_manifest, why_not_removable, write_manifest
from layoutlang.io.safetensors import MAX_HEADER_BYTES, read_safetensors_header, tensors_from_safetensors
from layoutlang.io.weights import SafetensorsCheckpoint, write_safetensors

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
LAYOUTLANG = [sys.executable, "-m", "layoutlang.cli"]

#: bytes per element of each safetensors dtype, from the format's table
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

#: two source ranks (tp 2) to one destination rank: three local workers, a few seconds
PROGRAM = """\
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 1] on ranks 2..2
tensor "a.weight" [4, 2] fp32
tensor "b.weight" [4] fp32
layout src on train { "a.weight": tp = shard(0)  "b.weight": tp = shard(0) }
layout dst on infer { "a.weight": tp = replicate  "b.weight": tp = replicate }
reshard src -> dst
"""


def encode(header: dict[str, Any], data: bytes) -> bytes:
    """A safetensors file as the format defines it: u64 LE header length, JSON, data."""
    raw = json.dumps(header).encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype: str, shape: list[int], begin: int, end: int | None = None) -> dict[str, Any]:
    """A header entry; ``end`` defaults to the span shape x dtype needs."""
    if end is None:
        end = begin + math.prod(shape) * ITEMSIZE[dtype]
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def refusal(path: Path, **kwargs: Any) -> str:
    with pytest.raises(ModelDescriptionError) as error:
        tensors_from_safetensors(path, **kwargs)
    return str(error.value)


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LAYOUTLANG, *args], cwd=cwd, capture_output=True, text=True, timeout=200, env=env or os.environ.copy()
    )


# --- headers ------------------------------------------------------------------------------


def test_a_span_other_than_shape_times_dtype_is_refused_naming_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    # [4, 2] F32 needs 32 bytes; the span says 16
    path.write_bytes(encode({"a": entry("F32", [4, 2], 0, 16), "b": entry("F32", [4], 16)}, bytes(32)))
    message = refusal(path)
    assert str(path) in message and "'a'" in message and "needs 32 bytes" in message and "span 16" in message
    # every reader validates: the checkpoint the workers open refuses it as well
    with pytest.raises(ModelDescriptionError, match="needs 32 bytes"):
        SafetensorsCheckpoint(path)


def test_overlapping_spans_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    # b's 16 bytes are a's last 16: b would read a's values
    path.write_bytes(encode({"a": entry("F32", [4, 2], 0), "b": entry("F32", [4], 16)}, bytes(32)))
    message = refusal(path)
    assert str(path) in message and "'a'" in message and "'b'" in message and "overlap" in message
    assert "[16, 32)" in message


def test_a_span_outside_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"a": entry("F32", [4], 0), "b": entry("F32", [4], 16)}, bytes(20)))
    message = refusal(path)
    assert str(path) in message and "'b'" in message and "ends at data byte 32" in message


def test_bytes_that_belong_to_no_tensor_are_refused(tmp_path: Path) -> None:
    # the format wants the data covered exactly: a hole between tensors, or bytes after the last
    hole = tmp_path / "hole.safetensors"
    hole.write_bytes(encode({"a": entry("U8", [4], 0), "b": entry("U8", [4], 8)}, bytes(12)))
    message = refusal(hole)
    assert str(hole) in message and "[4, 8)" in message and "'a'" in message and "no tensor" in message
    tail = tmp_path / "tail.safetensors"
    tail.write_bytes(encode({"a": entry("U8", [4], 0)}, bytes(7)))
    message = refusal(tail)
    assert str(tail) in message and "last 3 bytes" in message


def test_empty_tensors_take_no_bytes_anywhere_in_the_data(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    header = {"a": entry("F16", [2], 0), "e": entry("F32", [0, 3], 2), "s": entry("I32", [], 4)}
    path.write_bytes(encode(header, bytes(8)))
    assert tensors_from_safetensors(path) == [("a", (2,), "fp16"), ("e", (0, 3), "fp32"), ("s", (), "int32")]


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        pytest.param({"a": {"dtype": 4, "shape": [1], "data_offsets": [0, 4]}}, "no dtype string", id="dtype-int"),
        pytest.param({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 4]}}, "shape", id="shape-str"),
        pytest.param({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "shape", id="shape-bool"),
        pytest.param({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, "4"]}}, "data_offsets", id="end-str"),
        pytest.param({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, "data_offsets", id="three"),
        pytest.param(
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": {"n": 1}},
            "__metadata__",
            id="metadata-int",
        ),
    ],
)
def test_entry_fields_of_the_wrong_type_are_refused(tmp_path: Path, header: dict[str, Any], fragment: str) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode(header, bytes(4)))
    message = refusal(path)
    assert str(path) in message and fragment in message


def test_a_huge_header_length_is_refused_without_reading_it(tmp_path: Path) -> None:
    path = tmp_path / "huge.safetensors"
    # 2^63 bytes of header: refused from the length alone (the format's 100 MB limit)
    path.write_bytes(struct.pack("<Q", 1 << 63) + b"{}")
    message = refusal(path)
    assert str(path) in message and str(MAX_HEADER_BYTES) in message
    with pytest.raises(ModelDescriptionError, match="exceeds"):
        read_safetensors_header(path)


def test_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    message = refusal(fifo)  # opened without blocking: no writer ever comes
    assert str(fifo) in message and "FIFO" in message


# --- indexes ----------------------------------------------------------------------------


def write_index(folder: Path, weight_map: Any) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}), encoding="utf-8")
    return index


def write_shard(path: Path, name: str = "w") -> Path:
    path.write_bytes(encode({name: entry("F32", [2], 0)}, bytes(8)))
    return path


@pytest.mark.parametrize(
    ("weight_map", "fragment"),
    [
        pytest.param([["w", "s.safetensors"]], "found a JSON array", id="list"),
        pytest.param("s.safetensors", "found a JSON string", id="string"),
        pytest.param({"w": ["s.safetensors"]}, "tensor 'w' the file ['s.safetensors']", id="value-list"),
        pytest.param({"w": 3}, "tensor 'w' the file 3", id="value-int"),
        pytest.param({"w": ""}, "tensor 'w' the file ''", id="value-empty"),
    ],
)
def test_a_weight_map_that_is_not_names_to_files_is_refused(tmp_path: Path, weight_map: Any, fragment: str) -> None:
    write_shard(tmp_path / "s.safetensors")
    index = write_index(tmp_path, weight_map)
    message = refusal(tmp_path)
    assert str(index) in message and fragment in message


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A valid shard beside (not inside) the checkpoint folder ``tmp_path / 'ckpt'``."""
    (tmp_path / "ckpt").mkdir()
    return write_shard(tmp_path / "secret.safetensors")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink", "symlinked-folder"])
def test_index_files_outside_the_folder_are_refused_unless_allowed(tmp_path: Path, outside: Path, how: str) -> None:
    folder = tmp_path / "ckpt"
    if how == "dotdot":
        name = "../secret.safetensors"
    elif how == "absolute":
        name = str(outside)
    elif how == "symlink":
        name = "model-00001-of-00001.safetensors"
        (folder / name).symlink_to(outside)
    else:
        (folder / "sub").symlink_to(tmp_path, target_is_directory=True)
        name = "sub/secret.safetensors"
    index = write_index(folder, {"w": name})
    message = refusal(folder)
    assert str(index) in message and repr(name) in message and "inside its folder" in message
    assert "--allow-outside-paths" in message  # the hint says how to opt in
    if how.startswith("symlink"):
        assert str(outside) in message  # where the link leads
    # opted in, the same index reads, from the shard outside
    assert tensors_from_safetensors(folder, allow_outside_paths=True) == [("w", (2,), "fp32")]
    with pytest.raises(ModelDescriptionError, match="inside its folder"):
        SafetensorsCheckpoint(folder)
    assert set(SafetensorsCheckpoint(folder, allow_outside_paths=True).files) == {"w"}


@pytest.mark.parametrize("linked", ["model.safetensors", "model.safetensors.index.json"])
def test_a_folder_whose_checkpoint_file_links_outside_it_is_refused_unless_allowed(
    tmp_path: Path, outside: Path, linked: str
) -> None:
    folder = tmp_path / "ckpt"
    if linked == "model.safetensors":
        (folder / linked).symlink_to(outside)
    else:  # an index outside (its names are read from the folder of the link)
        write_index(tmp_path, {"w": "../secret.safetensors"})
        (folder / linked).symlink_to(tmp_path / "model.safetensors.index.json")
    message = refusal(folder)
    assert f"{folder / linked}: the checkpoint's {linked} is a symbolic link to" in message
    assert "must lie inside it" in message and "--allow-outside-paths" in message
    with pytest.raises(ModelDescriptionError, match="must lie inside it"):
        SafetensorsCheckpoint(folder)
    # opted in, the link is followed, as an index's entries are
    assert tensors_from_safetensors(folder, allow_outside_paths=True) == [("w", (2,), "fp32")]
    assert set(SafetensorsCheckpoint(folder, allow_outside_paths=True).files) == {"w"}
    # a file named directly is the caller's own choice
    if linked == "model.safetensors":
        assert tensors_from_safetensors(folder / linked) == [("w", (2,), "fp32")]


def test_apply_refuses_a_model_safetensors_link_leaving_the_from_folder(tmp_path: Path, program: Path) -> None:
    nan_checkpoint(tmp_path / "real")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "real" / "model.safetensors")
    result = run("apply", str(program), "--from", "ckpt", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "is a symbolic link to" in result.stderr
    assert "--allow-outside-paths" in result.stderr
    allowed = run("apply", str(program), "--from", "ckpt", "--allow-outside-paths", "--json", cwd=tmp_path)
    assert allowed.returncode == ExitCode.OK, allowed.stdout + allowed.stderr
    assert json.loads(allowed.stdout)["ok"]


def test_a_loop_of_links_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").symlink_to("b.safetensors")
    (tmp_path / "b.safetensors").symlink_to("a.safetensors")
    index = write_index(tmp_path, {"w": "a.safetensors"})
    message = refusal(tmp_path)
    assert str(index) in message and "'a.safetensors'" in message and "loop of symbolic links" in message


def test_links_inside_the_folder_and_into_the_hub_cache_blobs_are_followed(tmp_path: Path) -> None:
    # inside: a link to another file of the folder
    folder = tmp_path / "plain"
    folder.mkdir()
    write_shard(folder / "real.safetensors")
    (folder / "model-00001-of-00001.safetensors").symlink_to("real.safetensors")
    write_index(folder, {"w": "model-00001-of-00001.safetensors"})
    assert tensors_from_safetensors(folder) == [("w", (2,), "fp32")]
    # the Hugging Face hub cache: snapshots/REV/FILE -> ../../blobs/HASH
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    write_shard(repo / "blobs" / "9f86d08")
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/9f86d08")
    write_index(snapshot, {"w": "model-00001-of-00001.safetensors"})
    assert tensors_from_safetensors(snapshot) == [("w", (2,), "fp32")]
    # but not out of the repository's blobs: a link to another repository's files is outside
    other = write_shard(tmp_path / "hub" / "other.safetensors")
    (snapshot / "model-00001-of-00001.safetensors").unlink()
    (snapshot / "model-00001-of-00001.safetensors").symlink_to(other)
    assert "outside the folder" in refusal(snapshot)


# --- verification by bits -----------------------------------------------------------------


def test_verify_compares_bits_nan_equals_nan_and_signed_zeros_differ() -> None:
    import layoutlang

    program = layoutlang.loads(
        'mesh m [tp = 1] on ranks 0..0\ntensor "w" [4] fp32\nlayout l on m { "w": tp = replicate }\n'
    )
    layout = program.layouts["l"]
    sent = torch.tensor([float("nan"), -0.0, 1.0, float("-inf")])
    # a NaN with another payload: the same value class, other bits
    other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)

    def truth(_name: str, _index: int, _box: Any) -> torch.Tensor:
        return sent.clone()

    assert weights.verify(layout, 0, {"w": sent.clone()}, truth=truth).ok
    zero = sent.clone()
    zero[1] = 0.0  # == -0.0 as values, not as bits
    nan = sent.clone()
    nan[0] = other_nan[0]
    for got, where in ((zero, 1), (nan, 0)):
        check = weights.verify(layout, 0, {"w": got}, truth=truth)
        assert not check.ok and f"1 wrong elements, the first at [{where}]" in check.mismatches[0]


def test_a_checkpoint_of_nans_and_a_scalar_verifies_against_itself(tmp_path: Path) -> None:
    import layoutlang

    program = layoutlang.loads(
        'mesh m [tp = 1] on ranks 0..0\ntensor "s" [] fp32\ntensor "w" [3] fp32\n'
        'layout l on m { "s": tp = replicate  "w": tp = replicate }\n'
    )
    layout = program.layouts["l"]
    path = tmp_path / "m.safetensors"
    s = struct.pack("<I", 0x7FC00000)  # NaN
    w = struct.pack("<3I", 0xFFC00001, 0x00000000, 0x80000000)  # a NaN with a payload, 0.0, -0.0
    path.write_bytes(encode({"s": entry("F32", [], 0), "w": entry("F32", [3], 4)}, s + w))
    checkpoint = SafetensorsCheckpoint(path)
    storages = {"s": torch.zeros(()), "w": torch.zeros(3)}
    assert checkpoint.fill(layout, 0, storages) == 16
    assert storages["s"].shape == () and storages["w"].view(torch.int32).tolist() == list(struct.unpack("<3i", w))

    def truth(name: str, _index: int, box: Any) -> torch.Tensor:
        tensor = layout.tensors[name]
        return checkpoint.read_box(name, tensor.dtype, tensor.shape, box.offsets, box.sizes)

    check = weights.verify(layout, 0, storages, truth=truth)
    assert check.ok and check.boxes == 2 and check.bytes == 16


# --- atomic writes --------------------------------------------------------------------------


def test_a_full_disk_leaves_no_partial_file_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "rank00002.safetensors"
    write_safetensors(target, {"w": torch.arange(4, dtype=torch.float32)})
    before = target.read_bytes()
    real_write = os.write
    calls = []

    def full_disk(fd: int, data: Any) -> int:
        # the first write lands (the header), the second finds the disk full after half of it
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, data)
        real_write(fd, bytes(memoryview(data)[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(RuntimeFailure) as error:
        write_safetensors(target, {"w": torch.arange(1024, dtype=torch.float32)})
    monkeypatch.undo()
    assert error.value.exit_code == ExitCode.FAILURE
    assert str(target) in error.value.message and "No space left" in error.value.message
    assert "no partial file" in error.value.message
    assert sorted(os.listdir(tmp_path)) == ["rank00002.safetensors"]  # no temporary file left
    assert target.read_bytes() == before  # the earlier file, whole


def test_a_written_file_has_the_permissions_a_plain_open_gives(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "rank00000.safetensors", {"w": torch.zeros(2)})
    (tmp_path / "plain").write_bytes(b"")  # what open() makes under this process's umask
    assert (tmp_path / "rank00000.safetensors").stat().st_mode == (tmp_path / "plain").stat().st_mode
    assert sorted(os.listdir(tmp_path)) == ["plain", "rank00000.safetensors"]


def test_an_unwritable_folder_is_a_path_mistake(tmp_path: Path) -> None:
    with pytest.raises(LayoutValueError) as error:
        write_safetensors(tmp_path / "missing" / "x.safetensors", {"w": torch.zeros(2)})
    assert str(tmp_path / "missing") in error.value.message and error.value.exit_code == ExitCode.BAD_INPUT


# --- the command line ------------------------------------------------------------------------


@pytest.fixture
def program(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.layout"
    path.write_text(PROGRAM, encoding="utf-8")
    return path


def nan_checkpoint(folder: Path) -> tuple[bytes, bytes]:
    """A checkpoint of PROGRAM's tensors whose b holds NaNs (two payloads); returns their bytes."""
    folder.mkdir()
    a = struct.pack("<8f", *range(8))
    b = struct.pack("<4I", 0x3F800000, 0x7FC00000, 0xFFC00123, 0x40400000)  # 1.0, NaN, -NaN(payload), 3.0
    header = {"a.weight": entry("F32", [4, 2], 0), "b.weight": entry("F32", [4], 32)}
    (folder / "model.safetensors").write_bytes(encode(header, a + b))
    return a, b


def written_bytes(path: Path) -> dict[str, bytes]:
    """Each tensor's data bytes in a written safetensors file, read by the format's rules."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    start = 8 + length
    return {
        name: raw[start + e["data_offsets"][0] : start + e["data_offsets"][1]]
        for name, e in header.items()
        if name != "__metadata__"
    }


def test_a_nan_checkpoint_refits_verified_into_a_folder_of_an_earlier_run_with_overwrite(
    tmp_path: Path, program: Path
) -> None:
    a, b = nan_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    first = run("apply", str(program), "--from", "ckpt", "--to", "out", cwd=tmp_path)
    assert first.returncode == ExitCode.OK, first.stdout + first.stderr
    # the run recorded what it wrote: name, size and SHA-256
    manifest = json.loads((out / ".layoutlang-manifest.json").read_text(encoding="utf-8"))
    written = (out / "rank00002.safetensors").read_bytes()
    assert manifest["files"] == {
        "rank00002.safetensors": {"bytes": len(written), "sha256": hashlib.sha256(written).hexdigest()}
    }
    interrupted = ".rank00002.safetensors.k3j_x9.tmp"  # what a write killed halfway leaves
    (out / interrupted).write_bytes(b"half a file")
    (out / "README").write_text("not a run's file", encoding="utf-8")
    before = sorted(os.listdir(out))
    refused = run("apply", str(program), "--from", "ckpt", "--to", "out", cwd=tmp_path)
    assert refused.returncode == ExitCode.BAD_INPUT, refused.stderr
    assert "Traceback" not in refused.stderr and "earlier run" in refused.stderr and "--overwrite" in refused.stderr
    assert sorted(os.listdir(out)) == before  # untouched
    result = run("apply", str(program), "--from", "ckpt", "--to", "out", "--overwrite", "--json", cwd=tmp_path)
    assert result.returncode == ExitCode.OK, result.stdout + result.stderr
    report = json.loads(result.stdout)["result"]
    assert report["ok"] and report["runs"]["reshard"]["verified_bytes"] == 48
    # the earlier run's files are gone, not left beside this run's one; other files stay
    assert sorted(os.listdir(out)) == [".layoutlang-manifest.json", "README", "rank00002.safetensors"]
    assert written_bytes(out / "rank00002.safetensors") == {"a.weight": a, "b.weight": b}  # NaN bits moved


def earlier_run(out: Path) -> dict[str, bytes]:
    """A folder as a layoutlang run leaves it: a rank file and the manifest recording it."""
    out.mkdir()
    written = write_safetensors(out / "rank00002.safetensors", {"a.weight": torch.zeros(2)})
    write_manifest(out, [written])
    return {name: (out / name).read_bytes() for name in os.listdir(out)}


@pytest.mark.parametrize("what", ["foreign-model", "changed-rank-file", "rank-file-now-a-link", "forged-manifest"])
def test_overwrite_refuses_files_layoutlang_did_not_write_and_removes_nothing(
    tmp_path: Path, program: Path, what: str
) -> None:
    nan_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    earlier_run(out)
    if what == "foreign-model":
        (out / "model.safetensors").write_bytes(b"the user's own checkpoint")
        name, why = "model.safetensors", "is not in the folder's .layoutlang-manifest.json: layoutlang did not write it"
    elif what == "changed-rank-file":
        with open(out / "rank00002.safetensors", "r+b") as stream:
            stream.seek(-1, os.SEEK_END)
            stream.write(b"\x01")  # same size, other bytes
        name, why = "rank00002.safetensors", "its bytes differ from the SHA-256 in the manifest"
    elif what == "rank-file-now-a-link":
        (tmp_path / "precious.safetensors").write_bytes((out / "rank00002.safetensors").read_bytes())
        (out / "rank00002.safetensors").unlink()
        (out / "rank00002.safetensors").symlink_to(tmp_path / "precious.safetensors")
        name, why = "rank00002.safetensors", "is not the regular file layoutlang wrote"
    else:  # a manifest that claims a file it did not write is a manifest's to check: not JSON of ours
        (out / ".layoutlang-manifest.json").write_text('{"files": {"model.safetensors": 1}}', encoding="utf-8")
        name, why = ".layoutlang-manifest.json", "not a layoutlang manifest"
    before = {entry: (out / entry).read_bytes() for entry in os.listdir(out)}
    result = run("apply", str(program), "--from", "ckpt", "--to", "out", "--overwrite", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and name in result.stderr and why in result.stderr
    assert {entry: (out / entry).read_bytes() for entry in os.listdir(out)} == before  # nothing removed
    if what == "rank-file-now-a-link":
        assert (tmp_path / "precious.safetensors").exists()


def test_the_manifest_records_what_write_safetensors_wrote_and_a_full_disk_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write_safetensors(tmp_path / "rank00003.safetensors", {"w": torch.arange(4.0)})
    data = (tmp_path / "rank00003.safetensors").read_bytes()
    assert written == WrittenFile("rank00003.safetensors", len(data), hashlib.sha256(data).hexdigest())
    write_manifest(tmp_path, [written])
    assert read_manifest(tmp_path) == {"rank00003.safetensors": written}
    assert why_not_removable(tmp_path, "rank00003.safetensors", written) is None

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(RuntimeFailure) as error:
        write_manifest(tmp_path, [written])
    monkeypatch.undo()
    assert "No space left on device" in error.value.message
    assert "a later --overwrite refuses them" in error.value.message
    assert sorted(os.listdir(tmp_path)) == [".layoutlang-manifest.json", "rank00003.safetensors"]  # no temporary left


def test_overwrite_checks_the_room_before_removing_the_earlier_output(tmp_path: Path, program: Path) -> None:
    nan_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    before = earlier_run(out)  # a smaller file than this run writes: removing it does not make room
    # The launcher script makes the disk report no free room to the launching process.
    script = tmp_path / "no_room.py"
    script.write_text(
        textwrap.dedent(
            """
            import shutil, sys
            real_disk_usage = shutil.disk_usage
            shutil.disk_usage = lambda path: real_disk_usage(path)._replace(free=0)
            if __name__ == "__main__":
                from layoutlang.cli.main import main
                sys.exit(main(sys.argv[1:]))
            """
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, str(script), "apply", str(program), "--from", "ckpt", "--to", "out", "--overwrite"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "--to out: this run writes" in result.stderr
    assert "but the disk has 0 B free" in result.stderr and "nothing was removed or written" in result.stderr
    assert {entry: (out / entry).read_bytes() for entry in os.listdir(out)} == before  # the good output stays


def test_apply_refuses_bad_headers_and_escaping_indexes_before_any_worker(tmp_path: Path, program: Path) -> None:
    (tmp_path / "overlap").mkdir()
    header = {"a.weight": entry("F32", [4, 2], 0), "b.weight": entry("F32", [4], 16)}
    (tmp_path / "overlap" / "model.safetensors").write_bytes(encode(header, bytes(32)))
    result = run("apply", str(program), "--from", "overlap", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT and "Traceback" not in result.stderr
    assert "overlap" in result.stderr and "'a.weight'" in result.stderr
    nan_checkpoint(tmp_path / "ckpt")
    (tmp_path / "escape").mkdir()
    write_index(tmp_path / "escape", {"a.weight": "../ckpt/model.safetensors", "b.weight": "../ckpt/model.safetensors"})
    result = run("apply", str(program), "--from", "escape", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT and "Traceback" not in result.stderr
    assert "'../ckpt/model.safetensors'" in result.stderr and "--allow-outside-paths" in result.stderr
    # the language's import reads headers through the same checks
    (tmp_path / "import.layout").write_text('tensors from safetensors "escape"\n', encoding="utf-8")
    result = run("check", "import.layout", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT and "Traceback" not in result.stderr
    assert "inside its folder" in result.stderr


@pytest.mark.parametrize("where", ["file-in-place", "parent-is-a-file", "read-only", "the-from-folder"])
def test_apply_refuses_a_to_folder_it_cannot_use_before_any_worker(tmp_path: Path, program: Path, where: str) -> None:
    nan_checkpoint(tmp_path / "ckpt")
    if where == "file-in-place":
        (tmp_path / "out").write_text("a file", encoding="utf-8")
        to, fragment = "out", "is a file, not a folder"
    elif where == "parent-is-a-file":
        (tmp_path / "out").write_text("a file", encoding="utf-8")
        to, fragment = "out/sub", "cannot create the folder"
    elif where == "read-only":
        if os.geteuid() == 0:
            # root writes through permission bits: use sysfs, which refuses even root
            to, fragment = "/sys/layoutlang-test-out", "cannot create the folder"
        else:
            (tmp_path / "out").mkdir(mode=0o555)
            to, fragment = "out", "cannot write into the folder"
    else:
        to, fragment = "ckpt", "is the folder of the --from checkpoint"
    result = run("apply", str(program), "--from", "ckpt", "--to", to, "--overwrite", cwd=tmp_path)
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and f"--to {to}" in result.stderr and fragment in result.stderr
    assert (tmp_path / "ckpt" / "model.safetensors").exists()  # --overwrite never removes the source


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--overwrite"], "--overwrite replaces the files of a --to folder; give --to DIR"),
        (["--allow-outside-paths"], "--allow-outside-paths is about the index of a --from checkpoint"),
        (["--elastic", "--to", "out", "--overwrite"], "it does not take --to, --overwrite"),
    ],
)
def test_the_switches_need_their_folder(
    program: Path, flags: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from layoutlang.cli import main

    assert main(["apply", str(program), *flags]) == ExitCode.BAD_INPUT  # in-process: refused before any worker
    assert fragment in capsys.readouterr().err


def test_a_disk_full_while_a_worker_writes_exits_1_and_leaves_no_partial_file(tmp_path: Path, program: Path) -> None:
    nan_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    # The launcher script patches os.write at import; spawned workers import it again (as
    # __mp_main__), so each worker's writes into `out` find the disk full after 100 bytes.
    script = tmp_path / "full_disk.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import errno, os, sys
            OUT, real_write = {str(out)!r}, os.write
            def write(fd, data):
                try:
                    target = os.readlink(f"/proc/self/fd/{{fd}}")
                except OSError:
                    target = ""
                if target.startswith(OUT + os.sep) and len(data) > 100:
                    real_write(fd, bytes(memoryview(data)[:100]))
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(fd, data)
            os.write = write
            if __name__ == "__main__":
                from layoutlang.cli.main import main
                sys.exit(main(sys.argv[1:]))
            """
        ),
        encoding="utf-8",
    )
    result = subprocess.run(
        [sys.executable, str(script), "apply", str(program), "--from", "ckpt", "--to", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == ExitCode.FAILURE, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "No space left on device" in result.stderr
    assert str(out / "rank00002.safetensors") in result.stderr
    assert os.listdir(out) == []  # neither the file nor its temporary
