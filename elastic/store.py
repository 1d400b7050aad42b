"""The job's store, served on one address only.

torch's TCPStore server listens on every interface whatever host it is given (torch 2.13,
libuv backend as well as the legacy one), so a store meant for the processes of one
machine is reachable from the whole network. :func:`serve_store` binds the listening
socket itself, on the address asked for (loopback by default), and hands it to the
TCPStore (``master_listen_fd``).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["LOOPBACK", "listen", "serve_store"]

#: Where a store listens unless an address is given.
LOOPBACK = "127.0.0.1"


def listen(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one), for a TCPStore server.

    torch's TCPStore server listens on every interface whatever host it is given; handed this
    socket (``master_listen_fd``), it serves only the address the socket is bound to.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(host: str = LOOPBACK, port: int = 0, world_size: int | None = None, *, timeout: float = 300.0) -> Any:
    """A TCPStore server that listens on ``host:port`` only (port 0: any free one).

    The store gets its own copy of the socket (libuv closes the descriptor it is given when
    the store goes), so the socket here is closed at once.
    """
    import torch.distributed as dist

    with listen(host, port) as sock:
        return dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=os.dup(sock.fileno()),
        )
