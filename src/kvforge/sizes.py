"""Byte sizes as users write them ("512MB", "2GiB", "1e9") and as we print them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvforge.errors import ConfigError, require

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30,
}


def parse_bytes(value: str | int | float, parameter: str = "kv_budget") -> int:
    """Parse a byte count; decimal units (MB) are powers of 10, binary ones (MiB) of 2."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ConfigError(parameter, value, "must be a byte count such as 512MB, 2GiB or 1000000")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(parameter, value, "must be > 0 bytes")
    return size


def format_bytes(size: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


def meminfo_bytes(field: str, meminfo: str | Path = "/proc/meminfo") -> int | None:
    """One `Field:  N kB` line of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """This machine's RAM plus swap (None where unknown): no one allocation larger than this
    can succeed (Linux's default overcommit refuses it)."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return ram + (meminfo_bytes("SwapTotal", meminfo) or 0)


def check_host_budget(value: str | int | float, parameter: str = "kv_budget") -> int:
    """A budget held in host memory (a cache on the CPU): a byte count this machine's RAM and
    swap could hold, so that a typo such as 10TB is refused before any weights load."""
    size = parse_bytes(value, parameter)
    memory = host_memory_bytes()
    require(memory is None or size <= memory, parameter, value,
            f"must fit in this machine's memory ({format_bytes(memory or 0)} of RAM and swap)")
    return size
