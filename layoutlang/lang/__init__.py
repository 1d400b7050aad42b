"""The ``.layout`` language: grammar, syntax tree, parser, expressions and elaboration.

Text goes in, a frozen :class:`~layoutlang.model.Program` comes out. Nothing here imports
torch.
"""

from .elaborate import load, loads, read_source
from .syntax import parse

__all__ = ["load", "loads", "parse", "read_source"]
