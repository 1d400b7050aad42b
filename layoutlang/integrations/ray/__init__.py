"""layoutlang on Ray: ranks of a refit as Ray actors, found through a named rendezvous actor.

- :mod:`.rendezvous`: the job's :class:`Rendezvous` actor (its store, secret and
  membership), and :func:`join`, which a rank calls to build the job's gloo group with no
  address or port set by hand; the trust model is in its module doc.
- :mod:`.workers`: :class:`LayoutlangRank`, the mixin that makes an actor class a rank (a
  source or a destination), and :class:`RayWorkers`, the worker pool of
  ``layoutlang apply --ray`` (the local launcher's interface, on Ray actors).

Importing this package imports Ray (install ``layoutlang[ray]``); the ranks import torch.
"""

from .rendezvous import NAMESPACE, Contact, Rendezvous, join, rendezvous_name, start_rendezvous
from .workers import LayoutlangRank, RayWorkers, domain_size_of

__all__ = [
    "NAMESPACE",
    "Contact",
    "LayoutlangRank",
    "RayWorkers",
    "Rendezvous",
    "domain_size_of",
    "join",
    "rendezvous_name",
    "start_rendezvous",
]
