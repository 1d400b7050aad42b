"""What a program has declared so far: names, their values and where they were declared."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from ..errors import LayoutNameError, Span
from ..io.hf import Fp8Scheme
from ..model import LogicalTensor, Mesh, Topology
from . import ast

__all__ = ["Constants", "Declarations", "Scope"]

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


class Constants(Declarations[int]):
    """Every integer a program's expressions may name.

    ``let`` constants (``heads``), a model description's constants (``cfg.hidden_size``,
    defined by ``tensors from hf ... as cfg``) and the size of every axis of every mesh
    (``infer.tp``). A mesh and an ``as`` alias share the dotted names, so the same word
    cannot be both: whichever comes second is an error.
    """

    def __init__(self) -> None:
        super().__init__("constant")
        self._meshes: dict[str, Span] = {}

    def define(self, name: str, value: int) -> None:
        prefix, dot, _ = name.partition(".")
        if dot and prefix in self._meshes:
            raise LayoutNameError(
                f"'{prefix}' is a mesh (at {self._meshes[prefix]}), so '{name}' would name the size of one "
                f"of its axes; import the model description's constants under another name (as ...)"
            )
        super().define(name, value)

    @property
    def mesh_names(self) -> frozenset[str]:
        """The meshes whose axes' sizes these constants name (``infer`` of ``infer.tp``)."""
        return frozenset(self._meshes)

    def define_mesh(self, mesh: Mesh, span: Span) -> None:
        """``MESH.AXIS`` for every axis: its size."""
        taken = sorted(n for n in self if n.startswith(f"{mesh.name}."))
        if taken:
            raise LayoutNameError(
                f"mesh '{mesh.name}' has the name of the constants of a model description "
                f"('{taken[0]}', ...); rename the mesh or the 'as' name of the import",
                span,
            )
        self._meshes[mesh.name] = span
        for axis, size in mesh.axes:
            super().define(f"{mesh.name}.{axis}", size)


class Scope:
    """The declarations of one program, as its statements are read in order.

    Constants, meshes and tensors are built as soon as they are read; layouts and
    reshards are kept as syntax until every tensor is known.
    """

    def __init__(self) -> None:
        self.constants = Constants()
        self.meshes: Declarations[Mesh] = Declarations("mesh")
        self.tensors: Declarations[LogicalTensor] = Declarations("tensor")
        self.layouts: Declarations[ast.LayoutDecl] = Declarations("layout")
        self.reshards: list[ast.ReshardDecl] = []
        self.topology: Topology | None = None
        self.topology_span: Span | None = None
        #: per ``as`` name of ``tensors from hf``: its config's FP8 scheme (None: unquantized)
        self.fp8_schemes: dict[str, Fp8Scheme | None] = {}
        #: per ``as`` name of ``tensors from hf`` / ``hf_constants``: the path of its config.json
        #: (what ``tensors from peft ... over NAME`` reads the adapted model from)
        self.model_configs: dict[str, str] = {}
