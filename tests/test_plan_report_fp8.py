"""`layoutlang plan`'s text report of an FP8 refit: the bytes on the wire (fp8 values and
scales where the sender quantizes whole blocks) beside the logical bytes. The expected figures
are counted here by hand from the shapes: a [256, 256] bf16 weight sent whole from rank 0 to
two TP ranks that store it as 128 x 128 block FP8 (each receives 128 rows: two blocks, 128 x
256 fp8 bytes and two fp32 scales), beside a [64] bf16 tensor replicated in bf16."""

from __future__ import annotations

import re

import pytest

from layoutlang._text import human_bytes
from layoutlang.cli import ExitCode, main

pytestmark = pytest.mark.timeout(60)

TEXT = """
topology { domain_size = 1 }
mesh train [tp = 1]
mesh infer [tp = 2] on ranks 1..2
tensor "w" [256, 256] bf16
tensor "n" [64] bf16
layout train on train {
  default: replicate
}
layout serve on infer {
  default: replicate
  "w": tp = shard(0)
  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32
}
reshard refit: train -> serve
"""


def test_plan_report_prints_wire_bytes_beside_logical_bytes(tmp_path, capsys):
    path = tmp_path / "fp8.layout"
    path.write_text(TEXT)
    assert main(["plan", str(path)]) == ExitCode.OK
    out = capsys.readouterr().out
    logical = 256 * 256 * 2 + 2 * 64 * 2  # bf16 weight + the small tensor on both ranks
    wire = 256 * 256 * 1 + 2 * 2 * 4 + 2 * 64 * 2  # fp8 values + 2 fp32 scales per rank + the small tensor
    assert "quantized destination: 1 tensors stored quantized" in out
    row = next(line for line in out.splitlines() if line.startswith("network "))  # the quantized table's
    want = ["network", *human_bytes(logical).split(), *human_bytes(wire).split(), f"{wire / logical:.3f}"]
    assert row.split() == want
    moves = r"moves quantized by their sender: 2 \(4 blocks\); assembled and quantized on the destination: 0\n"
    assert re.search(moves, out)


def test_bf16_plan_report_has_no_quantized_section(tmp_path, capsys):
    path = tmp_path / "bf16.layout"
    path.write_text(TEXT.replace('  quantize "w" as fp8_e4m3 blocks 128 x 128 scale_inv fp32\n', ""))
    assert main(["plan", str(path)]) == ExitCode.OK
    assert "quantized destination" not in capsys.readouterr().out
