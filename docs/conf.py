"""Sphinx configuration of the layoutlang documentation.

Build (warnings are errors)::

    sphinx-build -W --keep-going -b html docs docs/_build/html
    sphinx-build -W -b doctest docs docs/_build/doctest

``tests/test_docs.py`` runs both builds, checks every ``.layout`` snippet and re-runs every
command whose output the pages show.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath("_ext"))

import layoutlang

project = "layoutlang"
author = "layoutlang developers"
copyright = "layoutlang developers"
version = release = layoutlang.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinxarg.ext",
    "layout_lexer",  # docs/_ext/layout_lexer.py: the ``layout`` Pygments lexer
]
# No intersphinx: the docs build without network access.

exclude_patterns = ["_build", "snippets", "Thumbs.db", ".DS_Store"]
root_doc = "index"
highlight_language = "none"
pygments_style = "sphinx"

# -- autodoc -------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"

# -- doctest -------------------------------------------------------------------
# Only explicit ``.. doctest::`` blocks run. The ``>>>`` examples that autodoc copies from
# docstrings belong to their modules; the pages show them but do not run them.
doctest_test_doctest_blocks = ""
# SNIPPETS: the folder of the .layout examples, for doctests that load them. torch is
# optional: the doctests comparing with torch are skipped without it.
doctest_global_setup = f"""
import layoutlang
SNIPPETS = {os.path.abspath("snippets")!r}
try:
    import torch
except ImportError:
    torch = None
"""

# -- HTML ----------------------------------------------------------------------
html_theme = "alabaster"
html_title = f"layoutlang {release}"
html_theme_options = {
    "description": "Declarative tensor layouts and exact reshard plans",
    "fixed_sidebar": True,
    "page_width": "1180px",
    "sidebar_width": "230px",
}
html_static_path: list[str] = []
