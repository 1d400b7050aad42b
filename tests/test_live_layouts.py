"""The training layout read from a state dict of DTensors, checked against DTensor itself.

``layout_from_state_dict`` writes the rules a state dict implies; the oracle is DTensor's own
``to_local()`` on 4 gloo ranks: on every rank, the elements that the derived layout's boxes
say the rank holds, taken from the whole tensor, must be the DTensor's local tensor exactly
(FSDP-style Shard(0), column and row parallel, FSDP2 over TP's ``_StridedShard``, a 2-D
mesh cutting two dims, nested cuts of one dim, uneven sizes, vLLM-style ``[gate | up]``
strided shards). Then hand-written layouts that differ are named tensor by tensor.
"""

from __future__ import annotations

import live_layout_jobs
import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.workers(4, scope="module")]


def test_the_derived_layout_holds_dtensors_local_elements_on_every_rank(pool):
    results = pool.run(live_layout_jobs.derived_layout)
    for rank, result in enumerate(results):
        assert result["agree"] == dict.fromkeys([*live_layout_jobs.TENSORS, "plain"], True), rank
        assert result["problems"] == [], rank
    text = results[0]["text"]
    assert text.startswith("mesh train [dp = 2, tp = 2] on ranks 0..3\n")
    assert '"fsdp_over_tp": (tp, dp) = shard(0)' in text
    assert '"gate_up": tp = shard(0, blocks = 2)' in text
    assert '"two_dims": dp = shard(0), tp = shard(1)' in text
    assert '"nested": (dp, tp) = shard(0)' in text


def test_a_layout_that_cuts_another_dim_is_named_tensor_by_tensor(pool):
    rules = '"q_proj": tp = shard(1)\n"o_proj": tp = shard(1)\ndefault: replicate'
    messages = pool.run(live_layout_jobs.mismatched, rules)
    for rank, message in enumerate(messages):
        assert isinstance(message, str) and f"rank {rank}'s state dict does not match layout 'train'" in message
        assert "tensor 'q_proj' on rank" in message and "the layout places [8, 3]" in message
        assert "tensor 'embed' on rank" in message  # FSDP's shard, declared replicated


def test_an_offset_dtensor_computes_differently_is_named(pool):
    # same local shapes, other rows: nested (tp, dp) where DTensor cut (dp, tp)
    rules = (
        '"nested": (tp, dp) = shard(0)\n"embed": dp = shard(0)\n"q_proj": tp = shard(0)\n"o_proj": tp = shard(1)\n'
        '"fsdp_over_tp": (tp, dp) = shard(0)\n"two_dims": dp = shard(0), tp = shard(1)\n"uneven": dp = shard(0)\n'
        '"gate_up": tp = shard(0, blocks = 2)\ndefault: replicate'
    )
    messages = pool.run(live_layout_jobs.mismatched, rules)
    for rank in (1, 2):
        assert "tensor 'nested' on rank" in messages[rank], rank
        assert "DTensor places this rank's shard at offset" in messages[rank], rank
        assert "(1 problem)" in messages[rank], rank
    assert messages[0] == [] and messages[3] == []  # the corners hold the same rows either way


def test_a_tensor_missing_from_the_state_dict_is_named_with_its_rank(pool):
    messages = pool.run(live_layout_jobs.mismatched, "default: replicate", "norm")
    assert all("tensor 'norm' is missing from rank" in m for m in messages)


def test_a_state_dict_that_does_not_match_stops_every_rank_in_its_words(pool):
    """run_state_dict: the engine ranks learn the trainer's problem (not "a peer may have
    died"), the misspelled key is named, nothing moves; the same call with right state dicts
    refits."""
    results = pool.run(live_layout_jobs.refit_from_state_dict, 1)
    for rank, result in enumerate(results):
        error = result["error"]
        assert error.startswith("AgreementError: rank 1 is not ready: rank 1's state dict does not match "
                                "layout 'fsdp' (2 problems)"), (rank, error)
        missing = "'model.embed.weight' is missing from rank 1's state dict (did you mean 'model.embed.weights'?)"
        assert f"tensor {missing}" in error, (rank, error)
    results = pool.run(live_layout_jobs.refit_from_state_dict, None)
    assert [r["error"] for r in results] == [None] * 4
    assert [r["right"] for r in results[2:]] == [{"model.embed.weight": True, "model.head.weight": True}] * 2
