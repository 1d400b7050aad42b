"""The refit group: one gloo group over trainer ranks and inference workers of other jobs.

A trainer and an inference engine are separate torch.distributed worlds (the trainer's
FSDP/TP group, vLLM's own TP group), so their ranks share no process group. The refit
group is built beside both: trainer rank 0 hosts a ``TCPStore``; every trainer rank and
every inference worker builds a ``ProcessGroupGloo`` over it directly (unregistered with
torch.distributed, so neither world's default group is touched) and moves bytes through
its ``send``/``recv``. Group ranks are program ranks: the program's meshes must cover
ranks ``0 .. world_size - 1``.

The store listens only on the address trainer rank 0 is given (torch's TCPStore server
would listen on every interface: :func:`elastic.store.serve_store` binds the socket
itself); give the address of the network the inference workers reach it on, or loopback
when every member runs on the same machine.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from elastic.groups import GlooTransport
from elastic.store import serve_store

from ..errors import ExecutionError

__all__ = ["RefitGroup"]


class RefitGroup:
    """This process's membership of the refit group: its store, gloo group and transport.

    ``host_store`` is true on the one process that serves the store (trainer rank 0); it
    binds ``address:port`` and listens on that address only. Every member calls this at
    once: building the group waits for all ``world_size`` members, at most ``timeout``
    seconds.
    """

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        *,
        host_store: bool,
        name: str = "layoutlang-refit",
        timeout: float = 300.0,
    ):
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ExecutionError(f"rank {rank} is outside the refit group of {world_size} ranks", rank=rank)
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        wait = timedelta(seconds=timeout)
        try:
            if host_store:
                self.store: Any = serve_store(address, port, world_size, timeout=timeout)
            else:
                self.store = dist.TCPStore(address, port, world_size, is_master=False, timeout=wait)
            self.pg: Any = dist.ProcessGroupGloo(dist.PrefixStore(name, self.store), rank, world_size, wait)
        except (RuntimeError, ValueError, OSError) as err:
            role = "serving" if host_store else "reaching"
            raise ExecutionError(
                f"rank {rank}: {role} the refit group's store at {address}:{port} failed "
                f"({world_size} ranks, {timeout:g} s): {str(err).splitlines()[0]}",
                rank=rank,
            ) from None
        self.transport = GlooTransport(self.pg, rank, {r: r for r in range(world_size)})

    def close(self) -> None:
        """Leave the group: pending work is aborted, the store released."""
        self.transport.abort()
        self.pg = None
        self.store = None
