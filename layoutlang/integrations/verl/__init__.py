"""layoutlang as a verl checkpoint engine (``rollout.checkpoint_engine.backend=layoutlang``).

verl moves the trainer's weights to its rollout replicas through a *checkpoint engine*
(``verl.checkpoint_engine``): its ``CheckpointEngineManager`` calls ``prepare`` on every
actor and rollout worker, the engine class's ``build_topology``, ``init_process_group`` on
every worker, then ``send_weights`` on the actor workers while every rollout worker hands
``receive_weights`` to its server adapter, and ``finalize``. :mod:`.engine` registers
:class:`~.engine.LayoutlangCheckpointEngine` as ``"layoutlang"`` in verl's
``CheckpointEngineRegistry``; name it in ``checkpoint_engine.custom_backend_module`` and verl
imports it in every worker. This package itself imports nothing of verl.
"""

from __future__ import annotations

#: the name layoutlang registers under in verl's CheckpointEngineRegistry
BACKEND = "layoutlang"

#: the module verl imports to register it (``checkpoint_engine.custom_backend_module``)
MODULE = f"{__name__}.engine"

__all__ = ["BACKEND", "MODULE"]
