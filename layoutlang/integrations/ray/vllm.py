"""vLLM engines as Ray actors, refitted by layoutlang, rejoining by themselves after a restart.

RL frameworks run each vLLM engine as a Ray actor (``ray.remote(vllm.LLM)``, often with
``max_restarts`` so that Ray starts a crashed engine again) and drive it through vLLM's
``RayVLLMWeightSyncClient``. :class:`RestartAwareRayClient` is that client, with one thing
more: it can tell the layoutlang trainer that the engine behind a lost engine entry was
restarted by Ray (a new actor process that answers). The trainer then asks it to join the
refit session again at the next ``send_weights()`` (admitted at that step's boundary, caught
up from an engine that holds the same boxes, applied before the call returns): nothing else
restarts and nobody calls ``add_engine``.

Start the engines with ``weight_transfer_config={"backend": "layoutlang"}`` and the
multiprocessing executor (``distributed_executor_backend="mp"``: the engine's workers are
the actor's own child processes, which Ray stops with it)::

    Engine = ray.remote(max_restarts=2)(LLM)
    engines = [Engine.remote(model=path, tensor_parallel_size=2, distributed_executor_backend="mp",
                             weight_transfer_config={"backend": "layoutlang"}) for _ in range(2)]
    clients = [RestartAwareRayClient(engine) for engine in engines]  # on trainer rank 0

Importing this module imports Ray and vLLM (the vLLM environment, with Ray installed).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import ray
from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

__all__ = ["RestartAwareRayClient"]


def _actor_process(_actor: Any) -> int:
    """Run inside the actor (``__ray_call__``): which process holds it now."""
    return os.getpid()


class RestartAwareRayClient(RayVLLMWeightSyncClient):
    """vLLM's client of one engine's Ray actor(s), which also says when Ray restarted them.

    An engine counts as restarted once every one of its actors answers from a process other
    than the one it answered from when this client first asked (at the refit's start): an
    engine whose worker died while its actor lived on is not restarted, and is not asked
    to join again. The first :meth:`restarted` starts a thread that asks the actors every
    ``probe_every`` seconds (the trainer asks as soon as it lost the engine), so the answer
    is ready by the next refit.
    """

    def __init__(self, handle: Any, *, probe_every: float = 1.0) -> None:
        super().__init__(handle)
        self.probe_every = probe_every
        #: each actor's process when first seen (asked at once, answered when the actor is up)
        self._first = [h.__ray_call__.remote(_actor_process) for h in self.handles]
        self._known: list[int] | None = None
        self._back = threading.Event()
        self._watch: threading.Thread | None = None
        self._lock = threading.Lock()

    def _processes(self, timeout: float | None) -> list[int] | None:
        """Each actor's process now, or None (not all of them answer within ``timeout``)."""
        try:
            return [int(pid) for pid in ray.get([h.__ray_call__.remote(_actor_process) for h in self.handles],
                                                timeout=timeout)]
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            # still the old actor dying, restarting, or gone for good: asked again later
            return None

    def _watch_restart(self) -> None:
        if self._known is None:
            self._known = [int(pid) for pid in ray.get(self._first)]
        while True:
            now = self._processes(timeout=max(self.probe_every, 5.0))
            if now is not None and all(pid != old for pid, old in zip(now, self._known)):
                self._known = now
                self._back.set()
                return
            time.sleep(self.probe_every)

    def restarted(self) -> bool:
        """Whether Ray restarted this engine's actors since they were last seen, and they
        answer again. Never blocks: the first call starts watching (in a thread), and says
        False until the actors answer from new processes; once it said True, the new
        processes are the known ones, and a later call watches for the next restart."""
        with self._lock:
            if self._back.is_set():
                self._back.clear()
                self._watch = None
                return True
            if self._watch is None:
                self._watch = threading.Thread(target=self._watch_restart, name="layoutlang-ray-restart",
                                               daemon=True)
                self._watch.start()
            return False
