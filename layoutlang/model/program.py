"""Programs: the meshes, tensors, layouts and reshard statements of one ``.layout`` source."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping

import attrs

from ..errors import LayoutNameError, LayoutValueError, Span, did_you_mean
from .layout import Layout
from .mesh import Mesh
from .rules import Rule, compile_pattern
from .tensor import LogicalTensor
from .topology import Topology

__all__ = ["Program", "Reshard", "cyclic_gc_paused"]


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a program is built or checked.

    A full collection visits every live object, and they are collected more often the more
    objects are made, so building a program's million small objects cost time quadratic in
    its tensors: 300,000 tensors checked in 51 s with it, 30 s without. What is built here
    holds no garbage cycles worth collecting in the meantime; the collector resumes after
    (and stays off if it was off).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@attrs.frozen
class Reshard:
    """``reshard NAME: SOURCE -> DESTINATION``, with per-pattern policies."""

    name: str
    source: str
    destination: str
    policies: tuple[tuple[str | None, str], ...] = ()
    span: Span | None = attrs.field(default=None, eq=False, repr=False)

    def policy_for(self, tensor: str) -> str:
        """``reshard`` or ``broadcast``: the most specific matching policy (more literal
        characters wins, as for layout rules), else the default policy, else ``reshard``.
        Two matching patterns of equal specificity are an error."""
        best: tuple[int, str, str | None] | None = None
        for pattern, policy in self.policies:
            if pattern is None:
                score = -1
            elif compile_pattern(pattern).fullmatch(tensor):
                score = Rule(pattern).specificity
            else:
                continue
            if best is not None and score == best[0]:
                raise LayoutValueError(
                    f"tensor '{tensor}' is matched by two policies of equal specificity in reshard "
                    f"'{self.name}': \"{best[2]}\" and \"{pattern}\"",
                    self.span,
                    "make one pattern more specific (more literal characters wins)",
                )
            if best is None or score > best[0]:
                best = (score, policy, pattern)
        return best[1] if best else "reshard"


@attrs.frozen(eq=False)
class Program:
    """Everything one ``.layout`` file (and its includes) declares, by name."""

    meshes: Mapping[str, Mesh]
    tensors: Mapping[str, LogicalTensor]
    layouts: Mapping[str, Layout]
    reshards: Mapping[str, Reshard]
    topology: Topology = attrs.field(factory=Topology)
    constants: Mapping[str, int] = attrs.field(factory=dict)
    path: str = "<string>"

    def __repr__(self) -> str:
        return (
            f"Program({self.path!r}: {len(self.meshes)} meshes, {len(self.tensors)} tensors, "
            f"{len(self.layouts)} layouts, {len(self.reshards)} reshards)"
        )

    def layout(self, name: str) -> Layout:
        if name not in self.layouts:
            raise LayoutNameError(
                f"unknown layout '{name}' (layouts: {', '.join(self.layouts) or 'none'})",
                hint=did_you_mean(name, self.layouts),
            )
        return self.layouts[name]

    def reshard(self, name: str | None = None) -> Reshard:
        """The named reshard, or the only one when ``name`` is None."""
        if name is None:
            if not self.reshards:
                raise LayoutNameError(
                    f"{self.path} declares no reshard statement",
                    hint="add one, e.g. 'reshard training -> inference'",
                )
            if len(self.reshards) > 1:
                raise LayoutNameError(
                    f"{self.path} declares {len(self.reshards)} reshard statements; name one "
                    f"({', '.join(self.reshards)})"
                )
            return next(iter(self.reshards.values()))
        if name not in self.reshards:
            raise LayoutNameError(
                f"unknown reshard '{name}' (reshards: {', '.join(self.reshards) or 'none'})",
                hint=did_you_mean(name, self.reshards),
            )
        return self.reshards[name]

    def check(self) -> None:
        """Resolves every layout for every tensor and validates every storage on every rank."""
        with cyclic_gc_paused():
            for layout in self.layouts.values():
                layout.check()
