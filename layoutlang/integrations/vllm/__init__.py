"""layoutlang as a vLLM weight-transfer engine.

Start the inference engine with ``weight_transfer_config={"backend": "layoutlang"}``; on the
trainer, build ``LayoutlangTrainerInitInfo`` and call vLLM's
``WeightTransferTrainerFactory.trainer_init`` (or
``LayoutlangTrainerWeightTransferEngine.trainer_init``) on every trainer rank, then
``send_weights()`` after every optimizer step. :func:`register` puts both engines in vLLM's
factories; vLLM calls it in every process through this package's ``vllm.general_plugins``
entry point, so nothing needs to be imported by hand.

The worker side is :mod:`.worker`, the trainer side :mod:`.trainer`, the placement of
received storages into the live model :mod:`.targets`.
"""

from __future__ import annotations

import contextlib

from .common import BACKEND

__all__ = ["BACKEND", "register"]


def register() -> None:
    """Register layoutlang in vLLM's weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, module, name in (
        (WeightTransferEngineFactory, f"{__name__}.worker", "LayoutlangWeightTransferEngine"),
        (WeightTransferTrainerFactory, f"{__name__}.trainer", "LayoutlangTrainerWeightTransferEngine"),
    ):
        with contextlib.suppress(ValueError):  # already registered in this process
            factory.register_engine(BACKEND, module, name)
