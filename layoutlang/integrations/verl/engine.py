"""The checkpoint engine verl drives: ``"layoutlang"`` in its ``CheckpointEngineRegistry``.

verl's calls, in the order its ``CheckpointEngineManager`` makes them at every weight update,
and what each does here:

- ``prepare()`` on every worker: actor rank 0 (``is_master``) serves the refit session's
  store (once; it lives as long as the engine) and reports its address and the fingerprint
  of the job's secret; the other workers report nothing;
- ``build_topology(actor_world_size, rollout_world_size, metadata)``: actor workers are
  program ranks ``0..A-1`` (their torch.distributed ranks, so that their DTensors' meshes
  name them), rollout workers ``A..A+R-1``; every worker is told the store's address;
- ``init_process_group(...)``: a worker holding another secret than the trainer's stops here,
  naming it (only the fingerprint travels through verl's controller); the others connect to
  the store;
- ``send_weights(weights)`` on every actor worker and ``receive_weights()`` on every rollout
  worker: one committed step of an :class:`elastic.ElasticSession`
  (:func:`~layoutlang.integrations.refit_session.fleet_session`) whose source layout is read
  from the weights and whose destination layout holds every tensor whole on every rollout
  worker (what verl's server adapters load). The session starts at the first update and is
  kept for the next ones (verl calls ``prepare``/``init_process_group`` again each time);
- ``finalize()``: nothing to free (the session's buffers are the received tensors).

What ``send_weights`` is given decides what moves:

- DTensors (an FSDP2/TP ``state_dict()``; the fast path): the source layout is
  :func:`~layoutlang.integrations.dtensor.layout_from_state_dict`, and each actor rank sends
  its own shards' overlaps with what each rollout worker holds; no rank gathers a tensor;
- whole tensors (verl's ``get_per_tensor_param()``, which all-gathers each parameter with
  ``full_tensor()`` on every actor rank; the fallback): actor rank 0's copy is the source,
  as with verl's NCCL engine, and the other actor ranks walk the generator (producing each
  tensor is collective among them) and send nothing.

The job's secret (``engine_kwargs.layoutlang.secret`` or ``LAYOUTLANG_JOB_SECRET`` in every
worker's environment) signs the session's records and admits the members of its data
plane; the program the actor side derives reaches the rollout workers through the store
with an HMAC keyed by it, and is checked before it is compiled.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from elastic import ElasticSession, JobSecret
from elastic.auth import SECRET_ENV, resolve_secret

from ...errors import ExecutionError, LayoutValueError
from ...io.torch_dtypes import dtype_name
from ...lang import loads
from ...model import Program
from ..dtensor import layout_from_state_dict, local_storages, state_dict_problems
from ..refit_session import SessionAddress, fleet_session
from ..vllm.common import secret_fingerprint
from . import BACKEND

__all__ = ["LayoutlangCheckpointEngine", "program_text"]

#: the store's key of the program the actor side derived (with its HMAC)
_PROGRAM_KEY = "verl-program"
_MAC_LABEL = b"layoutlang-verl-program\0"


def _mac(secret: JobSecret, text: str) -> str:
    return hmac.new(secret.key, _MAC_LABEL + text.encode(), hashlib.sha256).hexdigest()


def _is_dtensor(tensor: Any) -> bool:
    return getattr(tensor, "device_mesh", None) is not None


def _declarations(weights: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, tensor in weights.items():
        dtype = dtype_name(tensor.dtype)
        if dtype is None:
            raise LayoutValueError(f"tensor '{name}': dtype {tensor.dtype} has no name in the language")
        shape = ", ".join(str(int(n)) for n in tensor.shape)
        lines.append(f'tensor "{name}" [{shape}] {dtype}')
    return lines


def program_text(weights: Mapping[str, Any], trainer_size: int, rollout_size: int) -> str:
    """The refit's program for these weights: the source layout they imply (DTensors: their
    placements; whole tensors: actor rank 0 holds them), every tensor whole on each of the
    ``rollout_size`` rollout workers (program ranks after the ``trainer_size`` actor ranks),
    and ``reshard train -> rollout``. Every actor rank derives the same text from its own
    weights."""
    if not weights:
        raise LayoutValueError("send_weights was given no weights")
    lines = _declarations(weights)
    if any(_is_dtensor(t) for t in weights.values()):
        source = layout_from_state_dict(weights, mesh="train", layout="train")
    else:
        source = "mesh train [sender = 1] on ranks 0..0\nlayout train on train { default: replicate }\n"
    last = trainer_size + rollout_size - 1
    lines += [
        source.rstrip("\n"),
        f"mesh rollout [dp = {rollout_size}] on ranks {trainer_size}..{last}",
        "layout rollout on rollout { default: replicate }",
        "reshard train -> rollout",
    ]
    return "\n".join(lines) + "\n"


@CheckpointEngineRegistry.register(BACKEND)
class LayoutlangCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine over a layoutlang refit session (see the module doc).

    ``bucket_size`` is verl's (``update_weights_bucket_megabytes``); it bounds the staging
    memory of a refit unless ``memory_budget`` is given. The rest come from
    ``checkpoint_engine.engine_kwargs.layoutlang``: ``secret`` (default:
    ``LAYOUTLANG_JOB_SECRET``), ``host``/``port`` where actor rank 0 serves the store (port
    0: a free one), ``timeout`` (seconds any wait may take), ``deadline`` (seconds a member may
    stay silent before it is suspected), ``device`` (where refits run: a CUDA device runs them
    over NCCL; default: CUDA where there is one), ``namespace`` (the store's key prefix).
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        secret: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout: float = 300.0,
        deadline: float = 5.0,
        device: str | None = None,
        namespace: str = "layoutlang-verl",
        memory_budget: int | None = None,
    ) -> None:
        resolved = resolve_secret(secret)
        if resolved is None:
            raise LayoutValueError(
                f"the layoutlang checkpoint engine has no job secret: set {SECRET_ENV} in every actor and rollout "
                "worker's environment (or checkpoint_engine.engine_kwargs.layoutlang.secret)"
            )
        self.secret: JobSecret = resolved
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.host, self.port, self.namespace = host, int(port), namespace
        self.timeout, self.deadline = float(timeout), float(deadline)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.memory_budget = memory_budget if memory_budget is not None else 2 * max(1, self.bucket_size)
        self.store: Any = None
        self.address: SessionAddress | None = None
        self.rank: int | None = None
        self.trainer_size = 0
        self.rollout_size = 0
        self.session: ElasticSession | None = None
        self.program: str | None = None
        #: the last update's statistics, as send_weights returned them
        self.last_metrics: dict[str, Any] = {}

    # ------------------------------------------------------------ verl's lifecycle
    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 serves the session's store (the first time) and reports where."""
        if not self.is_master:
            return {"master": None}
        if self.store is None:
            address = SessionAddress(self.host, self.port, self.namespace)
            self.store = address.connect(serve=True, timeout=self.timeout)
            self.address = SessionAddress(self.host, int(self.store.port), self.namespace)
        assert self.address is not None
        return {
            "master": {
                "host": self.address.host, "port": self.address.port, "namespace": self.address.namespace,
                "secret_id": secret_fingerprint(self.secret),
            }
        }

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor workers are program ranks ``0..A-1``, rollout workers ``A..A+R-1``; every
        worker learns the store's address from actor rank 0's metadata."""
        master = metadata[0].get("master") if metadata and isinstance(metadata[0], dict) else None
        if master is None:
            raise LayoutValueError(
                "actor rank 0 must be the layoutlang checkpoint engine's master (is_master=True): "
                "its prepare() reported no store"
            )
        trainers, rollouts = int(actor_wg_world_size), int(rollout_world_size)

        def kwargs(ranks: list[int]) -> dict[str, list[Any]]:
            n = len(ranks)
            return {
                "rank": ranks, "trainer_size": [trainers] * n, "rollout_size": [rollouts] * n, "master": [master] * n
            }

        return kwargs(list(range(trainers))), kwargs(list(range(trainers, trainers + rollouts)))

    def init_process_group(self, rank: int, trainer_size: int, rollout_size: int, master: dict[str, Any]) -> None:
        """Check the job's secret against the trainer's and reach the session's store."""
        if master.get("secret_id") != secret_fingerprint(self.secret):
            raise LayoutValueError(
                f"rank {rank}: this worker's job secret is not the trainer's (their fingerprints differ): give every "
                f"actor and rollout worker the same {SECRET_ENV}"
            )
        if self.session is not None and (rank, trainer_size, rollout_size) != (
            self.rank, self.trainer_size, self.rollout_size
        ):
            self.shutdown()  # another topology: the next update starts a new session
        self.rank, self.trainer_size, self.rollout_size = int(rank), int(trainer_size), int(rollout_size)
        if self.store is None:
            address = SessionAddress(str(master["host"]), int(master["port"]), str(master["namespace"]))
            self.store = address.connect(serve=False, timeout=self.timeout)
            self.address = address

    def finalize(self) -> None:
        """Nothing to free: the session and its buffers serve the next update."""

    # ------------------------------------------------------------------ refits
    def _start(self, text: str) -> ElasticSession:
        assert self.address is not None and self.rank is not None
        if self.session is not None:
            if text != self.program:
                raise LayoutValueError(
                    f"rank {self.rank}: the weights' names, shapes, dtypes or placements changed since the first "
                    "update (the session's program); start a new engine for the new model"
                )
            return self.session
        program: Program = loads(text, "<verl>")
        self.session = fleet_session(
            program, None, rank=self.rank, store=self.store, address=self.address, secret=self.secret,
            timeout=self.timeout, deadline=self.deadline, memory_budget=self.memory_budget, device=self.device,
        )
        self.program = text
        return self.session

    def _publish(self, text: str) -> None:
        record = {"program": text, "mac": _mac(self.secret, text)}
        self.store.set(f"{self.namespace}/{_PROGRAM_KEY}", json.dumps(record))

    def _read_program(self) -> str:
        key = f"{self.namespace}/{_PROGRAM_KEY}"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except RuntimeError:
            raise ExecutionError(
                f"rank {self.rank}: the actor side published no program within {self.timeout:g} s "
                "(did actor rank 0 call send_weights?)",
                rank=self.rank,
            ) from None
        try:
            record = json.loads(self.store.get(key))
            text, mac = str(record["program"]), str(record["mac"])
        except (ValueError, KeyError, TypeError):
            raise ExecutionError(f"rank {self.rank}: the store's program record is not one", rank=self.rank) from None
        if not hmac.compare_digest(mac, _mac(self.secret, text)):
            raise ExecutionError(
                f"rank {self.rank}: the program in the store is not signed with the job's secret", rank=self.rank
            )
        return text

    @torch.no_grad()
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None) -> dict:
        """One refit from this actor rank's weights (see the module doc); returns its
        statistics (verl merges them into the trainer's metrics)."""
        if self.rank is None or self.rank >= self.trainer_size:
            raise ExecutionError(f"rank {self.rank}: only actor workers send weights", rank=self.rank)
        begin = time.perf_counter()
        collected: dict[str, Any] = {name: tensor async for name, tensor in _iterate(weights)}
        fast = any(_is_dtensor(t) for t in collected.values())
        if not fast and self.rank != 0:
            return {}  # the fallback sends actor rank 0's whole tensors; the others walked the generator
        text = program_text(collected, self.trainer_size, self.rollout_size)
        if self.rank == 0 and self.session is None:
            self._publish(text)
        session = await asyncio.to_thread(self._start, text)
        layout = session.source
        not_ready = None
        problems = state_dict_problems(layout, collected, self.rank) if fast else []
        if problems:
            not_ready = f"rank {self.rank}'s weights do not match layout '{layout.name}': " + "; ".join(problems[:3])
            sources: dict[str, torch.Tensor] = {}
        elif fast:
            sources = local_storages(layout, collected, self.rank, checked=False)
        else:
            sources = {name: t.detach() for name, t in collected.items()}
        sources = {name: t.to(self.device) for name, t in sources.items()}
        report = await asyncio.to_thread(
            session.refit, session.next_step, lambda _step, _session: sources, not_ready=not_ready
        )
        plan = session.plan
        stats = plan.stats if plan is not None else None
        self.last_metrics = {
            "layoutlang/step": report.step,
            "layoutlang/path": "dtensor" if fast else "whole",
            "layoutlang/seconds": time.perf_counter() - begin,
            "layoutlang/moved_bytes": stats.moved if stats is not None else 0,
            "layoutlang/sent_bytes": _sent(stats, self.rank),
        }
        return dict(self.last_metrics)

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """One refit into this rollout worker; yields every tensor whole, by name (the
        session's buffers: valid until the next update, so the server adapter loads or
        copies them, as verl's do)."""
        if self.rank is None or self.rank < self.trainer_size:
            raise ExecutionError(f"rank {self.rank}: only rollout workers receive weights", rank=self.rank)
        if self.session is None:
            text = await asyncio.to_thread(self._read_program)
            await asyncio.to_thread(self._start, text)
        session = self.session
        assert session is not None
        await asyncio.to_thread(session.refit, session.next_step, lambda _step, _session: {})
        destinations = session.destinations
        for name in session.destination.tensors:
            yield name, destinations[name]

    def shutdown(self) -> None:
        """Leave the session (the engine can start a new one at its next update)."""
        if self.session is not None:
            self.session.close()
        self.session, self.program = None, None


async def _iterate(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """verl's weights: a generator, an async generator, or a mapping."""
    if isinstance(weights, Mapping):
        weights = weights.items()
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _sent(stats: Any, rank: int) -> int:
    if stats is None:
        return 0
    sent = stats.per_rank.get(rank, {}).get("sent", {})
    return int(sum(v for kind, v in sent.items() if kind != "local"))
