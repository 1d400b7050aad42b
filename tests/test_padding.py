"""Padding rows of padded storages (``shard(d, pad = m)``: vLLM's vocab-parallel embedding and
lm_head) are zero on every destination rank after a refit, also when the engine's buffers held
NaN or random bytes before it (and again after it scribbled into them between refits).

The expected rows are vLLM's rule, written here: the vocabulary is padded to a multiple of 64
and split evenly, rank r holds rows ``[r * per, r * per + per)`` of the padded vocabulary, and
the rows past the real vocabulary are padding. Runs on gloo, 6 workers.
"""

from __future__ import annotations

import padding_jobs as jobs
import pytest
import torch

pytestmark = [pytest.mark.workers(6), pytest.mark.timeout(180)]


@pytest.mark.parametrize("kind", ["nan", "random"])
def test_padding_is_zero_in_engine_buffers_full_of_garbage(pool, kind):
    results = pool.run(jobs.padded_refit_job, kind, 2)
    full = jobs.full_tensors()
    assert results[: jobs.TRAIN] == [{}] * jobs.TRAIN
    padding_rows = 0
    for position, got in enumerate(results[jobs.TRAIN :]):
        assert set(got) == set(full)
        for name, tensor in full.items():
            per = jobs.vocab_rows(tensor.shape[0])
            real = max(0, min(tensor.shape[0] - position * per, per))
            held = got[name]
            assert held.shape == (per, tensor.shape[1])
            # the real rows bit for bit, the padding all zero bits (not -0.0, not NaN)
            expected = tensor[position * per : position * per + real]
            assert torch.equal(held[:real].view(torch.int16), expected.view(torch.int16)), (position, name)
            assert torch.equal(held[real:].view(torch.int16), torch.zeros_like(held[real:].view(torch.int16))), (
                position,
                name,
            )
            padding_rows += per - real
    # 24 rows of padding for each 1000-row tensor (on the last rank), 54 of "small.weight",
    # whose ranks 1..3 hold nothing but padding
    assert padding_rows == 24 + 24 + 54
