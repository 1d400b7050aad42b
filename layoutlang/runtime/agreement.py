"""The agreement: every rank learns whether all compiled the same plan before a byte moves."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import NoReturn

import torch

from .._text import ranks_phrase
from ..errors import AgreementError, LayoutError, RuntimeFailure
from ..transport import Transport

AGREEMENT_TAG = 2**31 - 1  # message tags of steps stay below it


# ---------------------------------------------------------------------- agreement

_AGREE_BYTES = 288  # status, digest, message
_VERDICT_BYTES = 1024


def _encode(status: bytes, digest: bytes, message: str, size: int) -> torch.Tensor:
    text = message.encode("utf-8")[: size - 40]
    payload = status[:2].ljust(2, b" ") + digest[:32].ljust(32, b"\0") + len(text).to_bytes(2, "little") + text
    return torch.frombuffer(bytearray(payload.ljust(size, b"\0")), dtype=torch.uint8)


def _decode(buf: torch.Tensor) -> tuple[bytes, bytes, str]:
    raw = bytes(buf.cpu().numpy().tobytes())
    length = int.from_bytes(raw[34:36], "little")
    return raw[:2], raw[2:34], raw[36 : 36 + length].decode("utf-8", errors="replace")


def agree(
    transport: Transport,
    rank: int,
    participants: Sequence[int],
    fingerprint: str | None,
    error: str | None,
    timeout: float,
    failure: str = "could not compile the plan",
    ready: bool = True,
) -> None:
    """Every participant learns whether all compiled the same plan; raises AgreementError if not.

    Each rank sends (status, plan fingerprint, error message) to the lowest participant, which
    compares them and sends every rank the same verdict. Nothing else moves before it.
    ``ready=False`` says that ``error`` is a problem this rank found beside the plan (its
    weights, its engine): the verdict says the rank "is not ready" rather than ``failure``.
    """
    leader = min(participants)
    device = transport.device
    digest = bytes.fromhex(fingerprint) if fingerprint else b""
    mine = _encode((b"ER" if ready else b"NR") if error else b"OK", digest, error or "", _AGREE_BYTES).to(device)
    if rank != leader:
        verdict = torch.empty(_VERDICT_BYTES, dtype=torch.uint8, device=device)
        transport.exchange([(leader, mine)], [(leader, verdict)], tag=AGREEMENT_TAG).wait(timeout)
        status, _, message = _decode(verdict)
        if status != b"OK":
            raise AgreementError(message, rank=rank)
        return
    others = [r for r in participants if r != rank]
    inboxes = {r: torch.empty(_AGREE_BYTES, dtype=torch.uint8, device=device) for r in others}
    transport.exchange([], list(inboxes.items()), tag=AGREEMENT_TAG).wait(timeout)
    seen: dict[tuple[bytes, bytes], list[int]] = defaultdict(list)
    errors: dict[int, str] = {}
    statuses = {rank: mine[:2].cpu().numpy().tobytes()}
    seen[(statuses[rank], digest)].append(rank)
    if error:
        errors[rank] = error
    for r, buf in inboxes.items():
        status, fp, message = _decode(buf)
        statuses[r] = status
        seen[(status, fp)].append(r)
        if status != b"OK":
            errors[r] = message
    if errors:
        first = min(errors)
        text = f"rank {first} {'is not ready' if statuses[first] == b'NR' else failure}: {errors[first]}"
        if len(errors) > 1:
            text += f" ({ranks_phrase(sorted(errors))} failed); nothing was moved"
        else:
            text += "; nothing was moved"
    elif len(seen) > 1:
        groups = sorted(seen.values(), key=lambda g: (-len(g), g))
        described = "; ".join(
            f"{ranks_phrase(sorted(g))} compiled plan {fp.hex()[:12]}"
            for (_, fp), g in sorted(seen.items(), key=lambda kv: min(kv[1]))
        )
        differing = sorted(r for g in groups[1:] for r in g)
        text = (
            f"{ranks_phrase(differing)} compiled a different plan from the others ({described}): "
            "different programs, versions or options on different ranks; nothing was moved"
        )
    else:
        text = ""
    verdict = _encode(b"ER" if text else b"OK", b"", text, _VERDICT_BYTES).to(device)
    transport.exchange([(r, verdict) for r in others], [], tag=AGREEMENT_TAG).wait(timeout)
    if text:
        raise AgreementError(text, rank=rank)


def raise_stopped(stopped: AgreementError, own: Exception | None) -> NoReturn:
    """Raise what this rank reports once an agreement ``stopped`` every rank, given what it
    found wrong itself (``own``, None when nothing): its own mistake as the user's (the
    :class:`~layoutlang.errors.LayoutError`, exit 2) in the words every rank saw; a bug of
    its own with its own traceback, not the agreement's; else (a runtime failure, or another
    rank's problem) the agreement's failure."""
    if isinstance(own, LayoutError):
        raise own.reworded(stopped.message) from stopped
    if own is not None and not isinstance(own, RuntimeFailure):
        raise own from None
    raise stopped
