"""How ranks share fast links (:class:`Topology`), and the clusters vendors publish.

:data:`TOPOLOGY_PRESETS` holds clusters by name; a ``.layout`` file selects one with
``topology dgx_h100 {}`` and may override any setting in the block. Every constant comes
from the vendor's published specification (:data:`PRESET_SOURCES`); the latencies are
assumptions (vendors do not publish a per-message software latency), and no constant is
fitted to a measured refit.
"""

from __future__ import annotations

import math

import attrs

from ..errors import LayoutValueError


@attrs.frozen
class Topology:
    """How ranks share fast links: ``domain_size`` consecutive ranks form one domain.

    Bandwidths are per rank and per direction (what one rank can send, and separately
    receive, per second); ``copy_bandwidth`` is the rate of a copy inside one rank's memory,
    ``quantize_bandwidth`` the bytes of source one rank quantizes per second (no preset gives
    one: declare what your ranks measure, e.g. with ``benchmarks/bench_quantize.py``).
    A named topology starts from the preset of that name (:data:`TOPOLOGY_PRESETS`).
    """

    domain_size: int = 1
    domain_bandwidth: float | None = None  # bytes per second
    network_bandwidth: float | None = None  # bytes per second per rank
    domain_latency: float | None = None  # seconds
    network_latency: float | None = None  # seconds
    name: str | None = None
    copy_bandwidth: float | None = None  # bytes copied per second inside one rank (local moves)
    #: bytes of source (bf16) one rank quantizes to fp8 per second: where a plan into a
    #: quantized layout quantizes is decided against the links with it (None: the senders do)
    quantize_bandwidth: float | None = None

    def domain_of(self, rank: int) -> int:
        return rank // self.domain_size


GB = 1e9

# ----------------------------------------------------------------- topology presets

_H100_PAGE = "https://www.nvidia.com/en-us/data-center/h100/"
_DGX_H100_RA = (
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-enterprise-ai/"
    "latest/core-components.html"
)
_GB200_PAGE = "https://www.nvidia.com/en-us/data-center/gb200-nvl72/"
_DGX_GB200_HW = "https://docs.nvidia.com/dgx/dgxgb200-user-guide/hardware.html"
_LATENCY_NOTE = (
    "assumption, not a vendor specification: the per-message cost of a point-to-point transfer "
    "(launch, rendezvous, completion), the order of magnitude of small-message NCCL send/recv; "
    "override it in the topology block"
)

#: Clusters by name. Bandwidths are per rank (GPU) and per direction, in bytes per second.
TOPOLOGY_PRESETS: dict[str, Topology] = {
    "dgx_h100": Topology(
        name="dgx_h100",
        domain_size=8,
        domain_bandwidth=450 * GB,
        network_bandwidth=50 * GB,
        domain_latency=5e-6,
        network_latency=10e-6,
        copy_bandwidth=3.35e12 / 2,
    ),
    "gb200_nvl72": Topology(
        name="gb200_nvl72",
        domain_size=72,
        domain_bandwidth=900 * GB,
        network_bandwidth=50 * GB,
        domain_latency=5e-6,
        network_latency=10e-6,
        copy_bandwidth=8e12 / 2,
    ),
}

#: Where every constant of :data:`TOPOLOGY_PRESETS` comes from.
PRESET_SOURCES: dict[str, dict[str, str]] = {
    "dgx_h100": {
        "domain_size": "8 H100 SXM GPUs per DGX H100, all-to-all over 4 NVSwitch chips: one NVLink domain "
        f"per system ({_DGX_H100_RA})",
        "domain_bandwidth": "NVLink 4: 900 GB/s bidirectional per H100 SXM GPU (18 links), i.e. 450 GB/s "
        f"in each direction ({_H100_PAGE})",
        "network_bandwidth": "8 single-port ConnectX-7 adapters per DGX H100 at up to 400 Gb/s InfiniBand "
        f"NDR each, one per GPU: 400 Gb/s = 50 GB/s per GPU and direction ({_DGX_H100_RA})",
        "copy_bandwidth": "H100 SXM HBM3: 3.35 TB/s; a copy reads and writes every byte, so 1.675 TB/s "
        f"of bytes copied ({_H100_PAGE})",
        "domain_latency": _LATENCY_NOTE,
        "network_latency": _LATENCY_NOTE,
    },
    "gb200_nvl72": {
        "domain_size": "72 Blackwell GPUs in one NVLink domain: 18 compute trays of 4 GPUs and 9 NVLink "
        f"switch trays per rack ({_GB200_PAGE}; {_DGX_GB200_HW})",
        "domain_bandwidth": "NVLink 5: 1.8 TB/s bidirectional per GPU (130 TB/s for 72 GPUs), i.e. "
        f"900 GB/s in each direction ({_GB200_PAGE})",
        "network_bandwidth": "each compute tray (4 GPUs) has 4 single-port ConnectX-7 400G OSFP NICs for "
        f"the cluster network, one per GPU: 400 Gb/s = 50 GB/s per GPU and direction ({_DGX_GB200_HW})",
        "copy_bandwidth": "HBM3e: 576 TB/s for 72 GPUs, 8 TB/s per GPU; a copy reads and writes every "
        f"byte, so 4 TB/s of bytes copied ({_GB200_PAGE})",
        "domain_latency": _LATENCY_NOTE,
        "network_latency": _LATENCY_NOTE,
    },
}

#: Settings a topology may leave out; :func:`complete_topology` takes them from this preset.
FALLBACK_PRESET = "dgx_h100"
_LINK_SETTINGS = ("domain_bandwidth", "network_bandwidth", "domain_latency", "network_latency", "copy_bandwidth")


@attrs.frozen(kw_only=True)
class CompleteTopology(Topology):
    """A :class:`Topology` that gives every link setting, as :func:`complete_topology` makes
    it: what the cost model reads (its types say that no setting is missing)."""

    domain_bandwidth: float
    network_bandwidth: float
    domain_latency: float
    network_latency: float
    copy_bandwidth: float


def complete_topology(topology: Topology, fallback: str = FALLBACK_PRESET) -> tuple[CompleteTopology, list[str]]:
    """``topology`` with every link setting it leaves out taken from the ``fallback`` preset,
    and the names of the settings so taken."""
    base = TOPOLOGY_PRESETS[fallback]
    missing = [s for s in _LINK_SETTINGS if getattr(topology, s) is None]
    links: dict[str, float] = {}
    for setting in _LINK_SETTINGS:
        value = getattr(base if setting in missing else topology, setting)
        if not math.isfinite(value) or value < 0 or (value == 0 and setting.endswith("bandwidth")):
            raise LayoutValueError(
                f"topology setting '{setting}' is {value}; bandwidths are more than 0, latencies at least 0"
            )
        links[setting] = value
    # every other setting (domain size, name) as the topology gives it
    given = attrs.asdict(topology, recurse=False, filter=lambda field, _: field.init)
    return CompleteTopology(**{**given, **links}), missing
