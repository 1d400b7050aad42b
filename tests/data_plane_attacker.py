"""A process without the job's secret, attacking a job's store and data plane (loopback only).

Run by tests/test_data_plane.py as ``python tests/data_plane_attacker.py MODE PORT ARGS...``;
prints one JSON line of what it achieved. Modes:

- ``member PREFIX GROUP_RANK SIZE SECONDS``: write its own address under a group's
  rendezvous prefix as ``GROUP_RANK`` (what torch's ProcessGroupGloo does), build the group
  if it can, and try to receive from every other group rank for ``SECONDS``: ``received``
  is the number of bytes it got.
- ``garbage KEY``: write 7 garbage bytes under ``KEY``.
- ``heartbeat KEY SECONDS``: keep advancing a forged heartbeat under ``KEY`` (a stopped
  rank's), as counters and as values, for ``SECONDS``.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta


def _wait(work, seconds: float) -> str | None:
    """Wait for one gloo work; its error (None: it completed)."""
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def main() -> None:
    import torch
    import torch.distributed as dist

    mode, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    out: dict = {"mode": mode}
    if mode == "member":
        prefix, group_rank, size, seconds = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
        received = 0
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), group_rank, size, timedelta(seconds=seconds))
            out["built"] = True
            buffers = {r: torch.zeros(1 << 16, dtype=torch.uint8) for r in range(size) if r != group_rank}
            works = {r: pg.recv([b], r, 0) for r, b in buffers.items()}
            for r, work in works.items():
                error = _wait(work, seconds)
                if error is None:
                    received += int(buffers[r].count_nonzero())
                else:
                    out.setdefault("errors", []).append(error)
        except RuntimeError as err:  # what a rogue meets: the members' addresses are sealed
            out["built"] = False
            out["error"] = str(err).splitlines()[0][:200]
        out["received"] = received
    elif mode == "garbage":
        store.set(sys.argv[3], b"\x07garbag")
        out["written"] = sys.argv[3]
    elif mode == "heartbeat":
        key, seconds = sys.argv[3], float(sys.argv[4])
        end, beats = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            beats += 1
            store.set(key, str(1000 + beats).encode())  # a plain count, and below a forged seal
            store.set(key, b"0" * 64 + str(1000 + beats).encode())
            time.sleep(0.02)
        out["beats"] = beats
    else:
        raise SystemExit(f"unknown mode {mode}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
