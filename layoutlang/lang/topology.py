"""The ``topology`` statement: its settings, their units, and the named presets.

``topology dgx_h100 { network_bandwidth = 25 GB/s }`` starts from the preset of that name
(:data:`layoutlang.model.topology.TOPOLOGY_PRESETS`) and overrides what the block sets; a
topology of any other name is made of its block alone and must give ``domain_size``.
Bandwidths are written with a unit of bytes or bits per second, latencies with a unit of
time; both are stored in bytes per second and seconds.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from ..errors import LayoutNameError, LayoutValueError, did_you_mean
from ..model import Topology
from ..model.topology import TOPOLOGY_PRESETS
from . import ast
from .limits import MAX_DOMAIN_SIZE

__all__ = ["BANDWIDTH_UNITS", "SETTINGS", "TIME_UNITS", "topology"]

#: bandwidth units, in bytes per second
BANDWIDTH_UNITS: dict[str, float] = {
    "GB/s": 1e9,
    "Gb/s": 1e9 / 8,
    "GiB/s": float(2**30),
    "MB/s": 1e6,
    "MiB/s": float(2**20),
    "TB/s": 1e12,
    "Tb/s": 1e12 / 8,
}
#: time units, in seconds
TIME_UNITS: dict[str, float] = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
#: every setting and its units (None: a whole number of ranks)
SETTINGS: dict[str, dict[str, float] | None] = {
    "domain_size": None,
    "domain_bandwidth": BANDWIDTH_UNITS,
    "network_bandwidth": BANDWIDTH_UNITS,
    "domain_latency": TIME_UNITS,
    "network_latency": TIME_UNITS,
    "copy_bandwidth": BANDWIDTH_UNITS,
    "quantize_bandwidth": BANDWIDTH_UNITS,
}


def topology(node: ast.Topology) -> Topology:
    """The topology a statement describes."""
    base = Topology(name=node.name)
    if node.name is not None:
        preset = TOPOLOGY_PRESETS.get(node.name)
        if preset is not None:
            base = preset
        elif not any(entry.key == "domain_size" for entry in node.entries):
            raise LayoutNameError(
                f"unknown topology '{node.name}' (presets: {', '.join(TOPOLOGY_PRESETS)}); "
                "a topology of another name must set domain_size",
                node.span,
                did_you_mean(node.name, TOPOLOGY_PRESETS),
            )
    values: dict[str, Any] = {}  # setting name -> value; attrs checks them against the fields
    for entry in node.entries:
        if entry.key not in SETTINGS:
            raise LayoutNameError(
                f"unknown topology setting '{entry.key}' (settings: {', '.join(SETTINGS)})",
                entry.span,
                did_you_mean(entry.key, SETTINGS),
            )
        if entry.key in values:
            raise LayoutNameError(f"topology setting '{entry.key}' is given twice", entry.span)
        values[entry.key] = _setting(entry)
    return attrs.evolve(base, **values)


def _setting(entry: ast.TopologyEntry) -> float | int:
    """The value of one setting, in ranks, bytes per second or seconds."""
    units = SETTINGS[entry.key]
    if not math.isfinite(entry.value):
        raise LayoutValueError(f"'{entry.key}' = {entry.value} is not a finite number", entry.span)
    if units is None:
        if entry.unit is not None or entry.value != int(entry.value) or entry.value < 1:
            raise LayoutValueError(f"'{entry.key}' is a whole number of ranks, at least 1", entry.span)
        if entry.value > MAX_DOMAIN_SIZE:  # the planner's integers, and exact as read
            raise LayoutValueError(
                f"'{entry.key}' = {entry.value:g} is too large: a domain holds at most {MAX_DOMAIN_SIZE:,} ranks",
                entry.span,
            )
        return int(entry.value)
    if entry.unit not in units:
        raise LayoutValueError(f"'{entry.key}' needs a unit, one of: {', '.join(units)}", entry.span)
    if entry.value < 0 or (entry.value == 0 and units is BANDWIDTH_UNITS):
        least = "more than 0" if units is BANDWIDTH_UNITS else "at least 0"
        raise LayoutValueError(f"'{entry.key}' must be {least}", entry.span)
    value = entry.value * units[entry.unit]
    if not math.isfinite(value) or (value == 0 and units is BANDWIDTH_UNITS):  # 1e308 TB/s, 1e-320 GB/s
        raise LayoutValueError(
            f"'{entry.key}' = {entry.value:g} {entry.unit} is not a number of bytes per second or seconds that"
            " layoutlang can compute with",
            entry.span,
        )
    return value
