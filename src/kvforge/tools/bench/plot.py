"""Bar charts of a benchmark result (matplotlib, Agg backend: no display needed).

Left: the headline metric per system, the ratio in the title. Right (prefill, decode,
throughput): a second metric per system, with the machine's measured peak as a dashed line
where one applies (matmul GFLOP/s for prefill, read GB/s for decode).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    """A second plot panel: one metric per system against a measured machine reference."""

    key: str
    label: str
    reference: float | None = None
    reference_label: str = ""


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def _bars(axis: Any, names: list[str], values: list[float], ylabel: str) -> None:
    colours = [COLOURS[i % len(COLOURS)] for i in range(len(names))]
    bars = axis.bar(range(len(names)), values, color=colours)
    axis.set_xticks(range(len(names)))
    axis.set_xticklabels(names, rotation=15 if len(names) > 2 else 0, ha="right" if len(names) > 2 else "center",
                         fontsize=8)
    axis.set_ylabel(ylabel)
    axis.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
    axis.margins(y=0.15)
    axis.grid(axis="y", alpha=0.3)


def plot_result(result: dict[str, Any], path: Path, panel: Panel | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = result["systems"]
    names = [s["name"] for s in systems]
    headline = result["headline_metric"]
    columns = 2 if panel is not None else 1
    figure, axes = plt.subplots(1, columns, figsize=(5.5 * columns, 4.2), squeeze=False)
    _bars(axes[0][0], names, [float(s[headline]) for s in systems], headline)
    ratio = result.get("ratio")
    title = headline if ratio is None else f"{headline}\n{names[0]} / {names[1]} = {ratio:.2f}x"
    axes[0][0].set_title(title, fontsize=10)
    if panel is not None:
        axis = axes[0][1]
        _bars(axis, names, [float(s.get(panel.key) or 0.0) for s in systems], panel.label)
        if panel.reference:
            axis.axhline(panel.reference, color="k", linestyle="--", linewidth=1)
            axis.text(-0.4, panel.reference, f"{panel.reference_label} {panel.reference:.3g}",
                      va="bottom", ha="left", fontsize=8)
            axis.set_ylim(top=max(axis.get_ylim()[1], panel.reference * 1.15))
        axis.set_title(panel.label, fontsize=10)
    settings = ", ".join(f"{k}={v}" for k, v in result["settings"].items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool))
    settings = textwrap.fill(settings, width=55 * columns)  # keep long settings inside the figure
    figure.suptitle(f"kvforge bench {result['benchmark']}: {result['model']} {result['dtype']}, "
                    f"{result['threads']} threads\n{settings}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
