"""Compiling plans: two layouts (or a reshard statement) in, a validated :class:`Plan` out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._text import rank_ranges
from ..core import _core
from ..errors import LayoutError, LayoutValueError
from ..model import Layout, Program, Reshard, Topology
from .data import DEFAULT_BUCKET_BYTES, PLAN_MODES, POLICIES, Plan
from .loss import check_recoverable
from .quantized import QUANTIZE_AT, QuantizeChoice, check_quantized_plan, choose_quantize_at, record_blocks


def _check_pair(source: Layout, destination: Layout, storages: bool = True) -> None:
    """Both layouts must place the same logical tensors, and (with ``storages``) a rank in
    both meshes must not give one storage name two different meanings."""
    src_names, dst_names = list(source.tensors), list(destination.tensors)
    if source.tensors is destination.tensors:
        pass  # layouts of one program share its tensors
    elif set(src_names) == set(dst_names):
        pass  # the same tensors declared in another order: plan_layouts reorders
    elif src_names != dst_names:
        missing = [n for n in src_names if n not in destination.tensors][:3]
        extra = [n for n in dst_names if n not in source.tensors][:3]
        raise LayoutValueError(
            f"layouts '{source.name}' and '{destination.name}' place different logical tensors"
            + (f"; only in '{source.name}': {', '.join(missing)}" if missing else "")
            + (f"; only in '{destination.name}': {', '.join(extra)}" if extra else ""),
            destination.span,
        )
    for name in src_names if source.tensors is not destination.tensors else ():
        a, b = source.tensors[name], destination.tensors[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise LayoutValueError(
                f"tensor '{name}' is {list(a.shape)} {a.dtype} in layout '{source.name}' but "
                f"{list(b.shape)} {b.dtype} in layout '{destination.name}'",
                destination.span,
            )
    shared = sorted(set(source.mesh.ranks) & set(destination.mesh.ranks)) if storages else []
    if not shared:
        return
    src_storages = {s.name: s for s in source.resolved.storages}
    for storage in destination.resolved.storages:
        other = src_storages.get(storage.name)
        if other is None or other.parts == storage.parts:
            continue
        for rank in shared:
            held = source.storage_shape(storage.name, rank)
            needed = destination.storage_shape(storage.name, rank)
            if held is not None and needed is not None and (held != needed or other.parts != storage.parts):
                raise LayoutValueError(
                    f"rank {rank} is in both meshes and holds conflicting storages named '{storage.name}': "
                    f"in '{source.name}' {list(held)} of {', '.join(other.parts)}, in '{destination.name}' "
                    f"{list(needed)} of {', '.join(storage.parts)}",
                    storage.span or destination.span,
                    "give one of them another name with a storage statement",
                )


def plan_layouts(
    source: Layout,
    destination: Layout,
    *,
    name: str | None = None,
    domain_size: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    policies: Sequence[str] | str = "reshard",
    mode: str | None = None,
    rank: int | None = None,
    quantize_at: str = "source",
    topology: Topology | None = None,
) -> Plan:
    """Compile the plan from ``source`` to ``destination`` (layouts of the same tensors).

    ``policies`` is one policy for every tensor or one per tensor (``reshard`` moves only
    the exact overlap; ``broadcast`` gathers the whole tensor on one source rank and sends it
    to every destination rank that holds any of it). ``bucket_bytes`` bounds the staging
    memory of one rank in one bucket; larger regions are cut into slabs.

    ``mode`` (:data:`~layoutlang.plan.data.PLAN_MODES`) is ``fleet`` by default: holders,
    landing ranks and buckets balanced by fleet-wide loads. ``pairwise`` chooses them from
    what both ends of a move know (a hash of tensor, box and destination domain; buckets cut
    per pair of ranks), so that ``rank=r`` compiles rank ``r``'s moves alone, in time and
    memory that grow with what ``r`` moves, not with the fleet; the whole pairwise plan is
    the union of the per-rank ones. A pairwise plan moves ``reshard`` tensors only; each of
    its messages carries at most ``bucket_bytes``.

    ``quantize_at`` (:data:`~layoutlang.plan.quantized.QUANTIZE_AT`), for a destination that
    stores tensors quantized: whether the regions that keep whole blocks are quantized by
    their senders (``source``) or their destinations; ``auto`` lets the cost model weigh the
    ``topology``'s links against its ``quantize_bandwidth``
    (:func:`~layoutlang.plan.quantized.choose_quantize_at`). A pairwise plan takes ``auto``
    as ``source``: the choice weighs the whole fleet's bytes, which a rank's part lacks.

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh a [tp = 2]
    ... mesh b [tp = 4] on ranks 2..5
    ... tensor "w" [8, 4] fp32
    ... layout train on a { "w": tp = shard(0) }
    ... layout serve on b { "w": tp = shard(0) }
    ... ''')
    >>> mine = plan_layouts(p.layouts["train"], p.layouts["serve"], rank=0)
    >>> sorted((m.src, m.dst, m.kind) for m in mine.moves())
    [(0, 2, 'network'), (0, 3, 'network')]
    >>> whole = plan_layouts(p.layouts["train"], p.layouts["serve"], mode="pairwise")
    >>> whole.num_moves, whole.fingerprint == mine.fingerprint
    (4, True)
    """
    _check_pair(source, destination)
    if list(source.tensors) != list(destination.tensors):
        # The core numbers tensors in declaration order: give the destination the source's.
        ordered = {name: destination.tensors[name] for name in source.tensors}
        destination = Layout(
            destination.name, destination.mesh, ordered, destination.rules, destination.storages, destination.span,
            quantize=destination.quantize,
        )
    names = source.resolved.names
    per_tensor = (policies,) * len(names) if isinstance(policies, str) else tuple(policies)
    if len(per_tensor) != len(names) or any(p not in POLICIES for p in per_tensor):
        raise LayoutValueError(f"policies must be one of {POLICIES} per tensor")
    if bucket_bytes < 1:
        raise LayoutValueError(f"the bucket budget must be at least 1 byte, not {bucket_bytes}")
    if domain_size < 1:
        raise LayoutValueError(f"the domain size must be at least 1, not {domain_size}")
    mode = _plan_mode(source, destination, names, per_tensor, mode, rank)
    if quantize_at not in QUANTIZE_AT:
        raise LayoutValueError(f"unknown quantize_at '{quantize_at}' (one of: {', '.join(QUANTIZE_AT)})")
    # A quantized destination: refused where plans cannot fill it, then its blocks recorded so
    # that slab cuts fall on block boundaries (each slab quantized by its sender).
    if check_quantized_plan([source], destination):
        record_blocks(destination)
    try:
        codes = [_core.Policy[p] for p in per_tensor]
        if mode == "pairwise":
            at = -1 if rank is None else rank
            arrays = _core.build_pairwise_plan(source.core, destination.core, codes, domain_size, bucket_bytes, at)
        else:
            arrays = _core.build_plan(source.core, destination.core, codes, domain_size, bucket_bytes)
    except _core.CoreError as err:
        raise LayoutValueError.from_core(err, names, destination.span) from None
    choice = _quantize_choice(source, destination, arrays, per_tensor, mode, quantize_at, topology)
    plan = Plan(
        source,
        destination,
        name or f"{source.name}->{destination.name}",
        per_tensor,
        domain_size,
        bucket_bytes,
        arrays,
        mode=mode,
        rank=rank,
        quantize_at=choice.at,
        quantize_reason=choice.reason,
    )
    if choice.regions is not None:  # what the cost model weighed: the plan's, not computed again
        plan._derived.quantization = [choice.regions]
    return plan


def _quantize_choice(
    source: Layout,
    destination: Layout,
    arrays: _core.PlanArrays,
    policies: Sequence[str],
    mode: str,
    asked: str,
    topology: Topology | None,
) -> QuantizeChoice:
    """Where a plan into a quantized destination quantizes, and why."""
    if not destination.quantized():
        return QuantizeChoice("source", "")
    if asked != "auto":
        side = "senders" if asked == "source" else "destinations"
        return QuantizeChoice(asked, f"the {side} quantize: asked for (quantize_at='{asked}')")
    if mode == "pairwise":
        return QuantizeChoice(
            "source", "the senders quantize: a pairwise plan cannot weigh the whole fleet's bytes (quantize_at='auto')"
        )
    return choose_quantize_at(source, destination, arrays, policies, topology or Topology(domain_size=1))


def _plan_mode(
    source: Layout,
    destination: Layout,
    names: Sequence[str],
    policies: Sequence[str],
    mode: str | None,
    rank: int | None,
) -> str:
    """The plan mode asked for (``pairwise`` for a per-rank plan), checked against the
    policies and the rank."""
    if mode is None:
        mode = "fleet" if rank is None else "pairwise"
    if mode not in PLAN_MODES:
        raise LayoutValueError(f"unknown plan mode '{mode}' (one of: {', '.join(PLAN_MODES)})")
    if rank is not None:
        if mode != "pairwise":
            raise LayoutValueError(f"a plan of one rank (rank {rank}) is a pairwise plan, not a '{mode}' one")
        if rank not in source.mesh and rank not in destination.mesh:
            raise LayoutValueError(
                f"rank {rank} belongs to neither mesh of the plan ('{source.name}': ranks "
                f"{rank_ranges(source.mesh.ranks)}, '{destination.name}': ranks {rank_ranges(destination.mesh.ranks)})",
                destination.span,
            )
    if mode == "pairwise":
        other = [(n, p) for n, p in zip(names, policies) if p != "reshard"]
        if other:
            listed = ", ".join(f"'{n}' ({p})" for n, p in other[:3]) + (", ..." if len(other) > 3 else "")
            raise LayoutValueError(
                f"per-rank (pairwise) plans move tensors by the reshard policy only; {listed} "
                f"{'has' if len(other) == 1 else 'have'} another",
                destination.span,
                "use the whole-fleet plan (mode='fleet') for gather-and-broadcast",
            )
    return mode


def _in_order(layout: Layout, names: Sequence[str]) -> Layout:
    """``layout`` with its tensors in the order of ``names`` (the core numbers tensors by
    declaration order, so every layout of one plan must declare them alike)."""
    if list(layout.tensors) == list(names):
        return layout
    ordered = {name: layout.tensors[name] for name in names}
    return Layout(
        layout.name, layout.mesh, ordered, layout.rules, layout.storages, layout.span, quantize=layout.quantize
    )


def plan_recovery(
    sources: Sequence[Layout],
    destination: Layout,
    lost: Iterable[int],
    *,
    name: str | None = None,
    domain_size: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Plan:
    """Compile a recovery plan: ``destination`` from the surviving ranks of ``sources``.

    Each region of the destination is read from the first layout of ``sources`` that holds
    it on a rank not in ``lost`` (e.g. the inference replicas that survived, then the
    training side), within it as :func:`plan_layouts` would (local copy, then the same
    domain, then the least loaded rank over the network, once per domain). Every tensor
    moves by exact overlap. Source storages are passed apart from destination storages, so
    a rank may hold storages of the same name in a source and in the destination.

    Raises :class:`LayoutValueError` when a lost rank is in ``destination``, and
    :class:`~layoutlang.errors.DataLossError` (a :class:`~layoutlang.errors.RuntimeFailure`) when a
    region has no surviving copy in any source: its message lists every lost tensor and box.

    >>> import layoutlang
    >>> p = layoutlang.loads('''
    ... mesh infer [dp = 2, tp = 2]
    ... mesh regrown_mesh [dp = 2, tp = 2] on ranks [0, 1, 4, 3]
    ... tensor "w" [8, 4] fp32
    ... layout serve on infer { "w": tp = shard(0) }
    ... layout regrown on regrown_mesh { "w": tp = shard(0) }
    ... ''')
    >>> plan = plan_recovery([p.layouts["serve"]], p.layouts["regrown"], lost={2})
    >>> sorted((m.src, m.dst, m.kind) for m in plan.moves())
    [(0, 0, 'local'), (0, 4, 'network'), (1, 1, 'local'), (3, 3, 'local')]
    """
    sources, destination, lost_ranks, arrays = _recovery_arrays(sources, destination, lost, domain_size, bucket_bytes)
    return Plan(
        sources[0],
        destination,
        name or f"recover {destination.name} from {', '.join(layout.name for layout in sources)}",
        ("reshard",) * len(destination.tensors),
        domain_size,
        bucket_bytes,
        arrays,
        sources=sources,
        lost=lost_ranks,
    )


def _recovery_arrays(
    sources: Sequence[Layout],
    destination: Layout,
    lost: Iterable[int],
    domain_size: int,
    bucket_bytes: int,
    fill: Sequence[int] | None = None,
) -> tuple[list[Layout], Layout, list[int], Any]:
    """The checks and the core's moves of a recovery plan (of the ``fill`` ranks, or of every
    destination rank): the sources and destination in one tensor order, the lost ranks."""
    sources = list(sources)
    if not sources:
        raise LayoutValueError("a recovery plan needs at least one source layout")
    lost_ranks = sorted({int(r) for r in lost})
    for source in sources:
        _check_pair(source, destination, storages=False)
    in_destination = sorted(set(lost_ranks) & set(destination.mesh.ranks))
    if in_destination:
        raise LayoutValueError(
            f"lost rank{'s' if len(in_destination) > 1 else ''} {', '.join(map(str, in_destination))} "
            f"still belong{'s' if len(in_destination) == 1 else ''} to the destination layout '{destination.name}'",
            destination.span,
            "remesh the destination first (elastic.remesh)",
        )
    check_recoverable(sources, lost_ranks)  # never silent loss: names every lost box
    if bucket_bytes < 1:
        raise LayoutValueError(f"the bucket budget must be at least 1 byte, not {bucket_bytes}")
    if domain_size < 1:
        raise LayoutValueError(f"the domain size must be at least 1, not {domain_size}")
    check_quantized_plan(sources, destination, recovery=True)
    names = list(sources[0].tensors)
    sources = [_in_order(layout, names) for layout in sources]
    destination = _in_order(destination, names)
    extra = {} if fill is None else {"fill": list(fill)}
    try:
        arrays = _core.build_recovery_plan(
            [layout.core for layout in sources], lost_ranks, destination.core, domain_size, bucket_bytes, **extra
        )
    except _core.CoreError as err:
        raise LayoutValueError.from_core(err, sources[0].resolved.names, destination.span) from None
    return sources, destination, lost_ranks, arrays


def compile_plan(
    program: Program,
    reshard: str | Reshard | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    policy: str | None = None,
    mode: str | None = None,
    rank: int | None = None,
    quantize_at: str = "auto",
) -> Plan:
    """Compile the plan of a ``reshard`` statement (the only one when ``reshard`` is None).

    Each tensor takes its policy from the statement (``broadcast`` rules); ``policy``
    overrides them all, e.g. ``policy="broadcast"`` for the gather-and-broadcast baseline.
    ``mode`` and ``rank`` ask for a pairwise or a per-rank plan, and ``quantize_at`` where a
    quantized destination's regions are quantized (weighed against the program's topology),
    as in :func:`plan_layouts`.
    """
    statement = reshard if isinstance(reshard, Reshard) else program.reshard(reshard)
    source = program.layout(statement.source)
    destination = program.layout(statement.destination)
    if policy is not None:
        if policy not in POLICIES:
            raise LayoutValueError(f"unknown policy '{policy}' (one of: {', '.join(POLICIES)})")
        policies: Sequence[str] | str = policy
    else:
        policies = [statement.policy_for(name) for name in source.resolved.names]
    try:
        return plan_layouts(
            source,
            destination,
            name=statement.name,
            domain_size=program.topology.domain_size,
            bucket_bytes=bucket_bytes,
            policies=policies,
            mode=mode,
            rank=rank,
            quantize_at=quantize_at,
            topology=program.topology,
        )
    except LayoutError as err:
        err.with_span(statement.span)  # found deep down: it gets the statement's place
        raise
