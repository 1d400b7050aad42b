"""What the trainer side and the worker side of the vLLM engine share: the wire types and
the program both compile."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from typing import Any

from elastic import JobSecret

from ...errors import LayoutValueError
from ...lang import load, loads
from ...model import Layout, Program, Reshard
from ..refit_session import DEFAULT_NAMESPACE, SessionAddress, engines_of

__all__ = ["BACKEND", "MODES", "RefitProgram", "WorkerInitFields", "first_of", "secret_fingerprint"]

#: the name layoutlang registers under in vLLM's weight-transfer factories
BACKEND = "layoutlang"

#: how an engine's workers enter the refit session: ``start`` (the first generation, with the
#: trainer), ``join`` (a new or restarted engine, admitted at the next step boundary),
#: ``attach`` (already a member: a restarted trainer takes its place back)
MODES = ("start", "join", "attach")


@dataclass(kw_only=True)
class WorkerInitFields:
    """The fields of the worker-side init info (plain JSON, so every control plane carries it).

    ``secret`` is the job's secret (hex): it signs the session's records and never appears in
    a repr, a log or a message.
    """

    master_address: str
    master_port: int
    #: the program's text; a worker that sees ``program_path`` reads that file instead
    program: str
    program_path: str | None = None
    reshard: str | None = None
    #: the first program rank of this engine's workers (``join``: allocated by the trainer)
    rank_offset: int = 0
    namespace: str = DEFAULT_NAMESPACE
    mode: str = "start"
    secret: str = field(default="", repr=False)
    #: the fingerprint of the trainer's secret (:func:`secret_fingerprint`): a worker given no
    #: ``secret`` reads its own from ``LAYOUTLANG_JOB_SECRET`` and refuses the init unless the
    #: fingerprints agree (the secret itself then never travels on the control plane)
    secret_id: str = ""
    #: the engine's name in the session's records (a re-attaching trainer finds its ranks by it)
    token: str = ""
    timeout: float = 300.0
    #: seconds a member may stay silent before it is suspected (a second deadline confirms it)
    deadline: float = 2.0
    memory_budget: int | None = None
    #: the destination mesh's axis that indexes engines (its first axis)
    engine_axis: str = "dp"
    #: ``join``: seconds to wait for the members to admit it at a step boundary
    join_timeout: float = 3600.0
    #: the destination layout names checkpoint tensors, not the engine's parameters: every
    #: storage goes through load_weights (vLLM's own path for whole tensors, as its NCCL
    #: engine takes it); for comparisons, and for engines layoutlang has no preset of
    checkpoint_format: bool = False
    #: every refit sends only what changed since the version each worker holds (delta refits;
    #: ``"digests"``: senders keep a digest per 4 KiB block instead of a copy)
    delta: bool | str = False
    #: the refit carries a LoRA adapter (:class:`~.lora.AdapterSpec` as JSON: ``lora_int_id``,
    #: ``lora_name``, the PEFT ``config``), swapped into the engine's LoRA manager at every
    #: refit; its session is the engine's own for this namespace, beside the base weights'
    lora: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            modes = ", ".join(MODES)
            raise LayoutValueError(f"unknown mode '{self.mode}' of the layoutlang init info (modes: {modes})")

    @property
    def address(self) -> SessionAddress:
        return SessionAddress(self.master_address, int(self.master_port), self.namespace)


class RefitProgram:
    """The program of a refit, its reshard and both layouts."""

    def __init__(self, text: str, path: str | None, reshard: str | None, engine_axis: str = "dp"):
        self.program: Program = load(path) if path and os.path.isfile(path) else loads(text, path or "<refit>")
        self.reshard: Reshard = self.program.reshard(reshard)
        self.source: Layout = self.program.layout(self.reshard.source)
        self.destination: Layout = self.program.layout(self.reshard.destination)
        self.engine_axis = engine_axis
        #: each engine's program ranks in the first generation, in mesh order
        self.engines: list[tuple[int, ...]] = engines_of(self.destination, engine_axis)

    def engine_offsets(self) -> list[int]:
        """The first rank of each engine of the first generation."""
        return [ranks[0] for ranks in self.engines]

    def position_like(self, engine_rank: int) -> int:
        """A rank of the first generation holding what the ``engine_rank``-th worker of any
        engine holds (every engine holds the same boxes: the engine axis replicates)."""
        return self.engines[0][engine_rank]


def first_of(problems: list[str]) -> str | None:
    """The first problem and how many more: what one rank tells the others in the agreement."""
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def secret_fingerprint(secret: JobSecret) -> str:
    """What identifies the job's secret without revealing it: an HMAC-SHA256 of a fixed label
    keyed with the secret (16 hex digits; no record of the session is signed with this label)."""
    return hmac.new(secret.key, b"layoutlang-secret-fingerprint\0", hashlib.sha256).hexdigest()[:16]
