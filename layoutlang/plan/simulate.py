"""A cost model over plans: how long would a refit take on a given cluster?

:func:`simulate` compiles the plan of a ``reshard`` statement three ways (reshard every
tensor, gather-and-broadcast every tensor, and the statement's own hybrid policies when it
has any), estimates the time of each on a topology, and compares them with a lower bound
that no plan can beat. Nothing runs on a GPU: the estimate is computed from the plan's
arrays. This module is the model only; ``layoutlang simulate FILE`` and the table it prints
are :mod:`layoutlang.cli.simulate`.

Words, as everywhere in layoutlang (see :mod:`layoutlang.plan`): a **move** is one transfer
of one region between two ranks, ``local``, ``domain`` (NVLink) or ``network``; a
**message** is every non-local move between one pair of ranks in one bucket and phase.
This module adds:

- a **port**: one direction of one rank's link: its NIC's send and receive sides (network
  moves), its NVLink send and receive sides (domain moves), and its local copy engine
  (local moves, reading and writing the rank's own memory);
- a **phase**: what a move does for its tensor: 0 gathers a broadcast tensor on its root,
  1 moves bytes from the ranks that have them to other ranks (a reshard's moves from source
  storages, a broadcast), 2 relays them inside a domain, 3 extracts a broadcast tensor's
  boxes. A broadcast tensor's plan stages are its phases; a resharded tensor's stages 0 and
  1 are phases 1 and 2;
- a **step**: the unit of the schedule. Phase *p* of bucket *k* runs in step *k + p*:
  buckets start one after the other, a phase starts after the earlier phases of its own
  bucket (a relay never before the network move that feeds it), and the phases of
  consecutive buckets overlap (the relays of bucket *k* run while the network moves of
  bucket *k + 1* do). A step ends when its busiest port is done; the next step starts then.
  A pairwise plan (:ref:`per-rank-plans`) runs stage-major, as the executor runs it: phase
  *p* of bucket *k* in step *p x buckets + k*, every network move before the first relay.

The cost model
--------------

The time a port spends in a step is ``latency x messages + bytes / bandwidth``, summed over
every move of that step that uses the port (phases that share a step share the port). The
time of a step is the largest over every port of every rank; the refit's time is the sum
over steps. Latency and bandwidth are those of the link class: ``network_latency`` and
``network_bandwidth`` for the NIC (one NIC per rank; bandwidths are per direction),
``domain_latency`` and ``domain_bandwidth`` for NVLink, and ``copy_bandwidth`` for local
copies (no latency: copies are launched together). A message is every move between one
pair of ranks in one bucket and phase.

The schedule is the same for every policy, so reshard, gather-and-broadcast and hybrid
plans are compared under one assumption: a bucket's gather overlaps the previous bucket's
broadcast, the relays of the one before and the extraction of the one before that, exactly
as a reshard's relays overlap the next bucket's network moves; and in a hybrid plan the
broadcast and the reshard moves of a bucket run side by side. This needs staging memory for
as many buckets as there are phases in flight (2 for a reshard plan, 4 with broadcast
tensors). :attr:`Estimate.sequential_time` gives the other extreme, every phase of every
bucket one after the other.

Two ratios say where an estimate's time goes: :meth:`Simulation.ratio` (the time over the
lower bound, below) and :meth:`Simulation.port_ratio` (the time over the plan's busiest
port, :attr:`Estimate.busiest_port`). The busiest port over the bound is the routing's
share of a gap (which ranks send and receive what); the time over the busiest port is the
schedule's (steps waiting for ports other than the busiest).

The model leaves out: contention inside the network fabric (it assumes a non-blocking
fat tree: a NIC is the only bottleneck on a network path), contention between NVLink,
NIC and copy traffic for the same HBM, the GPU time of packing regions into messages, and
any compute. It is an estimate for comparing layouts and policies, not a prediction of a
measured refit.

The lower bound
---------------

:func:`lower_bound` is the time below which no plan can move the bytes, whatever its
routing, buckets or stages; it counts bandwidth only (no latency). With ``B_net``,
``B_dom`` and ``B_copy`` the per-rank bandwidths, it is the largest of three families of
terms:

1. **a destination rank's ports.** A destination rank *d* must receive ``need(d)``, the
   bytes it holds in the destination layout and does not hold in the source layout,
   through its NIC and (when another rank of the job shares its domain) its NVLink
   receive port: ``need(d) / (B_net + B_dom)``. Every byte it holds in the destination
   layout, ``hold(d)``, is written into its destination storage by one of those ports or by
   a local copy: ``hold(d) / (B_net + B_dom + B_copy)``.
2. **a destination domain's NICs.** ``U(D)``, the bytes that some rank of domain *D*
   needs and that no rank of *D* holds in the source layout, must enter *D* over the
   network, each at least once, through the NICs of the job's ranks in *D*:
   ``U(D) / (n_D x B_net)``.
3. **a source domain's NICs.** ``E(S)``, the bytes of the tensors whose every source
   holder is in domain *S* that some rank outside *S* needs, must leave *S* at least once:
   ``E(S) / (n_S x B_net)``.

Each term is a volume that must cross a set of ports divided by the total bandwidth of
those ports, so no schedule can take less time; the estimate of any plan is at least the
bound (every port's load in a plan covers these volumes, and a step lasts at least as
long as each of its ports is busy). ``need``, ``hold`` and ``U`` are read from the reshard
plan, which delivers every byte exactly once per destination domain (its planner sends a
region across the network once per domain and relays it inside): ``need`` and ``hold`` count
what each rank receives into its destination storages (a region a rank lands in scratch
only to relay it is not its own need), ``U`` the network bytes entering each domain; ``E``
from the source layout's holders and the regions the reshard plan sends across the
network.

The topologies: the presets (:data:`~layoutlang.model.topology.TOPOLOGY_PRESETS`) live with
:class:`~layoutlang.model.Topology` in :mod:`layoutlang.model.topology`, and so does
:func:`~layoutlang.model.topology.complete_topology`, which fills the link settings a
topology leaves out from :data:`~layoutlang.model.topology.FALLBACK_PRESET` before any
estimate reads them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from .._text import human_bytes
from ..errors import LayoutError, LayoutNameError, did_you_mean
from ..model import Program, Reshard, Topology
from ..model.topology import FALLBACK_PRESET, TOPOLOGY_PRESETS, CompleteTopology, complete_topology
from .compile import plan_layouts
from .data import DEFAULT_BUCKET_BYTES, KINDS, SPACES, Plan

__all__ = [
    "PORTS",
    "Estimate",
    "LowerBound",
    "Simulation",
    "estimate",
    "lower_bound",
    "simulate",
]

_Int32s = npt.NDArray[np.int32]
_Int64s = npt.NDArray[np.int64]
_Floats = npt.NDArray[np.float64]


def _byte_sums(index: npt.NDArray[np.integer[Any]], nbytes: _Int64s, minlength: int) -> _Floats:
    """The bytes of the moves at each index: ``np.bincount`` with weights, whose sums are
    float64 (numpy's stub types every ``bincount`` as integer counts)."""
    return np.bincount(index, weights=nbytes, minlength=minlength).astype(np.float64, copy=False)


# ------------------------------------------------------------------------ estimates

#: The ports of a rank, in the order the arrays of :class:`Estimate` use.
PORTS = ("network send", "network receive", "NVLink send", "NVLink receive", "local copy")


def _port_kind(port: str) -> int:
    """The kind of move (0 local, 1 domain, 2 network) that uses ``port``."""
    return 0 if port == "local copy" else 2 if port.startswith("network") else 1


@attrs.frozen
class Estimate:
    """The estimated time of one plan on one topology.

    ``time`` is the pipelined schedule (phase *p* of bucket *k* in step *k + p*);
    ``sequential_time`` runs every phase of every bucket one after the other. ``bound_by``
    maps each port kind to the seconds of the steps it was the busiest port of, and
    ``latency`` is the part of ``time`` spent on per-message latency in those ports.
    ``busiest_port`` is the port with the most work over the whole refit: the gap between
    its seconds and ``time`` is time its steps spent waiting for other ports.
    """

    policy: str
    plan: str
    time: float
    sequential_time: float | None
    steps: int
    buckets: int
    bytes: dict[str, int]
    messages: dict[str, int]
    bound_by: dict[str, float]
    latency: float
    largest_network_receive: tuple[int, int]
    largest_network_send: tuple[int, int]
    #: (port, rank, seconds): the port busiest over the whole refit, summed over steps
    busiest_port: tuple[str, int, float] = ("local copy", 0, 0.0)

    def to_json(self) -> dict[str, Any]:
        receive, send, port = self.largest_network_receive, self.largest_network_send, self.busiest_port
        return {
            "policy": self.policy,
            "plan": self.plan,
            "time_s": self.time,
            "sequential_time_s": self.sequential_time,
            "steps": self.steps,
            "buckets": self.buckets,
            "bytes": self.bytes,
            "messages": self.messages,
            "bound_by_s": self.bound_by,
            "latency_s": self.latency,
            "largest_network_receive": {"bytes": receive[0], "rank": receive[1]},
            "largest_network_send": {"bytes": send[0], "rank": send[1]},
            "busiest_port": {"port": port[0], "rank": port[1], "time_s": port[2]},
        }


@attrs.frozen
class LowerBound:
    """No plan refits faster than ``time`` (see the module's docstring for the terms).

    ``terms`` maps each family (``destination rank``, ``destination rank with copies``,
    ``destination domain``, ``source domain``) to its largest value in seconds; ``binding``
    names the largest, ``where`` the rank or domain, ``volume`` its bytes and ``ports`` how
    many ports share them. ``bytes`` is the planner's lower bound in bytes (what destinations
    need and do not hold).
    """

    time: float
    binding: str
    where: int
    volume: int
    ports: int
    terms: dict[str, float]
    bytes: int
    #: per domain: the bytes that must enter it (destination domains) and leave it (source domains)
    ingress: dict[int, int] = attrs.field(factory=dict, repr=False)
    egress: dict[int, int] = attrs.field(factory=dict, repr=False)

    def describe(self, topology: Topology) -> str:
        if self.time == 0:
            return "nothing to move"
        if self.binding == "destination rank":
            return f"rank {self.where} receives {human_bytes(self.volume)} through its NIC and NVLink"
        if self.binding == "destination rank with copies":
            return (
                f"rank {self.where} writes {human_bytes(self.volume)} into its destination storages "
                "through its NIC, NVLink and copies"
            )
        side = "enter" if self.binding == "destination domain" else "leave"
        first = self.where * topology.domain_size
        return (
            f"{human_bytes(self.volume)} must {side} domain {self.where} "
            f"(ranks {first}..{first + topology.domain_size - 1}) "
            f"through {self.ports} NIC{'s' if self.ports != 1 else ''}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "time_s": self.time,
            "binding": self.binding,
            "where": self.where,
            "volume_bytes": self.volume,
            "ports": self.ports,
            "terms_s": self.terms,
            "lower_bound_bytes": self.bytes,
        }


@attrs.frozen(eq=False)
class _KindMoves:
    """The moves of one kind, column by column: sending and receiving rank (as indexes
    into :attr:`_Moves.ranks`), bucket, phase and bytes."""

    src: _Int32s
    dst: _Int32s
    bucket: _Int64s
    phase: _Int64s
    nbytes: _Int64s
    #: whether the move writes its receiver's destination storage (not a scratch buffer)
    kept: npt.NDArray[np.bool_]


@attrs.frozen(eq=False)
class _Messages:
    """The distinct messages among the moves of one kind: bucket, phase, sending and
    receiving rank (as indexes) of each."""

    bucket: _Int64s
    phase: _Int64s
    src: _Int64s
    dst: _Int64s


@attrs.frozen(eq=False)
class _Moves:
    """The columns of a plan the cost model reads, split by kind (ranks as indexes 0..R-1)."""

    #: the job's ranks (source and destination meshes), sorted: moves name them by index
    ranks: _Int64s
    buckets: int
    phases: int
    #: per kind (0 local, 1 domain, 2 network)
    of_kind: dict[int, _KindMoves]
    #: the bytes each region of the plan carries (its wire bytes where they are priced)
    region_bytes: _Int64s

    @classmethod
    def of(cls, plan: Plan, *, wire: bool = True) -> _Moves:
        """The plan's moves; ``wire``: a move into a quantized tensor carries its wire bytes
        (fp8 values and scales where its sender quantizes), else every move its region's
        bytes in the tensor's own dtype."""
        a = plan.arrays
        ranks = np.union1d(
            np.asarray(plan.source.mesh.ranks, dtype=np.int64), np.asarray(plan.destination.mesh.ranks, dtype=np.int64)
        )
        src: _Int32s = np.asarray(a.move_src, dtype=np.int32)
        dst: _Int32s = np.asarray(a.move_dst, dtype=np.int32)
        if len(ranks) and ranks[-1] < 1 << 24:
            table = np.zeros(int(ranks[-1]) + 1, dtype=np.int32)
            table[ranks] = np.arange(len(ranks), dtype=np.int32)
            src, dst = table[src], table[dst]
        else:
            src = np.searchsorted(ranks, src).astype(np.int32)
            dst = np.searchsorted(ranks, dst).astype(np.int32)
        kind = np.asarray(a.move_kind, dtype=np.uint8)
        kept = np.asarray(a.move_dst_space) == SPACES.index("destination")
        bucket = np.asarray(a.move_bucket, dtype=np.int32)
        region = np.asarray(a.move_region, dtype=np.int32)
        quantization = plan.quantization if wire else None
        per_region = np.asarray(a.region_bytes if quantization is None else quantization.wire_bytes, dtype=np.int64)
        nbytes = per_region[region]
        # The phase of a move: gather 0, moves across ranks 1, relays 2, extraction 3. A
        # broadcast tensor's stages are its phases; a resharded tensor's stage 0 (its moves
        # from source storages) and stage 1 (relays) are phases 1 and 2, so that in a hybrid
        # plan both policies' network moves and relays line up.
        phase = np.asarray(a.move_stage).astype(np.int8)
        resharded = np.array([p == "reshard" for p in plan.policies], dtype=np.int8)
        if resharded.any():
            phase = phase + resharded[np.asarray(a.region_tensor)[region]]
        of_kind = {}
        for k in (0, 1, 2):
            idx = np.flatnonzero(kind == k)
            of_kind[k] = _KindMoves(
                src[idx], dst[idx], bucket[idx].astype(np.int64), phase[idx].astype(np.int64), nbytes[idx], kept[idx]
            )
        return cls(
            ranks=ranks,
            buckets=plan.num_buckets,
            phases=int(phase.max()) + 1 if len(phase) else 1,
            of_kind=of_kind,
            region_bytes=per_region,
        )


def _messages(m: _Moves, kind: int) -> _Messages:
    """Every distinct message among the moves of ``kind``."""
    R = len(m.ranks)
    S = m.phases
    moves = m.of_kind[kind]
    if m.buckets * S * R * R < 2**62:
        key = ((moves.bucket * S + moves.phase) * R + moves.src) * R + moves.dst
        key.sort()
        if len(key):
            key = key[np.concatenate(([True], key[1:] != key[:-1]))]
        dst, key = key % R, key // R
        src, key = key % R, key // R
        return _Messages(bucket=key // S, phase=key % S, src=src, dst=dst)
    rows = np.unique(np.stack([moves.bucket, moves.phase, moves.src, moves.dst]), axis=1)
    return _Messages(bucket=rows[0], phase=rows[1], src=rows[2], dst=rows[3])


def _step_maxima(
    byte_step: _Int64s,
    byte_rank: _Int32s,
    nbytes: _Int64s,
    msg_step: _Int64s | None,
    msg_rank: _Int64s | None,
    n_steps: int,
    R: int,
    latency: float,
    bandwidth: float,
) -> tuple[_Floats, _Floats]:
    """Per step, the largest ``latency x messages + bytes / bandwidth`` of one port kind
    over the ranks, and the latency part of it. Moves give the bytes at (step, rank),
    messages (when given) the counts."""
    out = np.zeros(n_steps)
    lat = np.zeros(n_steps)
    if not len(byte_step):
        return out, lat
    # only the ranks that use this port get a column
    used = np.zeros(R, dtype=bool)
    used[byte_rank] = True
    column = np.cumsum(used, dtype=np.int64) - 1
    R = int(column[-1]) + 1
    byte_column = column[byte_rank]
    msg_column = column[msg_rank] if msg_rank is not None else None
    chunk = max(1, (1 << 23) // R)  # steps per pass: at most 8M cells per dense array
    for lo in range(0, n_steps, chunk):
        hi = min(n_steps, lo + chunk)
        whole = lo == 0 and hi == n_steps
        cells = (hi - lo) * R
        sel = slice(None) if whole else (byte_step >= lo) & (byte_step < hi)
        t = _byte_sums((byte_step[sel] - lo) * R + byte_column[sel], nbytes[sel], cells)
        t *= 1.0 / bandwidth
        msgs = None
        if msg_step is not None and msg_column is not None:
            sel = slice(None) if whole else (msg_step >= lo) & (msg_step < hi)
            msgs = np.bincount((msg_step[sel] - lo) * R + msg_column[sel], minlength=cells)
            t += latency * msgs
        grid = t.reshape(hi - lo, R)
        best = grid.argmax(axis=1)
        rows = np.arange(hi - lo)
        out[lo:hi] = grid[rows, best]
        if msgs is not None:
            lat[lo:hi] = latency * msgs.reshape(hi - lo, R)[rows, best]
    return out, lat


def _schedule(
    m: _Moves, messages: dict[int, _Messages], topology: CompleteTopology, pipelined: bool, stage_major: bool = False
) -> tuple[float, int, dict[str, float], float]:
    """Total time, number of steps, seconds bound by each port kind, and latency seconds.

    ``stage_major`` is how the executor runs a pairwise plan: every bucket of one phase, then
    the next phase's (all network moves, then the relays), phases never overlapping."""
    S = m.phases
    R = len(m.ranks)
    B = m.buckets

    def steps_of(bucket: _Int64s, phase: _Int64s) -> _Int64s:
        if stage_major:
            return phase * B + bucket
        return bucket + phase if pipelined else bucket * S + phase

    n_steps = (B * S if stage_major or not pipelined else B + S - 1) if B else 0
    if n_steps == 0:
        return 0.0, 0, dict.fromkeys(PORTS, 0.0), 0.0
    per_port = []
    for port in PORTS:
        kind = _port_kind(port)
        moves = m.of_kind[kind]
        step = steps_of(moves.bucket, moves.phase)
        if kind == 0:
            per_port.append(
                _step_maxima(step, moves.src, moves.nbytes, None, None, n_steps, R, 0.0, topology.copy_bandwidth)
            )
            continue
        sending = port.endswith("send")
        msg = messages[kind]
        bw = topology.network_bandwidth if kind == 2 else topology.domain_bandwidth
        latency = topology.network_latency if kind == 2 else topology.domain_latency
        per_port.append(
            _step_maxima(
                step,
                moves.src if sending else moves.dst,
                moves.nbytes,
                steps_of(msg.bucket, msg.phase),
                msg.src if sending else msg.dst,
                n_steps,
                R,
                latency,
                bw,
            )
        )
    times = np.stack([t for t, _ in per_port])
    lats = np.stack([lt for _, lt in per_port])
    which = times.argmax(axis=0)
    step_time = times[which, np.arange(n_steps)]
    bound_by = {p: float(step_time[which == i].sum()) for i, p in enumerate(PORTS)}
    latency = float(lats[which, np.arange(n_steps)].sum())
    return float(step_time.sum()), int(np.count_nonzero(step_time)), bound_by, latency


#: an estimate's policy by the set of its plan's policies (any other set: "hybrid")
_POLICY_NAMES: dict[tuple[str, ...], str] = {("reshard",): "reshard", ("broadcast",): "gather-and-broadcast"}


def estimate(plan: Plan, topology: Topology, policy: str | None = None, *, sequential: bool = False) -> Estimate:
    """The estimated time of ``plan`` on ``topology`` (its missing settings are taken from
    :data:`~layoutlang.model.topology.FALLBACK_PRESET`; its domain size must be the plan's).
    ``sequential`` also computes :attr:`Estimate.sequential_time` (otherwise None), which
    costs as much again."""
    return _estimate(_Moves.of(plan), plan, topology, policy, sequential)


def _estimate(m: _Moves, plan: Plan, topology: Topology, policy: str | None, sequential: bool) -> Estimate:
    links, _ = complete_topology(topology)
    if links.domain_size != plan.domain_size:
        raise ValueError(f"the plan has domains of {plan.domain_size} ranks, the topology of {links.domain_size}")
    messages = {k: _messages(m, k) for k in (1, 2)}
    # A pairwise plan's buckets are cut per pair of ranks and every rank runs its stages one
    # after the other (runtime/schedule.py): its phases do not overlap.
    stage_major = plan.mode == "pairwise"
    time, steps, bound_by, latency = _schedule(m, messages, links, pipelined=True, stage_major=stage_major)
    unpipelined = _schedule(m, messages, links, pipelined=False)[0] if sequential else None
    if policy is None:
        policy = _POLICY_NAMES.get(tuple(sorted(set(plan.policies))), "hybrid")
    R = len(m.ranks)
    network = m.of_kind[2]
    sent = _byte_sums(network.src, network.nbytes, R) if R else np.zeros(1)
    received = _byte_sums(network.dst, network.nbytes, R) if R else np.zeros(1)
    busiest = _busiest_port(m, messages, links)
    return Estimate(
        policy=policy,
        plan=plan.name,
        time=time,
        sequential_time=unpipelined,
        steps=steps,
        buckets=plan.num_buckets,
        bytes={KINDS[k]: int(m.of_kind[k].nbytes.sum()) for k in (0, 1, 2)},
        messages={"domain": len(messages[1].bucket), "network": len(messages[2].bucket)},
        bound_by=bound_by,
        latency=latency,
        largest_network_receive=(int(received.max()), int(m.ranks[received.argmax()])) if R else (0, 0),
        largest_network_send=(int(sent.max()), int(m.ranks[sent.argmax()])) if R else (0, 0),
        busiest_port=busiest,
    )


def _busiest_port(m: _Moves, messages: dict[int, _Messages], topology: CompleteTopology) -> tuple[str, int, float]:
    """(port, rank, seconds) of the port busiest over the whole refit: what the refit would
    take if no step ever waited for another port (a bound on the cost of the steps)."""
    R = len(m.ranks)
    best = ("local copy", int(m.ranks[0]) if R else 0, 0.0)
    for port in PORTS:
        kind = _port_kind(port)
        moves = m.of_kind[kind]
        if kind == 0:
            t = _byte_sums(moves.src, moves.nbytes, R) / topology.copy_bandwidth
        else:
            sending = port.endswith("send")
            net = kind == 2
            bw = topology.network_bandwidth if net else topology.domain_bandwidth
            latency = topology.network_latency if net else topology.domain_latency
            ranks = messages[kind].src if sending else messages[kind].dst
            t = _byte_sums(moves.src if sending else moves.dst, moves.nbytes, R) / bw
            t += latency * np.bincount(ranks, minlength=R)
        if R and t.max() > best[2]:
            best = (port, int(m.ranks[t.argmax()]), float(t.max()))
    return best


# ---------------------------------------------------------------------- lower bound


def lower_bound(plan: Plan, topology: Topology) -> LowerBound:
    """The time no plan between ``plan``'s layouts can beat on ``topology``.

    ``plan`` must reshard every tensor (it is read for the bytes each destination rank and
    domain needs, not for its schedule); see the module's docstring for the definition.
    """
    return _lower_bound(_Moves.of(plan), plan, topology)


def _lower_bound(m: _Moves, plan: Plan, topology: Topology) -> LowerBound:
    if set(plan.policies) - {"reshard"}:
        raise ValueError("the lower bound is read from a plan that reshards every tensor (policy='reshard')")
    links, _ = complete_topology(topology)
    if links.domain_size != plan.domain_size:
        raise ValueError(f"the plan has domains of {plan.domain_size} ranks, the topology of {links.domain_size}")
    ds = plan.domain_size
    a = plan.arrays
    job = m.ranks  # the union of both meshes' ranks, sorted
    domains, domain_index, per_domain = np.unique(job // ds, return_inverse=True, return_counts=True)
    b_net, b_dom, b_copy = links.network_bandwidth, links.domain_bandwidth, links.copy_bandwidth
    # (seconds, rank or domain, bytes, ports) of the largest term of each family
    terms: dict[str, tuple[float, int, int, int]] = {}

    # 1. destination ranks: what they receive (need) and write (hold) in the reshard plan,
    # into their destination storages (a region landed in a rank's scratch only passes by)
    R = len(job)
    received = [
        _byte_sums(m.of_kind[k].dst[m.of_kind[k].kept], m.of_kind[k].nbytes[m.of_kind[k].kept], R) for k in (0, 1, 2)
    ]
    need = received[1] + received[2]
    hold = need + received[0]
    inbound = b_net + np.where(per_domain[domain_index] > 1, b_dom, 0.0)
    for family, volumes, capacity in (
        ("destination rank", need, inbound),
        ("destination rank with copies", hold, inbound + b_copy),
    ):
        t = volumes / capacity
        i = int(t.argmax()) if R else 0
        terms[family] = (float(t[i]), int(job[i]), int(volumes[i]), 1) if R else (0.0, 0, 0, 1)

    # 2. destination domains: each byte a domain needs and does not hold enters it once
    network = m.of_kind[2]
    ingress = _byte_sums(domain_index[network.dst], network.nbytes, len(domains))
    region_bytes = m.region_bytes
    region = np.asarray(a.move_region)[np.asarray(a.move_kind) == 2]
    t = ingress / (per_domain * b_net)
    j = int(t.argmax()) if len(t) else 0
    terms["destination domain"] = (
        float(t[j]) if len(t) else 0.0,
        int(domains[j]),
        int(ingress[j]) if len(t) else 0,
        int(per_domain[j]),
    )

    # 3. source domains: tensors held only inside one domain must leave it once
    source = plan.source
    resolved = source.resolved
    home = np.full(len(resolved.names), -1, dtype=np.int64)
    cache: dict[tuple[int, tuple[tuple[str, int], ...]], int] = {}
    for tensor in range(len(resolved.names)):
        key = (resolved.spec_of[tensor], resolved.submesh_of[tensor])
        if key not in cache:
            holder_domains = {h // ds for h in source.core.holders(tensor)}
            cache[key] = holder_domains.pop() if len(holder_domains) == 1 else -1
        home[tensor] = cache[key]
    region_home = home[np.asarray(a.region_tensor)]
    crossing = np.zeros(len(region_bytes), dtype=bool)
    crossing[region] = True
    crossing &= region_home >= 0
    egress = _byte_sums(np.searchsorted(domains, region_home[crossing]), region_bytes[crossing], len(domains))
    t = egress / (per_domain * b_net)
    k = int(t.argmax()) if len(t) else 0
    terms["source domain"] = (
        float(t[k]) if len(t) else 0.0,
        int(domains[k]),
        int(egress[k]) if len(t) else 0,
        int(per_domain[k]),
    )

    binding = max(terms, key=lambda family: terms[family][0])
    time, where, volume, ports = terms[binding]
    return LowerBound(
        time=time,
        binding=binding,
        where=where,
        volume=volume,
        ports=ports,
        terms={family: value[0] for family, value in terms.items()},
        bytes=int(a.lower_bound_bytes),
        ingress={int(d): int(v) for d, v in zip(domains, ingress) if v},
        egress={int(d): int(v) for d, v in zip(domains, egress) if v},
    )


# ----------------------------------------------------------------------- simulation


@attrs.frozen
class Simulation:
    """The estimates of one reshard statement's plans on one topology, and the lower bound."""

    reshard: str
    source: str
    destination: str
    source_ranks: int
    destination_ranks: int
    topology: CompleteTopology
    assumed: tuple[str, ...]
    bucket_bytes: int
    estimates: tuple[Estimate, ...]
    bound: LowerBound
    #: for a destination that stores tensors quantized: the reshard plan priced as if every
    #: move carried its tensor's own dtype (the estimates price wire bytes), else None
    unquantized: Estimate | None = None

    def ratio(self, estimate: Estimate) -> float:
        """``estimate``'s time over the lower bound: how far the plan is from any plan's best."""
        if self.bound.time == 0:
            return 1.0 if estimate.time == 0 else math.inf
        return estimate.time / self.bound.time

    def port_ratio(self, estimate: Estimate) -> float:
        """``estimate``'s time over its busiest port's seconds: what the schedule adds to the
        plan's routing (1.0 when no step waits for a port other than the busiest)."""
        busiest = estimate.busiest_port[2]
        if busiest == 0:
            return 1.0 if estimate.time == 0 else math.inf
        return estimate.time / busiest

    def quantized_ratio(self) -> float | None:
        """The reshard's time on the wire over its time unquantized (None: nothing is quantized)."""
        if self.unquantized is None:
            return None
        reshard = self.estimates[0]
        return reshard.time / self.unquantized.time if self.unquantized.time else 1.0

    def to_json(self) -> dict[str, Any]:
        t = self.topology
        quantized = (
            {} if self.unquantized is None
            else {"unquantized_reshard": self.unquantized.to_json(), "quantized_ratio": self.quantized_ratio()}
        )
        return quantized | {
            "reshard": self.reshard,
            "source": {"layout": self.source, "ranks": self.source_ranks},
            "destination": {"layout": self.destination, "ranks": self.destination_ranks},
            "topology": {
                "name": t.name,
                "domain_size": t.domain_size,
                "domain_bandwidth": t.domain_bandwidth,
                "network_bandwidth": t.network_bandwidth,
                "copy_bandwidth": t.copy_bandwidth,
                "domain_latency": t.domain_latency,
                "network_latency": t.network_latency,
                "assumed_from_" + FALLBACK_PRESET: list(self.assumed),
            },
            "bucket_bytes": self.bucket_bytes,
            "schedule": "phase p of bucket k runs in step k + p",
            "policies": [
                dict(e.to_json(), ratio_to_lower_bound=self.ratio(e), ratio_to_busiest_port=self.port_ratio(e))
                for e in self.estimates
            ],
            "lower_bound": self.bound.to_json(),
        }


def _compile(program: Program, statement: Reshard, domain_size: int, bucket_bytes: int, policy: str | None) -> Plan:
    """The plan of ``statement`` with one ``policy`` for every tensor (None: the statement's own)."""
    source = program.layout(statement.source)
    destination = program.layout(statement.destination)
    policies: Sequence[str] | str = (
        policy if policy is not None else [statement.policy_for(name) for name in source.resolved.names]
    )
    try:
        return plan_layouts(
            source,
            destination,
            name=statement.name,
            domain_size=domain_size,
            bucket_bytes=bucket_bytes,
            policies=policies,
        )
    except LayoutError as err:
        raise err.with_span(statement.span) from None


def simulate(
    program: Program,
    reshard: str | None = None,
    *,
    topology: str | Topology | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sequential: bool = False,
) -> Simulation:
    """Estimate the refit of a ``reshard`` statement (the only one when None) with every
    tensor resharded, every tensor gathered and broadcast, and the statement's own policies
    when it gives any; ``topology`` (a preset name or a :class:`Topology`) replaces the
    program's. ``sequential`` also estimates every plan without pipelining."""
    statement = program.reshard(reshard)
    if isinstance(topology, str):
        if topology not in TOPOLOGY_PRESETS:
            raise LayoutNameError(
                f"unknown topology '{topology}' (presets: {', '.join(TOPOLOGY_PRESETS)})",
                hint=did_you_mean(topology, TOPOLOGY_PRESETS),
            )
        topology = TOPOLOGY_PRESETS[topology]
    topo, assumed = complete_topology(topology if topology is not None else program.topology)
    source = program.layout(statement.source)
    # One plan in memory at a time: the largest hold tens of millions of moves. The reshard
    # plan comes first, and the bound is read from it.
    plan = _compile(program, statement, topo.domain_size, bucket_bytes, "reshard")
    moves = _Moves.of(plan)
    estimates = [_estimate(moves, plan, topo, "reshard", sequential)]
    bound = _lower_bound(moves, plan, topo)
    unquantized = None
    if plan.quantization is not None:  # the same moves in the tensors' own dtype, for comparison
        unquantized = _estimate(_Moves.of(plan, wire=False), plan, topo, "reshard", sequential)
    del plan, moves
    others: list[tuple[str, str | None]] = [("gather-and-broadcast", "broadcast")]
    if any(policy == "broadcast" for _, policy in statement.policies):
        others.append(("hybrid", None))
    for label, policy in others:
        plan = _compile(program, statement, topo.domain_size, bucket_bytes, policy)
        if label == "hybrid" and set(plan.policies) != {"broadcast", "reshard"}:
            continue  # the statement's policies resolve to one policy: no third row
        estimates.append(_estimate(_Moves.of(plan), plan, topo, label, sequential))
        del plan
    destination = program.layout(statement.destination)
    return Simulation(
        reshard=statement.name,
        source=statement.source,
        destination=statement.destination,
        source_ranks=source.mesh.size,
        destination_ranks=destination.mesh.size,
        topology=topo,
        assumed=tuple(assumed),
        bucket_bytes=bucket_bytes,
        estimates=tuple(estimates),
        bound=bound,
        unquantized=unquantized,
    )
