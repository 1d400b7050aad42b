"""``layoutlang simulate``: a refit's estimated time on a cluster, for each policy, against a lower bound."""

from __future__ import annotations

import argparse
import math

import attrs

from .._text import human_bytes, human_time, rate, table
from ..errors import LayoutError
from ..lang import load
from ..model import Program
from ..model.topology import FALLBACK_PRESET, TOPOLOGY_PRESETS
from ..plan import plan_layouts
from ..plan.data import PLAN_MODES
from ..plan.simulate import Simulation, estimate, simulate
from . import arguments
from .json_output import emit
from .plan import check_plan_size

__all__ = ["add_arguments", "run", "simulation_report"]


def simulation_report(sim: Simulation) -> list[str]:
    """The table ``layoutlang simulate`` prints."""

    t = sim.topology
    lines = [
        (
            f"simulate {sim.reshard}: {sim.source} ({sim.source_ranks} ranks) -> "
            f"{sim.destination} ({sim.destination_ranks} ranks)"
        ),
        f"  topology {t.name or '(anonymous)'}: "
        + (f"domains of {t.domain_size} ranks" if t.domain_size > 1 else "every rank its own domain")
        + "; per rank and direction NVLink "
        f"{rate(t.domain_bandwidth)}, network {rate(t.network_bandwidth)}, local copy {rate(t.copy_bandwidth)}; "
        f"latency {human_time(t.domain_latency)} NVLink, {human_time(t.network_latency)} network",
    ]
    if sim.assumed:
        lines.append(f"  not given by the topology, taken from {FALLBACK_PRESET}: {', '.join(sim.assumed)}")
    lines.append(f"  buckets of {human_bytes(sim.bucket_bytes)}; phase p of bucket k runs in step k + p")
    if any(e.policy == PAIRWISE_ROW for e in sim.estimates):
        # what the model does not capture of a pairwise plan: said where its estimate is read
        lines.append(
            f"  {PAIRWISE_ROW}: stage-major, as the executor runs it: every bucket's network moves, then "
            "the relays (phase p of bucket k in step p x buckets + k); its buckets are cut per pair of ranks"
        )
    lines.append("")
    sequential = any(e.sequential_time is not None for e in sim.estimates)
    rows = []
    for e in sim.estimates:
        bound_by = e.bound_by
        bound = max(bound_by, key=lambda port: bound_by[port]) if e.time else "-"
        share = f" {100 * bound_by[bound] / e.time:.0f}%" if e.time else ""
        # a simulation estimates every plan unpipelined or none ("-" if one was left out)
        unpipelined = human_time(e.sequential_time) if e.sequential_time is not None else "-"
        rows.append(
            [e.policy, human_time(e.time), f"{sim.ratio(e):.2f}x", f"{sim.port_ratio(e):.2f}x"]
            + ([unpipelined] if sequential else [])
            + [
                human_bytes(e.bytes["network"]),
                human_bytes(e.bytes["domain"]),
                human_bytes(e.bytes["local"]),
                f"{e.messages['network'] + e.messages['domain']:,}",
                f"{e.steps:,}",
                f"{bound}{share}",
            ]
        )
    rows.append(
        ["lower bound", human_time(sim.bound.time), "1.00x", ""] + [""] * (6 if sequential else 5) + [sim.bound.binding]
    )
    header = ["policy", "time", "/ bound", "/ port"] + (["unpipelined"] if sequential else [])
    header += ["network", "NVLink", "local", "messages", "steps", "bound by"]
    lines += table(rows, header, right=set(range(1, len(header) - 1)))
    lines.append("")
    lines.append(f"lower bound: {sim.bound.describe(t)}")
    lines.append("busiest port over the whole refit (the time if no step waited for another port; '/ port' above):")
    for e in sim.estimates:
        port, rank, seconds = e.busiest_port
        ratio = seconds / sim.bound.time if sim.bound.time else math.inf
        lines.append(f"  {e.policy}: {human_time(seconds)} ({ratio:.2f}x the bound), the {port} port of rank {rank}")
    by_policy = {e.policy: e for e in sim.estimates}
    if "reshard" in by_policy and "gather-and-broadcast" in by_policy:
        r, b = by_policy["reshard"], by_policy["gather-and-broadcast"]
        lines.append(_comparison(b.time / r.time if r.time else math.inf, quantized=sim.unquantized is not None))
    if sim.unquantized is not None and "reshard" in by_policy:
        r, u = by_policy["reshard"], sim.unquantized
        lines.append(
            f"quantized destination: the reshard moves {human_bytes(r.bytes['network'])} on the network as it travels "
            f"(quantized values and scales) against {human_bytes(u.bytes['network'])} unquantized: "
            f"{human_time(r.time)} against {human_time(u.time)} ({sim.quantized_ratio():.2f}x)"
        )
    return lines


#: the row of the whole pairwise plan (``--mode pairwise``)
PAIRWISE_ROW = "pairwise reshard"


def with_pairwise(sim: Simulation, program: Program, reshard: str | None, sequential: bool) -> Simulation:
    """``sim`` with the estimate of the whole pairwise plan (every tensor resharded, as a
    per-rank plan moves them) after the reshard row: the same topology, domains, buckets and
    lower bound as the fleet plans beside it."""
    statement = program.reshard(reshard)
    try:
        plan = plan_layouts(
            program.layout(statement.source),
            program.layout(statement.destination),
            name=statement.name,
            domain_size=sim.topology.domain_size,
            bucket_bytes=sim.bucket_bytes,
            policies="reshard",
            mode="pairwise",
        )
    except LayoutError as err:
        raise err.with_span(statement.span) from None
    row = estimate(plan, sim.topology, PAIRWISE_ROW, sequential=sequential)
    return attrs.evolve(sim, estimates=(*sim.estimates[:1], row, *sim.estimates[1:]))


# ------------------------------------------------------------------------------ CLI

HELP = "estimate a refit's time on a cluster, for each policy, against a lower bound"
DESCRIPTION = (
    "Compile the plan of a reshard statement with every tensor resharded, with every tensor gathered "
    "and broadcast, and with the statement's own policies (when it gives any); estimate the time of each "
    "on the program's topology (or a preset) with a latency + bandwidth model of every rank's NIC, NVLink "
    "and copy ports, and compare it with a lower bound that no plan can beat."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``layoutlang simulate``."""
    arguments.add_file(parser)
    arguments.add_reshard(parser)
    parser.add_argument(
        "--topology",
        metavar="NAME",
        help=f"a topology preset replacing the program's ({', '.join(TOPOLOGY_PRESETS)})",
    )
    arguments.add_bucket_size(parser)
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="also estimate every plan with its phases and buckets one after the other (no pipelining)",
    )
    parser.add_argument(
        "--mode",
        choices=PLAN_MODES,
        default="fleet",
        help="fleet (the default: the whole fleet's plans) or pairwise: also estimate the whole pairwise plan, "
        "the plan per-rank plans are the parts of, as the row 'pairwise reshard'",
    )
    parser.add_argument("--json", action="store_true", help="print the estimates as JSON (times in seconds)")


def run(args: argparse.Namespace) -> int:
    """``layoutlang simulate``: 0 on success; a LayoutError propagates to the CLI."""

    program = load(args.file, allow_outside_includes=args.allow_outside_includes)
    check_plan_size(program, args.reshard)  # it compiles the reshard's plans
    sim = simulate(
        program, args.reshard, topology=args.topology, bucket_bytes=args.bucket_size, sequential=args.sequential
    )
    if args.mode == "pairwise":
        sim = with_pairwise(sim, program, args.reshard, args.sequential)
    if args.json:
        return emit("simulate", sim.to_json())
    else:
        print("\n".join(simulation_report(sim)))
    return 0


def _comparison(speedup: float, *, quantized: bool) -> str:
    """The reshard against gather-and-broadcast, in words that read right both ways."""
    # where the destination quantizes, the executor refuses that baseline: it broadcasts bf16
    baseline = "gather-and-broadcast" + (" of bf16 (it cannot refit the quantized tensors)" if quantized else "")
    if speedup >= 1.05:
        return f"reshard is {speedup:.1f}x faster than {baseline}"
    if speedup <= 1 / 1.05:
        return f"reshard is {1 / speedup:.1f}x slower than {baseline}"
    return f"reshard takes about as long as {baseline}"
