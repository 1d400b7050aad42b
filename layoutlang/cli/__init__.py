"""The command line: ``layoutlang check | show | plan | apply | simulate | viz | doctor``.

One module per command; :func:`build_parser` is separate from :func:`main` so the docs
render it. Local worker launch and the jobs ``apply`` runs (plain and elastic) live here
too: they are the command line's, and nothing below it imports them.
"""

from .main import ExitCode, build_parser, main

__all__ = ["ExitCode", "build_parser", "main"]
