"""The markdown pieces every report table is made of: a result file's JSON (`Document`),
a table, a formatted value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Document = dict[str, Any]  # one result file's JSON


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def fmt(value: Any, pattern: str = "{:.1f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return pattern.format(value)
