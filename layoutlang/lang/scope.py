"""What a program has declared so far: names, their values and where they were declared."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from ..errors import LayoutNameError, Span
from ..model import LogicalTensor, Mesh, Topology
from . import ast

__all__ = ["Declarations", "Scope"]

T = TypeVar("T")


class Declarations(Mapping[str, T], Generic[T]):
    """Values of one kind by name, each name declared once (``kind`` names them in errors)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._values: dict[str, T] = {}
        self._spans: dict[str, Span] = {}

    def __getitem__(self, name: str) -> T:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def check_new(self, name: str, span: Span) -> None:
        """Raise if ``name`` is declared already, pointing at ``span`` and naming the first place."""
        if name in self._spans:
            raise LayoutNameError(f"{self.kind} '{name}' is declared twice (first at {self._spans[name]})", span)

    def declare(self, name: str, value: T, span: Span) -> None:
        self.check_new(name, span)
        self._values[name] = value
        self._spans[name] = span

    def define(self, name: str, value: T) -> None:
        """A value that comes with no declaration of its own (a model description's constants)."""
        self._values[name] = value


class Scope:
    """The declarations of one program, as its statements are read in order.

    Constants, meshes and tensors are built as soon as they are read; layouts and
    reshards are kept as syntax until every tensor is known.
    """

    def __init__(self) -> None:
        self.constants: Declarations[int] = Declarations("constant")
        self.meshes: Declarations[Mesh] = Declarations("mesh")
        self.tensors: Declarations[LogicalTensor] = Declarations("tensor")
        self.layouts: Declarations[ast.LayoutDecl] = Declarations("layout")
        self.reshards: list[ast.ReshardDecl] = []
        self.topology: Topology | None = None
        self.topology_span: Span | None = None
