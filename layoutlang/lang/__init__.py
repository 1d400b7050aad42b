"""The ``.layout`` language: grammar, syntax tree, parser, expressions and elaboration.

Text goes in, a frozen :class:`~layoutlang.model.Program` comes out. Nothing here imports
torch. The modules, in the order text flows through them:

- ``grammars/layout.lark``: the grammar (package data), read by :mod:`.parser`;
- :mod:`.ast`: the syntax tree, frozen nodes with their source spans;
- :mod:`.parser`: text to syntax tree; lark's errors become LayoutSyntaxErrors, with hints
  for common mistakes from a table of bad examples;
- :mod:`.includes`: reading files, ``include`` statements and the packaged presets;
- :mod:`.expressions` and :mod:`.patterns`: integer expressions, capture patterns,
  computed storage names;
- :mod:`.scope`: the names declared so far; :mod:`.topology`, :mod:`.meshes`,
  :mod:`.tensors`, :mod:`.layouts`: one statement kind each;
- :mod:`.elaborate`: reads a program's statements in order into a Program.
"""

from .elaborate import load, loads, read_source
from .parser import parse

__all__ = ["load", "loads", "parse", "read_source"]
