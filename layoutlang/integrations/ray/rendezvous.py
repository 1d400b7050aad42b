"""The rendezvous of a layoutlang job on Ray: a named actor that serves the job's store.

One :class:`Rendezvous` actor per job, named after the job (:func:`rendezvous_name`), holds
what the job's ranks need to find each other: the address of the job's TCPStore (served
inside the actor, :func:`elastic.store.serve_store`), the job's secret
(:class:`elastic.auth.JobSecret`) and the membership (rank -> the Ray node it runs on). A
rank looks the actor up by name (:func:`join`): nobody sets an address or a port by hand.

Addresses: the store listens on the address Ray reports for the actor's node, or on
loopback when every node of the cluster has that same address (a cluster on one machine,
as in the tests); gloo binds the interface that holds the rank's node address likewise,
unless the operator set ``GLOO_SOCKET_IFNAME``.

Trust: the secret signs every rendezvous record (:class:`elastic.groups.SignedRendezvous`)
and every rank proves it holds it before the group is used
(:func:`elastic.groups.prove_group`), exactly as with the local launcher; a process that
reaches the store's port without the secret cannot join or forge a record. The secret is
handed to a rank by the actor, through Ray: whoever can call actors on the Ray cluster can
run any code on it anyway, so the Ray cluster's own access control (who reaches its GCS
port) is the boundary, and the secret guards the store's port, which is outside it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
from datetime import timedelta
from typing import Any

import attrs
import ray

from elastic.auth import SECRET_ENV, JobSecret, remember
from elastic.store import LOOPBACK, serve_store

from ...errors import MembershipError
from ..workers import init_default_group, loopback_interface

__all__ = ["NAMESPACE", "Contact", "Rendezvous", "join", "rendezvous_name", "start_rendezvous"]

#: The Ray namespace of every layoutlang rendezvous actor (a job's actor is found by name in it).
NAMESPACE = "layoutlang"


def rendezvous_name(job: str) -> str:
    """The name of the rendezvous actor of ``job``."""
    return f"layoutlang-rendezvous-{job}"


@attrs.frozen(repr=False)
class Contact:
    """What a rank needs to join its job: the store's address, the world size, the secret."""

    host: str
    port: int
    size: int
    secret: str  # JobSecret.text(): hex

    def __repr__(self) -> str:  # never the secret
        return f"Contact({self.host}:{self.port}, size={self.size})"


def _cluster_is_one_machine() -> bool:
    """Whether every live node of the Ray cluster has this node's address (loopback reaches them all)."""
    here = ray.util.get_node_ip_address()
    return all(node["NodeManagerAddress"] == here for node in ray.nodes() if node["Alive"])


def store_host() -> str:
    """The address a job's store listens on: loopback on a one-machine cluster, else this
    node's address as Ray reports it (the address the other nodes reach it by)."""
    return LOOPBACK if _cluster_is_one_machine() else ray.util.get_node_ip_address()


class Rendezvous:
    """The job's store, secret and membership, in a Ray actor (:func:`start_rendezvous`).

    ``size`` ranks join; ``secret`` is the job's (by default the operator's
    ``LAYOUTLANG_JOB_SECRET`` where the actor runs, else a fresh one).
    """

    def __init__(self, size: int, secret: str | None = None, *, timeout: float = 180.0):
        self.size = size
        self.secret = JobSecret.parse(secret) if secret else JobSecret.from_environment() or JobSecret.generate()
        self.host = store_host()
        self.store = serve_store(self.host, 0, size + 1, timeout=timeout)
        remember(self.store, self.secret)  # an ExitWatcher on this store signs with the job's secret
        self.members: dict[int, str] = {}

    def contact(self) -> Contact:
        return Contact(self.host, self.store.port, self.size, self.secret.text())

    def join(self, rank: int, node: str) -> Contact:
        """Record that ``rank`` runs on Ray node ``node``; the contact it joins with."""
        if not 0 <= rank < self.size:
            raise MembershipError(f"rank {rank} is not a rank of this job (ranks 0..{self.size - 1})")
        self.members[rank] = node
        return self.contact()

    def membership(self) -> dict[int, str]:
        """Every rank that joined, and the Ray node it runs on."""
        return dict(self.members)


def start_rendezvous(job: str, size: int, *, secret: JobSecret | None = None, timeout: float = 180.0) -> Any:
    """Start the rendezvous actor of ``job`` on this (the caller's) node, and wait until its
    store serves. It lives as long as its handle does (the caller's job)."""
    actor: Any = (
        ray.remote(num_cpus=0)(Rendezvous)
        .options(
            name=rendezvous_name(job),
            namespace=NAMESPACE,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            ),
        )
        .remote(size, secret.text() if secret is not None else None, timeout=timeout)
    )
    ray.get(actor.contact.remote(), timeout=timeout)
    return actor


#: the ioctl that reads an interface's IPv4 address (Linux, <linux/sockios.h>)
SIOCGIFADDR = 0x8915


def _interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address``, or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                request = struct.pack("256s", name.encode()[:15])
                if socket.inet_ntoa(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24]) == address:
                    return name
    return None


def join(job: str, rank: int, *, timeout: float = 180.0) -> Any:
    """Join ``job`` as ``rank`` from inside a Ray actor: find the job's rendezvous by name,
    build the default gloo group of its ranks (signed with the secret, every rank's proof
    checked) and return a client of the job's store. Sets one intra-op thread (several ranks
    share a node's cores, as torchrun does), ``LAYOUTLANG_JOB_SECRET`` (what elastic sessions
    read) and ``GLOO_SOCKET_IFNAME`` unless the operator set it."""
    # torch loads in the ranks only: the launcher that imports this module starts without it
    import torch
    import torch.distributed as dist

    rendezvous = ray.get_actor(rendezvous_name(job), namespace=NAMESPACE)
    contact: Contact = ray.get(rendezvous.join.remote(rank, ray.get_runtime_context().get_node_id()), timeout=timeout)
    os.environ[SECRET_ENV] = contact.secret
    interface = loopback_interface() if contact.host == LOOPBACK else _interface_of(ray.util.get_node_ip_address())
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    store = dist.TCPStore(contact.host, contact.port, contact.size + 1, is_master=False,
                          timeout=timedelta(seconds=timeout))
    init_default_group(store, "layoutlang", rank, contact.size, timeout, contact.secret)
    return store
