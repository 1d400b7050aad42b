"""Delta refits over multi-process gloo (layoutlang/runtime/delta.py): at every density of
changed elements, NaN payloads and signed zeros included, each destination is bit-identical
to a dense refit of the same weights into fresh storages, and the wire never carries more
than 1.01x the dense bytes; a storage written by someone else since, or handed anew, is
found and received dense."""

from __future__ import annotations

import delta_jobs
import pytest
from test_execute import EXAMPLES, PAIRS, participants_of
from test_fp8_refit import LARGE as FP8_LARGE
from test_fp8_refit import TP as FP8

from layoutlang.cli.launch import WorkerError
from layoutlang.errors import LayoutValueError
from layoutlang.runtime import DeltaOptions
from layoutlang.runtime.delta import delta_options

DENSITIES = (0.0, 1e-4, 1e-2, 0.1, 0.5, 1.0)

# the session's pool of test_execute.py (as many workers as its largest example has ranks)
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.workers(max(len(participants_of(EXAMPLES / f"{name}.layout")) for name in PAIRS)),
]


# Column shards of column shards: every region a training rank sends ("up": 2 MiB, a transfer
# of its own; "down": one small region per peer) is rows of its storage, which the encoder
# reads where they lie instead of packing them first. (The examples above pack theirs.)
STRIDED = """
mesh train [tp = 2] on ranks 0..1
mesh infer [tp = 4] on ranks 2..5
tensor "up" [1024, 2048] fp32
tensor "down" [1024, 384] bf16
layout train on train {
  "up": tp = shard(1)
  "down": tp = shard(0)
}
layout serve on infer {
  "up": tp = shard(1)
  "down": tp = shard(1)
}
reshard refit: train -> serve
"""


@pytest.mark.parametrize("name", ["refit", "moe_ep", "fp8", "fp8_large", "strided"])
def test_deltas_at_every_density_are_bit_identical_to_a_dense_refit(pool, name, capsys, tmp_path):
    """The refit example (fused storages, domains: relays), the MoE example (stacked experts),
    an FP8 destination (block, per-channel and MXFP8 scales: values and scales patched), one
    whose large regions travel as their values, then their scales (values landing in place)
    and regions sent from rows of a larger source storage (read where they lie)."""
    path = EXAMPLES / f"{name}.layout"
    texts = {"fp8": FP8, "fp8_large": FP8_LARGE, "strided": STRIDED}
    if name in texts:
        path = tmp_path / f"{name}.layout"
        path.write_text(texts[name])
    participants = participants_of(path)
    results = [r for r in pool.run(delta_jobs.delta_refits, str(path), participants, DENSITIES) if r]
    assert len(results) == len(participants)
    for steps in results:
        assert all(step["identical"] for step in steps), [(s["rank"], s["density"]) for s in steps]
    first, *later = zip(*results)  # by step, every rank's figures
    assert sum(r["wire_bytes"] for r in first) >= sum(r["dense_bytes"] for r in first)  # no base yet: dense
    with capsys.disabled():
        print(f"\n{name}: density, wire bytes / dense bytes (all ranks)")
    for density, step in zip(DENSITIES, later):
        dense = sum(r["dense_bytes"] for r in step)
        wire = sum(r["wire_bytes"] for r in step)
        assert dense > 0 and wire <= 1.01 * dense, (density, wire, dense)
        with capsys.disabled():
            print(f"  {density:<7g} {wire:>10,} / {dense:>10,} = {wire / dense:.4f}")
        if density == 0.0:
            assert wire < dense / 100, (density, wire, dense)  # headers only
        if density <= 1e-2 and not name.startswith("fp8"):
            # (in fp8, a changed element that moves its block's scale changes the whole block:
            # a third of the changes here are NaNs, which always do)
            assert wire < dense / 5, (density, wire, dense)
        assert all(not r["stale"] for r in step)
    assert all(r["kept_bytes"] > 0 for r in first if r["dense_bytes"])  # what a sender keeps is counted
    if name == "strided":  # every region was encoded where it lies, not packed
        program_bytes = 1024 * 2048 * 4 + 1024 * 384 * 2
        assert sum(r["read_in_place"] for step in later for r in step) == len(later) * program_bytes


def test_digest_only_senders_send_changed_blocks_whole_and_stay_bit_identical(pool, capsys):
    """Senders that keep only a digest per 4 KiB block: every density bit-identical to a dense
    refit, the changed blocks sent whole (more bytes than a copy-keeping sender's deltas, never
    more than dense), and a digest of 8 bytes kept per block instead of a copy."""
    path = EXAMPLES / "refit.layout"
    participants = participants_of(path)
    results = [r for r in pool.run(delta_jobs.delta_refits, str(path), participants, DENSITIES, keep="digests") if r]
    for steps in results:
        assert all(step["identical"] for step in steps), [(s["rank"], s["density"]) for s in steps]
    first, *later = zip(*results)
    with capsys.disabled():
        print("\nrefit, digest-only senders: density, wire bytes / dense bytes (all ranks)")
    for density, step in zip(DENSITIES, later):
        dense = sum(r["dense_bytes"] for r in step)
        wire = sum(r["wire_bytes"] for r in step)
        with capsys.disabled():
            print(f"  {density:<7g} {wire:>10,} / {dense:>10,} = {wire / dense:.4f}")
        assert wire <= 1.01 * dense, (density, wire, dense)
        if density == 0.0:
            assert wire < dense / 100, (wire, dense)  # headers and bitmasks only
        if density == 1e-4:
            assert wire < dense / 2, (wire, dense)  # most blocks unchanged
    sent = sum(r["dense_bytes"] for r in first)
    kept = sum(r["kept_bytes"] for r in first)
    assert 0 < kept <= sent / 4096 * 8 + 8 * 64, (kept, sent)  # 8 bytes per block sent


def test_a_budget_keeps_copies_up_to_it_and_digests_past_it_in_files_of_a_directory(pool, tmp_path):
    """``DeltaOptions(budget=..., place=dir)``: each sender keeps copies of its first messages
    up to the budget, in memory-mapped files of the directory (deleted as made: it is left
    empty), and digests of the rest (their changed blocks travel whole); bit-identical at
    every density, and never above 1.01x dense."""
    path = EXAMPLES / "refit.layout"
    participants = participants_of(path)
    budget = 512 * 1024
    options = DeltaOptions(budget=budget, place=str(tmp_path))
    results = [r for r in pool.run(delta_jobs.delta_refits, str(path), participants, DENSITIES, keep=options) if r]
    for steps in results:
        assert all(step["identical"] for step in steps), [(s["rank"], s["density"]) for s in steps]
    first, *later = zip(*results)
    senders = [r for r in first if r["dense_bytes"]]
    for sender in senders:  # copies within the budget, and 8 bytes per 4 KiB block past it
        assert sender["kept_bytes"] <= budget + sender["dense_bytes"] / 4096 * 8 + 8 * 64, sender
    for density, step in zip(DENSITIES, later):
        encodings = {k for r in step for k, v in r["messages"].items() if v}
        dense = sum(r["dense_bytes"] for r in step)
        assert sum(r["wire_bytes"] for r in step) <= 1.01 * dense, density
        if density == 1e-4:  # both kinds of senders' messages, side by side
            assert {"indices", "blocks"} <= encodings, encodings
    assert list(tmp_path.iterdir()) == []


def test_delta_options_refuse_what_they_cannot_do(tmp_path):
    with pytest.raises(LayoutValueError, match="keep copies or digests of what they send, not 'all'"):
        DeltaOptions(keep="all")
    with pytest.raises(LayoutValueError, match="a number of bytes \\(0 or more\\), not -1"):
        DeltaOptions(budget=-1)
    with pytest.raises(LayoutValueError, match="in 'host' memory or in an existing directory"):
        DeltaOptions(place=str(tmp_path / "missing"))
    with pytest.raises(LayoutValueError, match=r"delta=1\.5: a run is dense"):
        delta_options(1.5)  # type: ignore[arg-type]
    assert delta_options(False) is None
    assert delta_options(True) == DeltaOptions() == delta_options("copies")
    assert delta_options("digests") == DeltaOptions(keep="digests")


def test_a_storage_written_since_or_handed_anew_is_received_dense_and_right(pool):
    path = EXAMPLES / "refit.layout"
    participants = participants_of(path)
    victim = 5
    results = {r[0]["rank"]: r for r in pool.run(delta_jobs.delta_after_tampering, str(path), participants, victim)
               if r}
    for steps in results.values():
        assert all(step["identical"] for step in steps)
    third = {rank: steps[2] for rank, steps in results.items()}
    assert third[victim]["stale"], "the overwritten storages are found"
    fresh = next(rank for rank, step in third.items() if step["fresh"])
    assert third[fresh]["stale"], "storages handed as new tensors hold no version"
    assert all(not step["stale"] for rank, step in third.items() if rank not in (victim, fresh))
    # nothing changed for the others: the refit moved headers, far from dense
    wire = sum(s["wire_bytes"] for s in third.values())
    dense = sum(s["dense_bytes"] for s in third.values())
    assert wire < dense


def test_ranks_that_disagree_on_deltas_stop_before_a_byte_moves(pool):
    path = EXAMPLES / "tp_to_dp.layout"
    participants = participants_of(path)
    with pytest.raises(WorkerError, match=r"compiled a different plan.*options on different ranks"):
        pool.run(delta_jobs.delta_on_some_ranks, str(path), participants, [participants[0]])

