"""A cost model over plans: how long would a refit take on a given cluster?

``layoutlang simulate FILE`` (:mod:`layoutlang.cli.simulate`) compiles the plan of a ``reshard`` statement three ways
(reshard every tensor, gather-and-broadcast every tensor, and the statement's own hybrid
policies when it has any), estimates the time of each on a topology, and compares them
with a lower bound that no plan can beat. Nothing runs on a GPU: the estimate is computed
from the plan's arrays.

Words, as everywhere in layoutlang (see :mod:`layoutlang.plan`): a **move** is one transfer
of one region between two ranks, ``local``, ``domain`` (NVLink) or ``network``; a
**message** is every non-local move between one pair of ranks in one bucket and stage.
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
region across the network once per domain and relays it inside); ``E`` from the source
layout's holders and the regions the reshard plan sends across the network.

Topology presets live with :class:`~layoutlang.model.Topology` (:data:`layoutlang.model.topology.TOPOLOGY_PRESETS`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from .._text import human_bytes
from ..errors import LayoutError, LayoutNameError, did_you_mean
from ..model import Program, Reshard, Topology
from ..model.topology import FALLBACK_PRESET, TOPOLOGY_PRESETS, complete_topology
from .compile import plan_layouts
from .data import DEFAULT_BUCKET_BYTES, KINDS, Plan

__all__ = [
    "PORTS",
    "Estimate",
    "LowerBound",
    "Simulation",
    "estimate",
    "lower_bound",
    "simulate",
]


# ------------------------------------------------------------------------ estimates

#: The ports of a rank, in the order the arrays of :class:`Estimate` use.
PORTS = ("network send", "network receive", "NVLink send", "NVLink receive", "local copy")


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
            "largest_network_receive": {"bytes": self.largest_network_receive[0], "rank": self.largest_network_receive[1]},
            "largest_network_send": {"bytes": self.largest_network_send[0], "rank": self.largest_network_send[1]},
            "busiest_port": {"port": self.busiest_port[0], "rank": self.busiest_port[1], "time_s": self.busiest_port[2]},
        }


@attrs.frozen
class LowerBound:
    """No plan refits faster than ``time`` (see the module's docstring for the terms).

    ``terms`` maps each family (``destination rank``, ``destination rank with copies``,
    ``destination domain``, ``source domain``) to its largest value in seconds; ``binding`` names the largest, ``where`` the
    rank or domain, ``volume`` its bytes and ``ports`` how many ports share them.
    ``bytes`` is the planner's lower bound in bytes (what destinations need and do not hold).
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
            f"{human_bytes(self.volume)} must {side} domain {self.where} (ranks {first}..{first + topology.domain_size - 1}) "
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


class _Moves:
    """The columns of a plan the cost model reads, split by kind (ranks as indexes 0..R-1)."""

    def __init__(self, plan: Plan):
        a = plan.arrays
        self.ranks = np.union1d(
            np.asarray(plan.source.mesh.ranks, dtype=np.int64), np.asarray(plan.destination.mesh.ranks, dtype=np.int64)
        )
        src = np.asarray(a.move_src)
        dst = np.asarray(a.move_dst)
        if len(self.ranks) and self.ranks[-1] < 1 << 24:
            table = np.zeros(int(self.ranks[-1]) + 1, dtype=np.int32)
            table[self.ranks] = np.arange(len(self.ranks), dtype=np.int32)
            src, dst = table[src], table[dst]
        else:
            src = np.searchsorted(self.ranks, src).astype(np.int32)
            dst = np.searchsorted(self.ranks, dst).astype(np.int32)
        kind = np.asarray(a.move_kind)
        bucket = np.asarray(a.move_bucket)
        region = np.asarray(a.move_region)
        nbytes = np.asarray(a.region_bytes, dtype=np.int64)[region]
        # The phase of a move: gather 0, moves across ranks 1, relays 2, extraction 3. A
        # broadcast tensor's stages are its phases; a resharded tensor's stage 0 (its moves
        # from source storages) and stage 1 (relays) are phases 1 and 2, so that in a hybrid
        # plan both policies' network moves and relays line up.
        stage = np.asarray(a.move_stage).astype(np.int8)
        resharded = np.array([p == "reshard" for p in plan.policies], dtype=np.int8)
        if resharded.any():
            stage = stage + resharded[np.asarray(a.region_tensor)[region]]
        self.buckets = plan.num_buckets
        self.phases = int(stage.max()) + 1 if len(stage) else 1
        #: per kind (0 local, 1 domain, 2 network): src, dst, bucket, phase, bytes of its moves
        self.of_kind: dict[int, tuple[np.ndarray, ...]] = {}
        for k in (0, 1, 2):
            idx = np.flatnonzero(kind == k)
            self.of_kind[k] = (src[idx], dst[idx], bucket[idx].astype(np.int64), stage[idx].astype(np.int64), nbytes[idx])


def _messages(m: _Moves, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(bucket, phase, src, dst) of every distinct message among the moves of ``kind``."""
    R = len(m.ranks)
    S = m.phases
    src, dst, bucket, stage, _ = m.of_kind[kind]
    if m.buckets * S * R * R < 2**62:
        key = ((bucket * S + stage) * R + src) * R + dst
        key.sort()
        if len(key):
            key = key[np.concatenate(([True], key[1:] != key[:-1]))]
        dst, key = key % R, key // R
        src, key = key % R, key // R
        return key // S, key % S, src, dst
    rows = np.unique(np.stack([bucket, stage, src, dst]), axis=1)
    return rows[0], rows[1], rows[2], rows[3]


def _step_maxima(
    byte_step: np.ndarray,
    byte_rank: np.ndarray,
    nbytes: np.ndarray,
    msg_step: np.ndarray | None,
    msg_rank: np.ndarray | None,
    n_steps: int,
    R: int,
    latency: float,
    bandwidth: float,
) -> tuple[np.ndarray, np.ndarray]:
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
    byte_rank = column[byte_rank]
    msg_rank = column[msg_rank] if msg_rank is not None else None
    chunk = max(1, (1 << 23) // R)  # steps per pass: at most 8M cells per dense array
    for lo in range(0, n_steps, chunk):
        hi = min(n_steps, lo + chunk)
        whole = lo == 0 and hi == n_steps
        cells = (hi - lo) * R
        sel = slice(None) if whole else (byte_step >= lo) & (byte_step < hi)
        t = np.bincount((byte_step[sel] - lo) * R + byte_rank[sel], weights=nbytes[sel], minlength=cells)
        t *= 1.0 / bandwidth
        msgs = None
        if msg_step is not None:
            sel = slice(None) if whole else (msg_step >= lo) & (msg_step < hi)
            msgs = np.bincount((msg_step[sel] - lo) * R + msg_rank[sel], minlength=cells)
            t += latency * msgs
        t = t.reshape(hi - lo, R)
        best = t.argmax(axis=1)
        rows = np.arange(hi - lo)
        out[lo:hi] = t[rows, best]
        if msgs is not None:
            lat[lo:hi] = latency * msgs.reshape(hi - lo, R)[rows, best]
    return out, lat


def _schedule(
    m: _Moves, messages: dict[int, tuple[np.ndarray, ...]], topology: Topology, pipelined: bool
) -> tuple[float, int, dict[str, float], float]:
    """Total time, number of steps, seconds bound by each port kind, and latency seconds."""
    S = m.phases
    R = len(m.ranks)

    def steps_of(bucket: np.ndarray, stage: np.ndarray) -> np.ndarray:
        return bucket + stage if pipelined else bucket * S + stage

    n_steps = (m.buckets + S - 1 if pipelined else m.buckets * S) if m.buckets else 0
    if n_steps == 0:
        return 0.0, 0, {p: 0.0 for p in PORTS}, 0.0
    per_port = []
    for port in PORTS:
        kind = 0 if port == "local copy" else 2 if port.startswith("network") else 1
        src, dst, bucket, stage, nbytes = m.of_kind[kind]
        step = steps_of(bucket, stage)
        if kind == 0:
            per_port.append(_step_maxima(step, src, nbytes, None, None, n_steps, R, 0.0, topology.copy_bandwidth))
            continue
        sending = port.endswith("send")
        mb, ms, msrc, mdst = messages[kind]
        bw = topology.network_bandwidth if kind == 2 else topology.domain_bandwidth
        latency = topology.network_latency if kind == 2 else topology.domain_latency
        per_port.append(
            _step_maxima(
                step,
                src if sending else dst,
                nbytes,
                steps_of(mb, ms),
                msrc if sending else mdst,
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


def estimate(plan: Plan, topology: Topology, policy: str | None = None, *, sequential: bool = False) -> Estimate:
    """The estimated time of ``plan`` on ``topology`` (its missing settings are taken from
    :data:`FALLBACK_PRESET`; its domain size must be the plan's). ``sequential`` also
    computes :attr:`Estimate.sequential_time` (otherwise None), which costs as much again."""
    return _estimate(_Moves(plan), plan, topology, policy, sequential)


def _estimate(m: _Moves, plan: Plan, topology: Topology, policy: str | None, sequential: bool) -> Estimate:
    topology, _ = complete_topology(topology)
    if topology.domain_size != plan.domain_size:
        raise ValueError(f"the plan has domains of {plan.domain_size} ranks, the topology of {topology.domain_size}")
    messages = {k: _messages(m, k) for k in (1, 2)}
    time, steps, bound_by, latency = _schedule(m, messages, topology, pipelined=True)
    unpipelined = _schedule(m, messages, topology, pipelined=False)[0] if sequential else None
    if policy is None:
        policy = {("reshard",): "reshard", ("broadcast",): "gather-and-broadcast"}.get(
            tuple(sorted(set(plan.policies))), "hybrid"
        )
    R = len(m.ranks)
    src, dst, _, _, nbytes = m.of_kind[2]
    sent = np.bincount(src, weights=nbytes, minlength=R) if R else np.zeros(1)
    received = np.bincount(dst, weights=nbytes, minlength=R) if R else np.zeros(1)
    busiest = _busiest_port(m, messages, topology)
    return Estimate(
        policy=policy,
        plan=plan.name,
        time=time,
        sequential_time=unpipelined,
        steps=steps,
        buckets=plan.num_buckets,
        bytes={KINDS[k]: int(m.of_kind[k][4].sum()) for k in (0, 1, 2)},
        messages={"domain": len(messages[1][0]), "network": len(messages[2][0])},
        bound_by=bound_by,
        latency=latency,
        largest_network_receive=(int(received.max()), int(m.ranks[received.argmax()])) if R else (0, 0),
        largest_network_send=(int(sent.max()), int(m.ranks[sent.argmax()])) if R else (0, 0),
        busiest_port=busiest,
    )


def _busiest_port(m: _Moves, messages: dict[int, tuple[np.ndarray, ...]], topology: Topology) -> tuple[str, int, float]:
    """(port, rank, seconds) of the port busiest over the whole refit: what the refit would
    take if no step ever waited for another port (a bound on the cost of the steps)."""
    R = len(m.ranks)
    best = ("local copy", int(m.ranks[0]) if R else 0, 0.0)
    for port in PORTS:
        kind = 0 if port == "local copy" else 2 if port.startswith("network") else 1
        src, dst, _, _, nbytes = m.of_kind[kind]
        if kind == 0:
            t = np.bincount(src, weights=nbytes, minlength=R) / topology.copy_bandwidth
        else:
            sending = port.endswith("send")
            net = kind == 2
            bw = topology.network_bandwidth if net else topology.domain_bandwidth
            latency = topology.network_latency if net else topology.domain_latency
            ranks = messages[kind][2] if sending else messages[kind][3]
            t = np.bincount(src if sending else dst, weights=nbytes, minlength=R) / bw
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
    return _lower_bound(_Moves(plan), plan, topology)


def _lower_bound(m: _Moves, plan: Plan, topology: Topology) -> LowerBound:
    if set(plan.policies) - {"reshard"}:
        raise ValueError("the lower bound is read from a plan that reshards every tensor (policy='reshard')")
    topology, _ = complete_topology(topology)
    if topology.domain_size != plan.domain_size:
        raise ValueError(f"the plan has domains of {plan.domain_size} ranks, the topology of {topology.domain_size}")
    ds = plan.domain_size
    a = plan.arrays
    job = np.union1d(np.asarray(plan.source.mesh.ranks, dtype=np.int64), np.asarray(plan.destination.mesh.ranks, dtype=np.int64))
    domains, domain_index, per_domain = np.unique(job // ds, return_inverse=True, return_counts=True)
    b_net, b_dom, b_copy = topology.network_bandwidth, topology.domain_bandwidth, topology.copy_bandwidth

    # 1. destination ranks: what they receive (need) and write (hold) in the reshard plan
    R = len(job)
    received = [np.bincount(m.of_kind[k][1], weights=m.of_kind[k][4], minlength=R) for k in (0, 1, 2)]
    need = received[1] + received[2]
    hold = need + received[0]
    inbound = b_net + np.where(per_domain[domain_index] > 1, b_dom, 0.0)
    terms = {}
    for name, volume, capacity in (
        ("destination rank", need, inbound),
        ("destination rank with copies", hold, inbound + b_copy),
    ):
        t = volume / capacity
        i = int(t.argmax()) if R else 0
        terms[name] = (float(t[i]), int(job[i]), int(volume[i]), 1) if R else (0.0, 0, 0, 1)

    # 2. destination domains: each byte a domain needs and does not hold enters it once
    _, net_dst, _, _, net_bytes = m.of_kind[2]
    ingress = np.bincount(domain_index[net_dst], weights=net_bytes, minlength=len(domains))
    region_bytes = np.asarray(a.region_bytes, dtype=np.int64)
    region = np.asarray(a.move_region)[np.asarray(a.move_kind) == 2]
    t = ingress / (per_domain * b_net)
    j = int(t.argmax()) if len(t) else 0
    terms["destination domain"] = (float(t[j]) if len(t) else 0.0, int(domains[j]), int(ingress[j]) if len(t) else 0, int(per_domain[j]))

    # 3. source domains: tensors held only inside one domain must leave it once
    source = plan.source
    resolved = source.resolved
    home = np.full(len(resolved.names), -1, dtype=np.int64)
    cache: dict[tuple, int] = {}
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
    egress = np.bincount(
        np.searchsorted(domains, region_home[crossing]), weights=region_bytes[crossing], minlength=len(domains)
    )
    t = egress / (per_domain * b_net)
    k = int(t.argmax()) if len(t) else 0
    terms["source domain"] = (float(t[k]) if len(t) else 0.0, int(domains[k]), int(egress[k]) if len(t) else 0, int(per_domain[k]))

    binding = max(terms, key=lambda name: terms[name][0])
    time, where, volume, ports = terms[binding]
    return LowerBound(
        time=time,
        binding=binding,
        where=where,
        volume=volume,
        ports=ports,
        terms={name: value[0] for name, value in terms.items()},
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
    topology: Topology
    assumed: tuple[str, ...]
    bucket_bytes: int
    estimates: tuple[Estimate, ...]
    bound: LowerBound

    def ratio(self, estimate: Estimate) -> float:
        if self.bound.time == 0:
            return 1.0 if estimate.time == 0 else math.inf
        return estimate.time / self.bound.time

    def to_json(self) -> dict[str, Any]:
        t = self.topology
        return {
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
            "policies": [dict(e.to_json(), ratio_to_lower_bound=self.ratio(e)) for e in self.estimates],
            "lower_bound": self.bound.to_json(),
        }


def _compile(program: Program, statement: Reshard, domain_size: int, bucket_bytes: int, policy: str | None) -> Plan:
    source = program.layout(statement.source)
    destination = program.layout(statement.destination)
    policies: Sequence[str] | str = policy if policy is not None else [
        statement.policy_for(name) for name in source.resolved.names
    ]
    return plan_layouts(
        source, destination, name=statement.name, domain_size=domain_size, bucket_bytes=bucket_bytes, policies=policies
    )


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
    policies: list[tuple[str, str | None]] = [("reshard", "reshard"), ("gather-and-broadcast", "broadcast")]
    if any(policy == "broadcast" for _, policy in statement.policies):
        policies.append(("hybrid", None))
    source = program.layout(statement.source)
    estimates = []
    bound = None
    for label, policy in policies:  # one plan at a time: the largest hold tens of millions of moves
        try:
            plan = _compile(program, statement, topo.domain_size, bucket_bytes, policy)
        except LayoutError as err:
            raise err.with_span(statement.span) from None
        if label == "hybrid" and set(plan.policies) != {"broadcast", "reshard"}:
            continue  # the statement's policies resolve to one policy: no third row
        moves = _Moves(plan)
        estimates.append(_estimate(moves, plan, topo, label, sequential))
        if bound is None:
            bound = _lower_bound(moves, plan, topo)
        del plan, moves
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
    )
