"""Plans: the moves that turn a source layout into a destination layout.

A :class:`Plan` is pure data compiled by the C++ core (:func:`compile_plan`) and never
changed afterwards. Naming, as everywhere in layoutlang:

- a **region** is a box of one logical tensor that moves as a unit;
- a **move** is one transfer of one region between two ranks: ``local`` (the same rank),
  ``domain`` (the same domain: NVLink) or ``network`` (across domains); a **relay** is a
  domain move that forwards a region its rank received in an earlier stage;
- a **stage** orders moves inside a bucket: relays run after the network stage that feeds
  them; gather-and-broadcast runs gather (0), broadcast (1, 2) and extraction (3);
- a **bucket** is a group of moves executed together; no rank stages more than the
  bucket budget of bytes in one bucket;
- a move reads from and writes to a **space** of its rank: the ``source`` storage, the
  ``destination`` storage, or a ``scratch`` buffer holding a whole tensor (gather-and-broadcast).

Every rank computes the same plan from the same program, without communication; the
plan's :attr:`~Plan.fingerprint` lets ranks compare plans before moving a byte.
"""

from .compile import compile_plan, plan_layouts, plan_recovery
from .data import DEFAULT_BUCKET_BYTES, KINDS, POLICIES, SPACES, Move, Plan, PlanStats
from .loss import check_recoverable, lost_regions
from .serialize import load_plan

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "KINDS",
    "POLICIES",
    "SPACES",
    "Move",
    "Plan",
    "PlanStats",
    "check_recoverable",
    "compile_plan",
    "load_plan",
    "lost_regions",
    "plan_layouts",
    "plan_recovery",
]
