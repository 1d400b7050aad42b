"""Property tests of the plan compiler over generated ``.layout`` programs.

A hypothesis strategy writes whole programs as text: a topology (domain size 1-4), a source
and a destination mesh of 1-3 small axes on disjoint or overlapping (colocated) ranks,
logical tensors of 1-4 dims with small uneven sizes (often smaller than the number of
shards), and two layouts using every placement the language has: ``shard``/``replicate``,
one dim sharded by two axes (nested in mesh-axis order, or in an explicit order
``(a, b) = shard(d)``), the ``blocks``/``chunks``/``pad`` options, pipeline stages
``pp[l // k]`` over generated tensors ``"t.{l}"``, fused storages ``"s" = "a" | "b"``
(concatenated or interleaved with ``blocks(...)``) and wholly replicated sides.

For each program, the reshard plan and the gather-and-broadcast plan are checked:

- ``Plan.validate()`` accepts both;
- an independent executor (numpy buffers for every storage of every rank, filled from
  ``Layout.boxes`` and moved with ``Plan.place``, stage by stage, reads before writes)
  leaves every destination storage holding exactly its boxes;
- for ``reshard``: moved bytes equal the lower bound exactly, and the lower bound equals the
  one recomputed here from the boxes;
- every element crosses the network once per destination domain that needs it and holds
  no source copy of it (``reshard``), and once per receiving domain other than the root's
  (``broadcast``), never more often than plain point-to-point would send it;
- no region is larger than the bucket, and no rank stages more than the bucket in one bucket;
- compiling the same program twice gives byte-identical plans.

Generated programs the language rejects (e.g. fused storages whose parts do not fit) are
filtered with ``assume``. Runs are derandomized so CI is deterministic.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import layoutlang
from layoutlang.plan import compile_plan, load_plan, plan_layouts

pytestmark = pytest.mark.timeout(300)

PROPERTY = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

DTYPES = {"bf16": 2, "fp32": 4, "int8": 1, "fp64": 8}
AXIS_NAMES = ("pp", "dp", "tp")

# Buckets of at least the largest itemsize (a bucket smaller than one element is covered in
# tests/test_plan.py): no slabs, or slabs of a few elements.
BUCKETS = st.one_of(st.just(1 << 20), st.integers(8, 160))


# ----------------------------------------------------------------------- the generator


@st.composite
def mesh_axes(draw) -> list[tuple[str, int]]:
    """1-3 axes of size 1-3 (at most 8 positions), named from pp, dp, tp in mesh order."""
    n = draw(st.integers(1, 3))
    names = (
        list(AXIS_NAMES[3 - n :]) if draw(st.booleans()) else draw(st.permutations(AXIS_NAMES))[:n]
    )
    sizes, positions = [], 1
    for _ in range(n):
        sizes.append(draw(st.integers(1, min(3, 8 // positions))))
        positions *= sizes[-1]
    return list(zip(names, sizes))


@st.composite
def placement(
    draw, axes: list[tuple[str, int]], ndim: int, fixed: frozenset[str] = frozenset()
) -> list[str]:
    """Rule entries: per free axis, replicate (no entry) or shard(dim) with options; axes
    sharding one dim nest in mesh-axis order or, sometimes, in an explicit order."""
    free = [(a, s) for a, s in axes if a not in fixed]
    dims: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for axis, size in free:
        if draw(st.integers(0, 2)) > 0:  # shard two times out of three
            dims[draw(st.integers(0, ndim - 1))].append((axis, size))
    entries = []
    for dim, sharding in sorted(dims.items()):
        pad = draw(st.sampled_from([1, 1, 2, 3]))
        pad_opt = [f"pad = {pad}"] if pad > 1 else []
        if len(sharding) > 1 and draw(st.booleans()):
            order = draw(st.permutations([a for a, _ in sharding]))
            opts = "".join(", " + o for o in pad_opt)
            entries.append(f"({', '.join(order)}) = shard({dim}{opts})")
            continue
        for axis, size in sharding:
            opts = list(pad_opt)
            divisors = [c for c in range(1, size) if size % c == 0]
            if divisors and draw(st.integers(0, 3)) == 0:
                opts.append(f"chunks = {draw(st.sampled_from(divisors))}")
            if draw(st.integers(0, 3)) == 0:
                opts.append(f"blocks = {draw(st.integers(2, 3))}")
            written_dim = dim - ndim if draw(st.integers(0, 5)) == 0 else dim  # shard(-1) form
            entries.append(f"{axis} = shard({written_dim}{''.join(', ' + o for o in opts)})")
    return entries


@st.composite
def programs(draw):
    """(program text, bucket bytes) for a random reshard."""
    domain_size = draw(st.integers(1, 4))
    src_axes, dst_axes = draw(mesh_axes()), draw(mesh_axes())
    n_src = int(np.prod([s for _, s in src_axes]))
    n_dst = int(np.prod([s for _, s in dst_axes]))
    pool = max(n_src, n_dst) + draw(st.integers(0, 3))
    src_ranks = draw(st.permutations(range(pool)))[:n_src]
    if draw(st.booleans()):  # colocated: the meshes share ranks
        dst_ranks = draw(st.permutations(range(pool)))[:n_dst]
    else:  # separate fleets
        start = pool + draw(st.integers(0, 3))
        dst_ranks = [start + r for r in draw(st.permutations(range(n_dst)))]

    # logical tensors: plain ones, a fusable pair, pipeline-stage ones
    tensors: list[tuple[str, list[int], str]] = []
    for i in range(draw(st.integers(0, 2))):
        ndim = draw(st.integers(1, 4))
        shape = draw(st.lists(st.integers(1, 7 if ndim <= 2 else 4), min_size=ndim, max_size=ndim))
        tensors.append((f"w{i}", shape, draw(st.sampled_from(sorted(DTYPES)))))
    fused = draw(st.booleans())
    if fused:
        ndim = draw(st.integers(1, 3))
        shape = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
        ratio = draw(st.sampled_from([1, 1, 2]))
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        tensors.append(("f.a", [shape[0] * ratio, *shape[1:]], dtype))
        tensors.append(("f.b", shape, dtype))
    stages = draw(st.integers(0 if tensors else 1, 4))
    stage_shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=2))
    stage_dtype = draw(st.sampled_from(sorted(DTYPES)))

    def layout(name: str, mesh: str, axes: list[tuple[str, int]]) -> str:
        if draw(st.integers(0, 5)) == 5:  # a wholly replicated side
            return f"layout {name} on {mesh} {{ default: replicate }}"
        lines = []
        for tname, shape, _ in tensors:
            if tname == "f.b":
                continue  # takes the rule of f.a (same placement, so the parts fit)
            pattern = "f.*" if tname == "f.a" else tname
            if draw(st.integers(0, 4)) == 0:  # on a sub-mesh: one coordinate fixed, like an expert
                axis, size = draw(st.sampled_from(axes))
                body = [f"{axis}[{draw(st.integers(0, size - 1))}]"]
                body += draw(placement(axes, len(shape), frozenset({axis})))
            else:
                body = draw(placement(axes, len(shape)))
            lines.append(f'"{pattern}": {", ".join(body) or "replicate"}')
        if stages:
            stage_axis, stage_size = axes[0]
            if draw(st.booleans()):
                per = -(-stages // stage_size)  # stage of layer l is l // per < stage_size
                rest = draw(placement(axes, len(stage_shape), frozenset({stage_axis})))
                body = [f"{stage_axis}[l // {per}]", *rest]
            else:
                body = draw(placement(axes, len(stage_shape))) or ["replicate"]
            lines.append(f'"t.{{l}}": {", ".join(body)}')
        if fused and draw(st.booleans()):
            along = (
                draw(st.integers(0, len(tensors[-1][1]) - 1))
                if tensors[-1][1][0] == tensors[-2][1][0]
                else 0
            )
            ratio = tensors[-2][1][0] // tensors[-1][1][0] if along == 0 else 1
            decl = f'storage "{name}.f.ab" = "f.a" | "f.b"'
            if along:
                decl += f" along {along}"
            if draw(st.booleans()):
                block = draw(st.integers(1, 2))
                decl += f" blocks({ratio * block}, {block})"
            lines.append(decl)
        return f"layout {name} on {mesh} {{\n    " + "\n    ".join(lines) + "\n}"

    text = "\n".join(
        [
            f"topology {{ domain_size = {domain_size} }}",
            f"mesh src [{', '.join(f'{a} = {s}' for a, s in src_axes)}] on ranks [{', '.join(map(str, src_ranks))}]",
            f"mesh dst [{', '.join(f'{a} = {s}' for a, s in dst_axes)}] on ranks [{', '.join(map(str, dst_ranks))}]",
            *(f'tensor "{n}" [{", ".join(map(str, s))}] {d}' for n, s, d in tensors),
            *(
                [
                    f'tensor "t.{{l}}" [{", ".join(map(str, stage_shape))}] {stage_dtype} for l in 0..{stages - 1}'
                ]
                if stages
                else []
            ),
            layout("S", "src", src_axes),
            layout("D", "dst", dst_axes),
            "reshard S -> D",
        ]
    )
    return text, draw(BUCKETS)


def load_or_reject(text: str) -> layoutlang.Program:
    """The program, or ``assume(False)`` when the language rejects what was generated."""
    try:
        program = layoutlang.loads(text)
        program.check()
        # planning refuses what check() cannot see: storages conflicting on a shared rank
        compile_plan(program, bucket_bytes=1 << 20)
    except layoutlang.LayoutError:
        assume(False)
    return program


# ------------------------------------------------------------------ independent checks


def global_values(layout: layoutlang.Layout) -> dict[str, np.ndarray]:
    """A distinct positive integer for every element of every logical tensor."""
    out, base = {}, 1
    for name, tensor in layout.tensors.items():
        n = int(np.prod(tensor.shape, dtype=np.int64))
        out[name] = (base + np.arange(n, dtype=np.int64)).reshape(tensor.shape)
        base += max(n, 1)
    return out


def storages(layout: layoutlang.Layout, values: dict[str, np.ndarray], filled: bool):
    """Per rank, storage name -> buffer: filled with its boxes (or -1) and the mask of box elements."""
    buffers, masks = {}, {}
    for rank in layout.mesh.ranks:
        shapes = layout.storages_on(rank)
        buffers[rank] = {n: np.full(s, -1, np.int64) for n, s in shapes.items()}
        masks[rank] = {n: np.zeros(s, bool) for n, s in shapes.items()}
        for tensor in layout.tensors:
            for box in layout.boxes(tensor, rank):
                masks[rank][box.storage][box.storage_slices()] = True
                if filled:
                    buffers[rank][box.storage][box.storage_slices()] = values[tensor][box.slices()]
    return buffers, masks


def execute(plan) -> None:
    """Runs the plan on numpy buffers and checks every destination storage element by element.

    Moves run in (bucket, stage) order; within one (bucket, stage) every read happens before
    any write, so a move that depends on another of the same step reads stale data and fails.
    """
    values = global_values(plan.source)
    source, _ = storages(plan.source, values, filled=True)
    destination, _ = storages(plan.destination, values, filled=False)
    expected, masks = storages(plan.destination, values, filled=True)
    scratch: dict[int, dict[str, np.ndarray]] = defaultdict(dict)
    order = sorted(plan.moves(), key=lambda m: (m.bucket, m.stage, m.index))
    for _, step in itertools.groupby(order, key=lambda m: (m.bucket, m.stage)):
        staged = []
        for move in step:
            (src_name, src_at), (dst_name, dst_at) = plan.place(move)
            if move.src_space == "scratch":
                buffer = scratch[move.src][move.tensor]
            else:
                buffer = (source if move.src_space == "source" else destination)[move.src][src_name]
            data = buffer[tuple(slice(o, o + s) for o, s in zip(src_at, move.sizes))].copy()
            assert data.shape == move.sizes, f"{move}: read {data.shape} from {src_name}{src_at}"
            assert (data >= 0).all(), f"{move} reads bytes nobody delivered"
            staged.append((move, dst_name, dst_at, data))
        for move, dst_name, dst_at, data in staged:
            if move.dst_space == "scratch":
                shape = plan.source.tensors[move.tensor].shape
                buffer = scratch[move.dst].setdefault(move.tensor, np.full(shape, -1, np.int64))
            else:
                buffer = destination[move.dst][dst_name]
            index = tuple(slice(o, o + s) for o, s in zip(dst_at, move.sizes))
            assert buffer[index].shape == move.sizes, f"{move}: writes outside {dst_name}"
            buffer[index] = data
    for rank, buffers in destination.items():
        for name, buffer in buffers.items():
            mask = masks[rank][name]
            assert np.array_equal(buffer[mask], expected[rank][name][mask]), (
                f"rank {rank} storage {name}"
            )


def holdings(layout: layoutlang.Layout, tensor: str) -> dict[int, np.ndarray]:
    """Per rank of the mesh, the mask of the tensor's elements it holds."""
    shape = layout.tensors[tensor].shape
    out = {}
    for rank in layout.mesh.ranks:
        mask = np.zeros(shape, bool)
        for box in layout.boxes(tensor, rank):
            mask[box.slices()] = True
        out[rank] = mask
    return out


def lower_bound(plan) -> int:
    """Bytes each destination rank holds and does not hold as a source, from the boxes."""
    total = 0
    for name, tensor in plan.source.tensors.items():
        src = holdings(plan.source, name)
        for rank, need in holdings(plan.destination, name).items():
            own = src.get(rank, np.zeros_like(need))
            total += int((need & ~own).sum()) * DTYPES[tensor.dtype]
    return total


def network_crossings(plan) -> dict[str, np.ndarray]:
    """Per tensor, per destination domain (axis 0): how often each element crosses the network."""
    domains = sorted({r // plan.domain_size for r in plan.destination.mesh.ranks})
    index = {d: i for i, d in enumerate(domains)}
    out = {
        name: np.zeros((len(domains), *t.shape), np.int64)
        for name, t in plan.source.tensors.items()
    }
    for move in plan.moves():
        if move.kind == "network":
            region = tuple(slice(o, o + s) for o, s in zip(move.offsets, move.sizes))
            out[move.tensor][(index[move.dst // plan.domain_size], *region)] += 1
    return out


def check_buckets(plan) -> None:
    """No region exceeds the bucket; no rank stages more than the bucket in one bucket."""
    staged: dict[tuple[int, int], int] = defaultdict(int)
    for move in plan.moves():
        assert move.nbytes <= plan.bucket_bytes, str(move)
        assert (
            move.nbytes == int(np.prod(move.sizes)) * DTYPES[plan.source.tensors[move.tensor].dtype]
        )
        if move.kind != "local":
            staged[move.bucket, move.src] += move.nbytes
            staged[move.bucket, move.dst] += move.nbytes
    assert all(v <= plan.bucket_bytes for v in staged.values()), max(staged.values())
    assert plan.num_buckets == (1 + max((m.bucket for m in plan.moves()), default=-1))


# ------------------------------------------------------------------------- properties


@PROPERTY
@given(programs())
def test_reshard_plan_is_valid_exact_minimal_and_routes_once_per_domain(case):
    """validate() holds; executing the plan fills every destination storage exactly; moved
    bytes == lower bound (== the bound recomputed from boxes); each element crosses the
    network once per destination domain that needs it and has no source copy of it."""
    text, bucket = case
    program = load_or_reject(text)
    plan = compile_plan(program, bucket_bytes=bucket)
    plan.validate()
    execute(plan)
    check_buckets(plan)
    stats = plan.stats
    assert stats.moved == stats.lower_bound == lower_bound(plan), text
    assert stats.bytes["local"] + stats.moved == sum(
        int(h.sum()) * DTYPES[t.dtype]
        for name, t in program.tensors.items()
        for h in holdings(plan.destination, name).values()
    )
    size = plan.domain_size
    crossings = network_crossings(plan)
    domains = sorted({r // size for r in plan.destination.mesh.ranks})
    for name in program.tensors:
        src, dst = holdings(plan.source, name), holdings(plan.destination, name)
        for i, domain in enumerate(domains):
            need = np.logical_or.reduce([m for r, m in dst.items() if r // size == domain])
            near = [m for r, m in src.items() if r // size == domain]
            have = np.logical_or.reduce(near) if near else np.zeros_like(need)
            assert np.array_equal(crossings[name][i], (need & ~have).astype(np.int64)), (
                name,
                domain,
                text,
            )
    # relays are domain moves at stage 1 that read the destination space
    for move in plan.moves():
        assert move.stage == (1 if move.is_relay else 0)
        assert not move.is_relay or move.kind == "domain"


@PROPERTY
@given(programs())
def test_broadcast_plan_is_valid_and_sends_each_tensor_once_per_receiving_domain(case):
    """The gather-and-broadcast plan validates and executes exactly; every element crosses the
    network once per domain of its tensor's receivers (other than the domain of the root it
    was gathered on: one per part, a tensor above half a bucket being broadcast in parts);
    its payload is twice the bytes of every tensor some destination rank holds a part of."""
    text, bucket = case
    program = load_or_reject(text)
    plan = compile_plan(program, bucket_bytes=bucket, policy="broadcast")
    plan.validate()
    execute(plan)
    check_buckets(plan)
    size = plan.domain_size
    payload = 0
    for name, tensor in program.tensors.items():
        receivers = [r for r, m in holdings(plan.destination, name).items() if m.any()]
        moves = list(plan.moves(name))
        if not receivers:
            assert not moves
            continue
        payload += 2 * tensor.nbytes
        root_of = np.full(tensor.shape, -1, np.int64)  # the rank each element is gathered on
        for move in moves:
            if move.stage == 0:
                box = tuple(slice(o, o + s) for o, s in zip(move.offsets, move.sizes))
                assert (root_of[box] == -1).all(), (name, "gathered twice")
                root_of[box] = move.dst
        assert (root_of >= 0).all(), name
        assert set(np.unique(root_of).tolist()) <= set(plan.source.holders(name))
        crossed = np.zeros((max(receivers) // size + 1, *tensor.shape), np.int64)
        for move in moves:
            if move.kind == "network" and move.stage > 0:  # the broadcast, not the gather
                box = tuple(slice(o, o + s) for o, s in zip(move.offsets, move.sizes))
                assert move.stage == 1 and (root_of[box] == move.src).all()
                crossed[(move.dst // size, *box)] += 1
        for domain in {r // size for r in receivers}:
            assert (crossed[domain] == (root_of // size != domain)).all(), (name, domain)
    assert plan.stats.broadcast_payload == payload


@PROPERTY
@given(programs())
def test_compiling_twice_gives_identical_bytes_and_round_trips(case):
    """The same program compiled twice (and parsed twice) gives byte-identical plans, and
    the binary form reads back to the same plan."""
    text, bucket = case
    program = load_or_reject(text)
    first = compile_plan(program, bucket_bytes=bucket)
    second = compile_plan(layoutlang.loads(text), bucket_bytes=bucket)
    assert first.to_bytes() == second.to_bytes()
    assert first.fingerprint == second.fingerprint
    again = load_plan(first.to_bytes(), program)
    assert again.fingerprint == first.fingerprint
    broadcast = compile_plan(program, bucket_bytes=bucket, policy="broadcast")
    assert (
        broadcast.to_bytes()
        == compile_plan(program, bucket_bytes=bucket, policy="broadcast").to_bytes()
    )


@PROPERTY
@given(programs(), st.data())
def test_mixed_policies_per_tensor_give_a_valid_exact_hybrid_plan(case, data):
    """Some tensors resharded, others gathered and broadcast, in one plan: it validates and
    executes exactly; scratch is used by broadcast tensors only; the payload counts only the
    broadcast tensors some destination rank holds a part of."""
    text, bucket = case
    program = load_or_reject(text)
    source, destination = program.layout("S"), program.layout("D")
    names = source.resolved.names
    policies = data.draw(
        st.lists(
            st.sampled_from(["reshard", "broadcast"]), min_size=len(names), max_size=len(names)
        )
    )
    plan = plan_layouts(
        source,
        destination,
        domain_size=program.topology.domain_size,
        bucket_bytes=bucket,
        policies=policies,
    )
    plan.validate()
    execute(plan)
    check_buckets(plan)
    policy = dict(zip(names, policies))
    for move in plan.moves():
        if policy[move.tensor] == "reshard":
            assert "scratch" not in (move.src_space, move.dst_space), str(move)
    payload = sum(
        2 * program.tensors[n].nbytes
        for n in names
        if policy[n] == "broadcast" and any(m.any() for m in holdings(destination, n).values())
    )
    assert plan.stats.broadcast_payload == payload
