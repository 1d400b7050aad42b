"""The transport interface: what the executor needs to move buffers between ranks.

A transport moves buffers and knows nothing of plans, layouts or the language.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Pending(Protocol):
    def wait(self, timeout: float) -> None: ...


class Transport(Protocol):
    """Moves buffers between program ranks; knows nothing about plans or layouts."""

    rank: int

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int) -> Pending:
        """Post every receive and send at once; the returned handle's ``wait`` completes them."""
        ...
