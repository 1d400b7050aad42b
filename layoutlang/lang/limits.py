"""Limits that keep a mistyped number, or hostile input, from exhausting memory or time.

The core counts elements, bytes and ranks in 64-bit integers and chunks and blocks in
32-bit ones; a mesh or a ``for`` clause is built in memory before anything checks it.

A program's text is bounded too: each file it reads (the program and every include) holds
at most :data:`MAX_PROGRAM_BYTES`, and all of them together at most
:data:`MAX_PROGRAM_TOKENS` tokens. The parser (lark's LALR, in Python) spends about 15 us
and 1 KB per token, so the token limit keeps the worst program within a few seconds and a
few hundred MB; the largest program shipped with layoutlang holds under 400 tokens.

Within these limits a program is read and checked in time linear in its size (its tokens
and its tensors): nothing is done once per pair of tensors and statements, rules or
constants, and every value an expression computes is a 64-bit integer, so no value grows
beyond a few words either. The language reference's "Limits" section lists them all.
"""

from __future__ import annotations

__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_DOMAIN_SIZE",
    "MAX_EMBEDDED_EXPRESSION",
    "MAX_GENERATED_TENSORS",
    "MAX_INCLUDE_DEPTH",
    "MAX_LAYOUT_PLACEMENTS",
    "MAX_MESH_RANKS",
    "MAX_PROGRAM_BYTES",
    "MAX_PROGRAM_TENSORS",
    "MAX_PROGRAM_TOKENS",
]

#: positions of one mesh
MAX_MESH_RANKS = 1 << 20
#: tensors one ``tensor ... for`` statement may generate
MAX_GENERATED_TENSORS = 1 << 18
#: tensors of a program, all statements together. A program is read and checked in time
#: and memory linear in its tensors, about 60 us and 3.4 KB each (2 loaded cores): 2**18 in
#: about 17 s and 930 MB. 2**20 took a minute and 3.4 GB, so the limit was lowered to
#: 2**18, which still holds the largest benchmark (a 2.4T model with per-expert tensors,
#: 144,189) and DeepSeek-V3 (91k) with room to spare.
MAX_PROGRAM_TENSORS = 1 << 18
#: layouts x tensors of a program: checking it resolves every tensor in every layout (about
#: 25 us each), so the program's size alone would not bound it (a thousand one-line layouts
#: of 2**18 tensors). 2**21: eight layouts at the tensor limit, fourteen of the largest
#: benchmark, in under a minute; programs have two to four
MAX_LAYOUT_PLACEMENTS = 1 << 21
#: the range of every value an expression computes (a number, a constant, each step of an
#: expression): the core's integers. A ``let`` chain that multiplies a value by itself is
#: refused at the first value past it, instead of growing Python integers without end.
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
INT32_MAX = (1 << 31) - 1
#: ranks of one domain (``topology { domain_size = N }``); the largest NVLink domain has 72.
#: The setting is read as a decimal number, exact up to 2**53: this bound keeps it exact
MAX_DOMAIN_SIZE = INT32_MAX
#: bytes of one ``.layout`` file (a program or an include)
MAX_PROGRAM_BYTES = 16 << 20
#: tokens (names, numbers, strings, symbols; not comments) of a program's files together
MAX_PROGRAM_TOKENS = 1 << 18
#: characters of an expression embedded in a name (``"layers.{l % 4}"``): it is parsed on its
#: own, outside the program's token count
MAX_EMBEDDED_EXPRESSION = 1024
#: files of one chain of includes (a includes b includes c ...); each file is read once, so
#: this bounds the reader's recursion, not the number of files
MAX_INCLUDE_DEPTH = 64
