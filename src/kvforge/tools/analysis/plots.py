"""Figures of the analyses (matplotlib, Agg backend: no display needed). Each function
reads the JSON-ready result of its analysis and writes one PNG."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from kvforge.tools.analysis.spectra import MATRIX_KINDS

KIND_STYLE = {  # colour, label
    "keys_pre_rope": ("#1f77b4", "keys, pre-RoPE"),
    "keys_post_rope": ("#d62728", "keys, post-RoPE"),
    "values": ("#2ca02c", "values"),
    "layer_input": ("#7f7f7f", "layer input, normed"),
}
DPI = 90


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plain_log_labels(axis: Any) -> None:
    """Log y axis labelled 1, 2, 5, 10, 20, ... as plain numbers (not 2x10^0)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.yaxis.set_minor_formatter(NullFormatter())


def _layer_axis(axis: Any, result: dict[str, Any]) -> None:
    """Integer layer ticks; for models mixing sliding-window and global layers (Gemma3),
    a light vertical line at each global-attention layer."""
    from matplotlib.ticker import MaxNLocator

    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    for index, layer in enumerate(result.get("global_layers", [])):
        axis.axvline(layer, color="#9467bd", alpha=0.35, linewidth=3,
                     label="global-attention layer" if index == 0 else None)


def _save(figure: Any, path: Path) -> None:
    """Write a 256-colour palette PNG: line plots lose nothing visible and the file is about
    a third of matplotlib's RGBA one, small enough to keep figures in docs/."""
    from PIL import Image  # a matplotlib dependency

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=DPI, format="png")
    _pyplot().close(figure)
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(colors=256).save(path, optimize=True)


def plot_layer_similarity(result: dict[str, Any], title: str, path: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator
    layers = list(range(result["num_layers"]))
    figure, (lines, heat) = plt.subplots(1, 2, figsize=(11, 4.3))
    lines.plot(layers, result["next_layer"], marker="o", markersize=3, label="layer l vs l+1 (last: output)")
    lines.plot(layers, result["to_last_input"], marker="s", markersize=3,
               label=f"layer l vs last layer ({layers[-1]}) input")
    lines.plot(layers, result["to_output"], linestyle="--", label="layer l vs model output")
    lines.set_xlabel("layer l (input hidden states)")
    _layer_axis(lines, result)
    lines.set_ylabel("cosine similarity, mean over tokens")
    lines.set_ylim(min(0.0, min(result["to_output"]) - 0.05), 1.02)
    lines.grid(alpha=0.3)
    lines.legend(fontsize=8, loc="lower right")
    lines.set_title("input similarity by depth", fontsize=10)
    image = heat.imshow(result["matrix"], vmin=0.0, vmax=1.0, cmap="viridis", origin="upper")
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    heat.yaxis.set_major_locator(MaxNLocator(integer=True))
    heat.set_xlabel("layer j input (last column: output)")
    heat.set_ylabel("layer i input (last row: output)")
    heat.set_title("cosine(input of i, input of j)", fontsize=10)
    negative = min(min(row) for row in result["matrix"]) < 0
    figure.colorbar(image, ax=heat, fraction=0.046, extend="min" if negative else "neither")
    figure.suptitle(f"SwiftKV motivation: layer-input similarity, {title}", fontsize=10)
    _save(figure, path)


def plot_key_spectra(result: dict[str, Any], title: str, path: Path) -> None:
    plt = _pyplot()
    entries = result["layers"]
    figure, (curves, ranks, hist) = plt.subplots(1, 3, figsize=(15, 4.3))
    for kind in MATRIX_KINDS:
        colour, label = KIND_STYLE[kind]
        energies = [entry[kind]["energy"] for entry in entries]
        ranks_axis = list(range(1, len(energies[0]) + 1))
        # Median curve over layers, with the layers' spread as a band.
        columns = list(zip(*energies))
        median = [sorted(c)[len(c) // 2] for c in columns]
        curves.fill_between(ranks_axis, [min(c) for c in columns], [max(c) for c in columns],
                            color=colour, alpha=0.15, linewidth=0)
        curves.plot(ranks_axis, median, color=colour, label=f"{label} (dim {entries[0][kind]['dim']})")
        ranks.plot([entry["layer"] for entry in entries], [entry[kind]["rank"]["0.90"] for entry in entries],
                   color=colour, marker="o", markersize=3, label=label)
    curves.set_xscale("log")
    curves.set_xlabel("rank")
    curves.set_ylabel("cumulative energy (sum of s^2)")
    curves.set_title("normalised singular-value spectra\n(median over layers, band: min-max)", fontsize=10)
    curves.axhline(0.9, color="k", linewidth=0.7, linestyle=":")
    curves.grid(alpha=0.3, which="both")
    curves.legend(fontsize=8, loc="lower right")
    ranks.set_xlabel("layer")
    _layer_axis(ranks, result)
    ranks.set_ylabel("rank for 90% energy")
    ranks.set_yscale("log")
    _plain_log_labels(ranks)
    ranks.set_title("rank needed for 90% of the energy", fontsize=10)
    ranks.grid(alpha=0.3, which="both")
    ranks.legend(fontsize=8)
    scores = [v for entry in entries for v in entry["chunk_min_cosine"]["values"]]
    hist.hist(scores, bins=50, range=(min(-0.1, min(scores)), 1.0), color=KIND_STYLE["keys_post_rope"][0])
    median = sorted(scores)[len(scores) // 2]
    below = sum(score < 0.5 for score in scores) / len(scores)
    hist.axvline(median, color="k", linewidth=0.8, linestyle="--")
    hist.text(0.03, 0.95, f"median {median:.3f}\n{100 * below:.1f}% of chunks < 0.5", transform=hist.transAxes,
              va="top", fontsize=8)
    hist.set_yscale("log")
    hist.set_xlabel(f"min cosine of a chunk's {result['chunk']} post-RoPE keys to their mean")
    hist.set_ylabel("chunks (all layers and KV heads)")
    hist.set_title("ShadowKV landmark quality (low = outlier chunk)", fontsize=10)
    hist.grid(alpha=0.3)
    figure.suptitle(f"ShadowKV motivation: key spectra, {title}, {result['num_tokens']} tokens", fontsize=10)
    _save(figure, path)


def plot_kv_channels(result: dict[str, Any], title: str, path: Path) -> None:
    plt = _pyplot()
    layer, head_dim = result["layer"], result["head_dim"]
    figure = plt.figure(figsize=(12, 6.8))
    grid = figure.add_gridspec(2, 2)
    for column, (name, key) in enumerate((("keys (post-RoPE)", "key_magnitude"), ("values", "value_magnitude"))):
        axis = figure.add_subplot(grid[0, column])
        magnitude = result[key]
        axis.bar(range(len(magnitude)), magnitude, width=1.0,
                 color=KIND_STYLE["keys_post_rope" if column == 0 else "values"][0])
        for head in range(1, result["num_kv_heads"]):
            axis.axvline(head * head_dim - 0.5, color="k", linewidth=0.6, linestyle=":")
        ratio = result["max_median_ratio"]["keys_post_rope" if column == 0 else "values"][layer]
        axis.set_title(f"layer {layer} {name}: max/median = {ratio:.1f}", fontsize=10)
        axis.set_xlabel("channel (kv_head * head_dim + d; dotted: head boundary)" if result["num_kv_heads"] > 1
                        else "channel (one KV head)")
        axis.set_ylabel("mean |x| over tokens")
        axis.grid(axis="y", alpha=0.3)
    summary = figure.add_subplot(grid[1, :])
    ratios = result["max_median_ratio"]
    layers = list(range(len(ratios["values"])))
    summary.plot(layers, ratios["keys_post_rope"], marker="o", markersize=3,
                 color=KIND_STYLE["keys_post_rope"][0], label="keys, post-RoPE")
    summary.plot(layers, ratios["keys_pre_rope"], linestyle="--", color=KIND_STYLE["keys_pre_rope"][0],
                 label="keys, pre-RoPE")
    summary.plot(layers, ratios["values"], marker="s", markersize=3, color=KIND_STYLE["values"][0], label="values")
    summary.set_yscale("log")
    _plain_log_labels(summary)
    summary.set_xlabel("layer")
    _layer_axis(summary, result)
    summary.set_ylabel("max / median channel magnitude")
    summary.set_title("outlier-channel ratio per layer", fontsize=10)
    summary.grid(alpha=0.3, which="both")
    summary.legend(fontsize=8)
    figure.suptitle(f"KIVI motivation: per-channel magnitude of keys vs values, {title}, "
                    f"{result['num_tokens']} tokens", fontsize=10)
    _save(figure, path)
