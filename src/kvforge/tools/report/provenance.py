"""Where a result came from, recorded in every JSON a measuring command writes: the command
line, the date and a one-line machine summary, so that a number never travels without them."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
from collections.abc import Sequence
from typing import Any


def command_line(argv: Sequence[str]) -> str:
    return "kvforge " + " ".join(shlex.quote(arg) for arg in argv)


def machine_summary() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    memory = ""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        memory = f", {pages * size / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores{memory}, torch {torch.__version__}, {platform.system()}"


def provenance(args: Any = None) -> dict[str, str | None]:
    """{"command", "date", "machine"}; the command is the one `kvforge.cli.main` parsed."""
    return {"command": getattr(args, "command_line", None),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_summary()}
