"""What the command line prints: plan statistics, errors."""

from __future__ import annotations

import sys

from .._text import human_bytes, table
from ..errors import LayoutError, RuntimeFailure
from ..plan import KINDS, Plan, PlanStats

__all__ = ["plan_mode_line", "plan_report", "print_error"]


def print_error(err: LayoutError | RuntimeFailure) -> None:
    """An error on stderr: its text with place and caret (with ``--json``, errors are in the
    envelope of :mod:`.json_output` instead)."""
    print(err, file=sys.stderr)


def _ratio(a: float, b: float) -> str:
    if not b:
        return "1.000" if not a else "inf"
    return f"{a / b:.3f}"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _largest(pair: tuple[int, int]) -> str:
    nbytes, rank = pair
    return f"{human_bytes(nbytes)} (rank {rank})" if nbytes else "none"


def plan_mode_line(run: dict) -> str:
    """What ``apply`` says of the plans one policy ran: which mode (``plan_mode``: per-rank,
    fleet) and how many moves the ranks compiled (``plan_moves``: the most on one rank)."""
    moves = run["plan_moves"]
    if run["plan_mode"] == "per-rank":
        return (
            f"per-rank plans, each rank its own part of the pairwise plan (at most {moves:,} "
            f"move{'s' if moves != 1 else ''} on one rank)"
        )
    if run["plan_mode"] == "fleet":
        return f"the whole fleet's plan on every rank ({moves:,} move{'s' if moves != 1 else ''})"
    return f"{run['plan_mode']} plans ({moves:,} moves at most on one rank)"


def plan_report(plan: Plan, baseline: Plan | None = None, per_rank: bool = False) -> list[str]:
    """The statistics of a plan (and of the gather-and-broadcast baseline) as text lines."""
    stats: PlanStats = plan.stats
    src, dst = plan.source, plan.destination
    lines = [
        (
            f"plan {plan.name}: {src.name} on {src.mesh.name} ({_ranks(src.mesh.size)}) -> "
            f"{dst.name} on {dst.mesh.name} ({_ranks(dst.mesh.size)})"
        ),
        (
            f"  domains of {plan.domain_size} ranks, buckets of {human_bytes(plan.bucket_bytes)}, "
            f"fingerprint {plan.fingerprint[:16]}"
        ),
        "",
    ]
    plans = [("reshard" if set(plan.policies) == {"reshard"} else "this plan", stats)]
    if baseline is not None:
        plans.append(("gather-and-broadcast", baseline.stats))
    rows = []
    for label, s in plans:
        rows.append(
            [
                label,
                human_bytes(s.bytes["local"]),
                human_bytes(s.bytes["domain"]),
                human_bytes(s.bytes["network"]),
                human_bytes(s.moved),
                f"{sum(s.moves.values()):,}",
                f"{s.messages:,}",
                f"{s.buckets:,}",
            ]
        )
    lines += table(rows, ["plan", "local", "domain", "network", "moved", "moves", "messages", "buckets"])
    lines.append("")
    lines.append(
        f"lower bound (bytes destinations need and do not hold): {human_bytes(stats.lower_bound)}; "
        f"moved / lower bound = {_ratio(stats.moved, stats.lower_bound)}"
    )
    lines.append(
        f"largest network send per rank: {_largest(stats.largest_network_send)}; "
        f"largest network receive: {_largest(stats.largest_network_receive)}"
    )
    if baseline is not None:
        b = baseline.stats
        lines.append(
            f"gather-and-broadcast moves {_ratio(b.moved, stats.moved)}x the bytes "
            f"({_ratio(b.bytes['network'], stats.bytes['network'])}x over the network); "
            f"its logical payload (gathered + broadcast once) is {human_bytes(b.broadcast_payload)}"
        )
    if plan.quantization is not None:
        lines += ["", *quantized_report(plan)]
    if per_rank:
        lines.append("")
        rows = []
        for rank, v in stats.per_rank.items():
            rows.append(
                [str(rank)]
                + [human_bytes(v["sent"][k]) for k in KINDS[1:]]
                + [human_bytes(v["received"][k]) for k in KINDS[1:]]
                + [human_bytes(v["sent"]["local"])]
            )
        lines += table(
            rows,
            ["rank", "sent domain", "sent network", "recv domain", "recv network", "local copy"],
        )
    return lines


def quantized_report(plan: Plan) -> list[str]:
    """An FP8 refit's bytes on the wire beside the logical bytes of the statistics above (the
    tensors' own dtype): the regions quantized by their sender cross as fp8 values and
    scales, those assembled and quantized on the destination cross as bf16."""
    assert plan.quantization is not None
    totals = plan.quantization.totals(plan.arrays)
    logical, wire = totals["logical_bytes"], totals["wire_bytes"]
    rows = [
        [kind, human_bytes(logical[kind]), human_bytes(wire[kind]), _ratio(wire[kind], logical[kind])]
        for kind in KINDS
        if kind in logical
    ]
    at = totals["moves_quantized_at"]
    return [
        f"quantized destination: {totals['tensors']:,} tensors stored quantized; bytes before and after quantization",
        *table(rows, ["bytes", "logical", "on the wire", "wire / logical"]),
        (
            f"moves quantized by their sender: {at['source']:,} ({totals['blocks_quantized_by_senders']:,} blocks); "
            f"assembled and quantized on the destination: {at['destination']:,}"
        ),
        *([f"where: {plan.quantize_reason}"] if plan.quantize_reason else []),
    ]
