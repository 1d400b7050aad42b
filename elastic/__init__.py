"""Elastic communicators: membership, shrink and grow, and remeshing during failure recovery.

The package is built on layoutlang's layouts and plans; see the design notes in the docs.
"""
