"""Recovery plans of the ranks that changed: after a membership change, only some ranks of
the new destination hold boxes they did not hold before (a spare in a lost rank's place);
the others keep their storages. A :class:`RefillPlan` fills those ranks alone, so its
length is what they need, not the whole destination: on DeepSeek-V3 (45,395 tensors, 256
inference ranks) a spare's plan has 45,395 moves where the plan of the whole destination
has 11.6 million, most of them ranks copying their own storages onto themselves.

Which ranks changed is :func:`layoutlang.plan.loss.same_holdings`; the plan is
:func:`plan_refill`, compiled by the C++ core like :func:`~layoutlang.plan.plan_recovery`
(each region from the first source layout that holds it on a surviving rank), with the
destination ranks to fill.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from ..core import _core
from ..errors import LayoutValueError, core_errors
from ..model import Layout
from .compile import _recovery_arrays
from .data import DEFAULT_BUCKET_BYTES, Plan, _ranks

__all__ = ["RefillPlan", "plan_refill"]


@attrs.frozen(eq=False)
class RefillPlan(Plan):
    """A recovery plan that writes only the destination ranks in ``filled``.

    Everything else is as in any recovery plan (several sources in order of preference,
    no lost rank touched); :meth:`validate` checks that every destination byte of the
    ``filled`` ranks is written exactly once and nothing is written on any other rank.
    """

    filled: frozenset[int] = attrs.field(kw_only=True, converter=_ranks, factory=frozenset)

    @property
    def is_recovery(self) -> bool:
        return True

    def validate(self) -> None:
        """Raises LayoutValueError unless every destination byte of the filled ranks is
        written exactly once, nothing else is written, every read lies in what its rank
        holds in the move's source layout, and no move touches a lost rank."""
        with core_errors(self.tensors):
            problems = _core.validate_recovery_plan(
                self.arrays,
                [layout.core for layout in self.sources],
                sorted(self.lost),
                self.destination.core,
                self.domain_size,
                self.bucket_bytes,
                fill=sorted(self.filled),
            )
        if problems:
            raise LayoutValueError(f"plan '{self.name}' is invalid: " + "; ".join(problems))


def plan_refill(
    sources: Sequence[Layout],
    destination: Layout,
    lost: Iterable[int],
    fill: Iterable[int],
    *,
    name: str | None = None,
    domain_size: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> RefillPlan:
    """Compile the recovery plan of the ``fill`` ranks of ``destination`` from the surviving
    ranks of ``sources`` (in order of preference), as :func:`~layoutlang.plan.plan_recovery`
    does for the whole destination.

    Raises :class:`LayoutValueError` when a lost rank is in ``destination`` or a rank to
    fill is not, and :class:`~layoutlang.errors.DataLossError` when a region has no
    surviving copy in any source.

    >>> import layoutlang
    >>> from layoutlang.plan.loss import same_holdings
    >>> p = layoutlang.loads('''
    ... mesh infer [dp = 2, tp = 2]
    ... mesh regrown_mesh [dp = 2, tp = 2] on ranks [0, 1, 4, 3]
    ... tensor "w" [8, 4] fp32
    ... layout serve on infer { "w": tp = shard(0) }
    ... layout regrown on regrown_mesh { "w": tp = shard(0) }
    ... ''')
    >>> serve, regrown = p.layouts["serve"], p.layouts["regrown"]
    >>> ranks = regrown.mesh.ranks
    >>> changed = [r for r, same in zip(ranks, same_holdings(serve, regrown, ranks)) if not same]
    >>> changed
    [4]
    >>> plan = plan_refill([serve], regrown, lost={2}, fill=changed)
    >>> [(m.src, m.dst, m.kind) for m in plan.moves()]
    [(0, 4, 'network')]
    >>> plan.validate()
    """
    fill_ranks = sorted({int(r) for r in fill})
    outside = [r for r in fill_ranks if r not in destination.mesh]
    if outside:
        raise LayoutValueError(
            f"rank{'s' if len(outside) > 1 else ''} {', '.join(map(str, outside))} to be filled "
            f"{'are' if len(outside) > 1 else 'is'} not in the destination layout '{destination.name}'",
            destination.span,
        )
    sources, destination, lost_ranks, arrays = _recovery_arrays(
        sources, destination, lost, domain_size, bucket_bytes, fill=fill_ranks
    )
    return RefillPlan(
        sources[0],
        destination,
        name or f"refill ranks {', '.join(map(str, fill_ranks))} of {destination.name}",
        ("reshard",) * len(destination.tensors),
        domain_size,
        bucket_bytes,
        arrays,
        sources=sources,
        lost=lost_ranks,
        filled=fill_ranks,
    )
