"""A Pygments lexer for ``.layout`` files, registered with Sphinx as ``layout``.

With this extension loaded, ``.. code-block:: layout`` and ``.. literalinclude:: x.layout``
with ``:language: layout`` are highlighted. The lexer follows
``layoutlang/grammars/layout.lark``:

- ``#`` comments run to the end of the line;
- strings are double-quoted and hold no newline; inside them ``{name}`` (a capture, or an
  expression in a storage name) and ``*`` are highlighted;
- statement keywords, the placement words ``shard`` and ``replicate``, dtype names, the
  shard options ``blocks``, ``chunks`` and ``pad``, integers with ``_`` separators,
  quantities with units (``50 GB/s``, ``2.5 us``) and the operators
  ``.. -> // + - * % = | :``.

Anything else is an error token, so that Sphinx (run with ``-W``) fails on a snippet the
lexer does not understand instead of silently showing it unhighlighted.
"""

from __future__ import annotations

from typing import ClassVar

from pygments.lexer import RegexLexer, bygroups, words
from pygments.token import (
    Comment,
    Keyword,
    Name,
    Number,
    Operator,
    Punctuation,
    String,
    Whitespace,
)

__all__ = ["LayoutLexer", "setup"]

# Words of the grammar (layout.lark), by role.
STATEMENTS = (
    "include", "let", "require", "topology", "mesh", "tensor", "tensors", "generic", "layout", "storage",
    "quantize", "reshard",
)  # fmt: skip
CLAUSES = ("on", "ranks", "for", "in", "from", "over", "as", "dtype", "along", "stack", "of", "transposed", "into")
PLACEMENTS = ("shard", "replicate", "broadcast")
SOURCES = ("hf", "safetensors", "peft")
SHARD_OPTIONS = ("blocks", "chunks", "pad")
# The words of a quantize statement: formats, block shapes, scale conventions.
QUANTIZE_WORDS = ("mxfp8", "per_channel", "per_tensor", "scale_inv", "scale")
# Short names and aliases of layoutlang/dtypes.py (a file may use any spelling).
DTYPES = (
    "bf16", "fp16", "fp32", "fp64", "fp8_e4m3", "fp8_e5m2", "fp8",
    "int8", "uint8", "int16", "int32", "int64", "bool",
    "bfloat16", "float16", "half", "float32", "float", "float64", "double",
    "f16", "f32", "f64", "float8_e4m3fn", "f8_e4m3", "float8_e5m2", "f8_e5m2",
    "i8", "u8", "i16", "i32", "i64", "e8m0",
)  # fmt: skip
UNITS = r"(GB/s|Gb/s|GiB/s|MB/s|MiB/s|TB/s|Tb/s|us|ms|ns|s)(?![A-Za-z0-9_])"
NUMBER = r"[0-9][0-9_]*(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"

_END = r"(?![A-Za-z0-9_])"


class LayoutLexer(RegexLexer):
    """Lexer for layoutlang's ``.layout`` files."""

    name = "layout"
    # class-level tables that Pygments reads, never mutated
    aliases: ClassVar[list[str]] = ["layout", "layoutlang"]
    filenames: ClassVar[list[str]] = ["*.layout"]
    mimetypes: ClassVar[list[str]] = ["text/x-layout"]

    tokens: ClassVar[dict[str, list]] = {
        "root": [
            (r"\s+", Whitespace),
            (r"#[^\n]*", Comment.Single),
            (r'"', String.Double, "string"),
            (words(STATEMENTS, suffix=_END), Keyword.Declaration),
            (words(CLAUSES, suffix=_END), Keyword),
            (r"default" + _END, Keyword.Pseudo),
            (words(PLACEMENTS, suffix=_END), Name.Builtin),
            (words(SOURCES, suffix=_END), Name.Builtin),
            # ``blocks(...)`` after a storage's parts; ``blocks = 2`` inside shard(...)
            (r"blocks(?=\s*\()", Keyword),
            (words(SHARD_OPTIONS, suffix=_END), Name.Attribute),
            (words(QUANTIZE_WORDS, suffix=_END), Name.Attribute),
            (words(DTYPES, suffix=_END), Keyword.Type),
            # a quantity with its unit: 50 GB/s, 2.5 us
            (rf"({NUMBER})( ?)" + UNITS, bygroups(Number, Whitespace, Keyword.Type)),
            # 0..3 is two integers and a range, not a float
            (r"[0-9][0-9_]*\.[0-9]+(?:[eE][+-]?[0-9]+)?", Number.Float),
            (r"[0-9][0-9_]*[eE][+-]?[0-9]+", Number.Float),
            (r"[0-9][0-9_]*", Number.Integer),
            (r"\.\.|->|//|==|!=|<=|>=|[+\-*%=|:/<>]", Operator),
            (r"[\[\](){},.]", Punctuation),
            (r"[A-Za-z_][A-Za-z0-9_]*", Name),
        ],
        "string": [
            (r'"', String.Double, "#pop"),
            (r"\{[^{}\"\n]*\}", String.Interpol),
            (r"\*", String.Regex),
            (r'[^"{}*\n]+', String.Double),
            (r"[{}]", String.Double),  # an unbalanced brace: the language reports it, not the lexer
            (r"\n", Whitespace, "#pop"),  # strings end at the line's end
        ],
    }


def setup(app):
    app.add_lexer("layout", LayoutLexer)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
