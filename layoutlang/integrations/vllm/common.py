"""What the trainer side and the worker side of the vLLM engine share: the wire types and
the program both compile."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...errors import LayoutValueError
from ...lang import load, loads
from ...model import Layout, Program, Reshard

__all__ = ["BACKEND", "RefitProgram", "WorkerInitFields", "first_of"]

#: the name layoutlang registers under in vLLM's weight-transfer factories
BACKEND = "layoutlang"


@dataclass(kw_only=True)
class WorkerInitFields:
    """The fields of the worker-side init info (plain JSON, so every control plane carries it)."""

    master_address: str
    master_port: int
    #: the program's text; a worker that sees ``program_path`` reads that file instead
    program: str
    program_path: str | None = None
    reshard: str | None = None
    #: the first program rank of this engine's workers
    rank_offset: int
    world_size: int
    timeout: float = 300.0
    group_name: str = "layoutlang-refit"
    #: the destination layout names checkpoint tensors, not the engine's parameters: every
    #: storage goes through load_weights (vLLM's own path for whole tensors, as its NCCL
    #: engine takes it); for comparisons, and for engines layoutlang has no preset of
    checkpoint_format: bool = False


class RefitProgram:
    """The program of a refit, its reshard and both layouts."""

    def __init__(self, text: str, path: str | None, reshard: str | None):
        self.program: Program = load(path) if path and os.path.isfile(path) else loads(text, path or "<refit>")
        self.reshard: Reshard = self.program.reshard(reshard)
        self.source: Layout = self.program.layout(self.reshard.source)
        self.destination: Layout = self.program.layout(self.reshard.destination)

    def world_size(self) -> int:
        """Ranks ``0 .. N - 1`` of the refit group: every one must be in a mesh of the reshard."""
        ranks = set(self.source.mesh.ranks) | set(self.destination.mesh.ranks)
        world = max(ranks) + 1
        missing = sorted(set(range(world)) - ranks)
        if missing:
            raise LayoutValueError(
                f"ranks {missing[:8]} of the refit group 0..{world - 1} belong to no mesh of reshard "
                f"'{self.reshard.name}': number the trainer's ranks 0.. and the engines' after them"
            )
        return world


def first_of(problems: list[str]) -> str | None:
    """The first problem and how many more: what one rank tells the others in the agreement."""
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
