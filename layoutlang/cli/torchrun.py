"""Whether torchrun started this process: then torchrun starts the workers, not the local
launcher. Its own module, without torch, so that every command can ask before importing it."""

from __future__ import annotations

import os

__all__ = ["environment_is_torchrun"]


def environment_is_torchrun() -> bool:
    """Whether this process's rank, world size and store address are set, as torchrun sets them."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
