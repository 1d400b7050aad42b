"""Right-to-left orders (``(tp, dp) = shard(d)``) against torch's two computations of them.

torch has two answers for "tp cuts the dim first, then dp cuts each tp piece" (FSDP2 over TP):

- what FSDP2 holds: ``fully_shard`` chunks each TP shard (``Shard(d)``, ``torch.chunk``) with
  ``_chunk_with_empty`` over dp (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
  ``_init_sharded_param``);
- what DTensor computes from the placements FSDP2 writes for it,
  ``[_StridedShard(d, split_factor=|tp|), Shard(d)]`` applied in mesh order
  (``_StridedShard._split_tensor``, ``_compute_local_shape_and_global_offset``, and
  ``distribute_tensor`` under ``LocalTensorMode``).

On most sizes the two are the same rows; on some uneven ones they differ (7 over dp = 3,
tp = 2: rank 4 holds row 6 for DTensor and nothing in FSDP2's chunks). layoutlang must equal
both where they agree and refuse exactly where they do not. Every expectation here is computed
by torch's own functions, never by layoutlang.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
from torch.distributed.tensor import Shard as DShard
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import layoutlang

pytestmark = pytest.mark.timeout(300)


def _layout(dp: int, tp: int, rows: int, rule: str = "(tp, dp) = shard(0)") -> layoutlang.model.Layout:
    text = f'mesh m [dp = {dp}, tp = {tp}]\ntensor "w" [{rows}, 2] fp32\nlayout l on m {{ "w": {rule} }}\n'
    return layoutlang.loads(text).layouts["l"]


def _rows_of(layout, rank: int) -> list[int]:
    """The rows of w a rank holds, in the order of its local tensor."""
    boxes = sorted(layout.boxes("w", rank), key=lambda b: b.storage_offsets[0])
    return [r for b in boxes for r in range(b.offsets[0], b.offsets[0] + b.sizes[0])]


def fsdp2_rows(rows: int, dp: int, tp: int, d: int, t: int) -> list[int]:
    """FSDP2 over TP: the TP shard (DTensor's Shard(0)), chunked over dp as fully_shard does."""
    tp_shards, _ = DShard(0)._split_tensor(torch.arange(rows), tp, with_padding=False, contiguous=True)
    return _chunk_with_empty(tp_shards[t], dp, dim=0)[d].tolist()


def dtensor_rows(rows: int, dp: int, tp: int, d: int, t: int) -> list[int]:
    """DTensor's [_StridedShard(0, sf=tp), Shard(0)] on (dp, tp), cut in mesh order by torch's classes."""
    local, _ = _StridedShard(0, split_factor=tp)._split_tensor(torch.arange(rows), dp, with_padding=False)
    out, _ = DShard(0)._split_tensor(local[d], tp, with_padding=False, contiguous=True)
    shape, offset = _compute_local_shape_and_global_offset(
        (rows,), (dp, tp), [d, t], [_StridedShard(0, split_factor=tp), DShard(0)]
    )
    assert shape == (len(out[t]),)  # torch's two functions agree with each other
    if len(out[t]):
        assert offset == (int(out[t][0]),)
    return out[t].tolist()


MESHES = [(dp, tp) for dp in range(1, 5) for tp in range(1, 5)]


@pytest.mark.parametrize("dp, tp", MESHES, ids=[f"dp{d}-tp{t}" for d, t in MESHES])
def test_order_equals_torch_or_is_refused_exactly_where_torch_disagrees_with_itself(dp: int, tp: int):
    """Every size up to 4 * dp * tp + 3: the boxes are FSDP2's and DTensor's rows, or a LayoutValueError."""
    refused = 0
    for rows in range(4 * dp * tp + 4):
        fsdp2 = {(d, t): fsdp2_rows(rows, dp, tp, d, t) for d in range(dp) for t in range(tp)}
        dtensor = {(d, t): dtensor_rows(rows, dp, tp, d, t) for d in range(dp) for t in range(tp)}
        if fsdp2 != dtensor:
            refused += 1
            with pytest.raises(layoutlang.LayoutValueError, match=r"ambiguous for size") as err:
                _layout(dp, tp, rows).boxes("w", 0)
            first = next(k for k in itertools.product(range(dp), range(tp)) if fsdp2[k] != dtensor[k])
            assert f"rank {first[0] * tp + first[1]} (dp={first[0]}, tp={first[1]})" in str(err.value)
            continue
        layout = _layout(dp, tp, rows)
        for d, t in itertools.product(range(dp), range(tp)):
            assert _rows_of(layout, d * tp + t) == dtensor[(d, t)], (rows, d, t)
        if rows % (dp * tp) == 0:
            assert fsdp2 == dtensor  # the documented sufficient condition
    # Refusals happen only when both axes cut (and not on every mesh even then).
    if dp == 1 or tp == 1:
        assert refused == 0


def test_7_rows_over_dp3_tp2_is_refused_at_its_line_naming_rank_4_and_the_dtensor_spelling():
    with pytest.raises(layoutlang.LayoutValueError) as err:
        _layout(3, 2, 7).boxes("w", 0)
    text = str(err.value)
    assert ":3:17:" in text  # the rule's place in the file
    assert "cutting tp then dp gives rank 4 (dp=2, tp=0) no index" in text
    assert "dp: _StridedShard(0, split_factor=2), tp: Shard(0)) gives index 6" in text
    assert "dp = shard(0, blocks = 2), tp = shard(0)" in text


@functools.cache
def _device_mesh(dp: int, tp: int) -> DeviceMesh:
    with LocalTensorMode(frozenset(range(dp * tp))):
        return DeviceMesh("cpu", torch.arange(dp * tp).view(dp, tp), _init_backend=False, _rank=0)


def _distribute(rows: int, dp: int, tp: int, placements: Sequence) -> dict[int, list[int]]:
    with LocalTensorMode(frozenset(range(dp * tp))):
        dtensor = distribute_tensor(torch.arange(rows), _device_mesh(dp, tp), list(placements), src_data_rank=None)
        return {r: t.tolist() for r, t in dtensor._local_tensor._local_tensors.items()}


@pytest.mark.parametrize("dp, tp, rows", [(3, 2, 7), (4, 2, 9), (4, 3, 14), (3, 2, 12), (2, 4, 11)])
def test_the_hinted_spelling_is_dtensor_on_every_rank(dp: int, tp: int, rows: int):
    """'dp = shard(0, blocks = tp), tp = shard(0)' is distribute_tensor's [_StridedShard, Shard] on any size."""
    real = _distribute(rows, dp, tp, [_StridedShard(0, split_factor=tp), DShard(0)])
    layout = _layout(dp, tp, rows, f"dp = shard(0, blocks = {tp}), tp = shard(0)")
    assert {r: _rows_of(layout, r) for r in range(dp * tp)} == real


THREE_AXES = [(2, 2, 2), (2, 3, 2), (3, 2, 2)]


@pytest.mark.parametrize("sizes", THREE_AXES, ids=["x".join(map(str, s)) for s in THREE_AXES])
def test_three_axes_in_reverse_order_equal_dtensor_or_are_refused(sizes: tuple[int, int, int]):
    """(c, b, a) = shard(0) on [a, b, c]: DTensor's [_SS(sf=|b||c|), _SS(sf=|c|), S] vs c, b, a nesting."""
    a, b, c = sizes
    text_rule = "(c, b, a) = shard(0)"
    placements = [_StridedShard(0, split_factor=b * c), _StridedShard(0, split_factor=c), DShard(0)]
    for rows in range(2 * math.prod(sizes) + 3):
        nested: dict[int, list[int]] = {}
        strided: dict[int, list[int]] = {}
        for rank, coords in enumerate(itertools.product(range(a), range(b), range(c))):
            local = torch.arange(rows)
            for axis in (2, 1, 0):
                local = _chunk_with_empty(local, sizes[axis], dim=0)[coords[axis]]
            nested[rank] = local.tolist()
            local = torch.arange(rows)
            for axis, p in enumerate(placements):
                local = p._split_tensor(local, sizes[axis], with_padding=False)[0][coords[axis]]
            strided[rank] = local.tolist()
        text = f'mesh m [a = {a}, b = {b}, c = {c}]\ntensor "w" [{rows}] fp32\nlayout l on m {{ "w": {text_rule} }}\n'
        layout = layoutlang.loads(text).layouts["l"]
        if nested != strided:
            with pytest.raises(layoutlang.LayoutValueError, match="ambiguous"):
                layout.boxes("w", 0)
            continue
        for rank in range(math.prod(sizes)):
            boxes = sorted(layout.boxes("w", rank), key=lambda box: box.storage_offsets[0])
            assert [i for box in boxes for i in range(box.offsets[0], box.offsets[0] + box.sizes[0])] == strided[rank]
