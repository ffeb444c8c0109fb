"""SwiftKV's motivation: the hidden states change little from layer to layer in the
second half of a model, so the later layers' K/V can be computed from one earlier layer's
output.

Similarity of two states = cosine similarity of each token's vectors, averaged over the
tokens. `states[i]` is the input of layer i, and the last entry the model's output (before
the final norm), as `Activations.hidden` holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvforge.errors import require


def row_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of matching rows of a and b [T, C] -> [T] (float64)."""
    require(a.shape == b.shape and a.dim() == 2, "shapes", (tuple(a.shape), tuple(b.shape)),
            "must be equal [T, C]")
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1, eps=1e-12)


def similarity_matrix(states: Sequence[torch.Tensor]) -> torch.Tensor:
    """[n, n] (float64): entry (i, j) is the token-averaged cosine of states i and j."""
    require(len(states) >= 1, "states", len(states), "must not be empty")
    # Normalise each token's vector once; the mean of dot products of unit rows is then the
    # mean cosine, for all pairs in one contraction.
    unit = torch.stack([torch.nn.functional.normalize(s.double(), dim=-1, eps=1e-12) for s in states])
    return torch.einsum("itc,jtc->ij", unit, unit) / unit.shape[1]


def layer_similarity(states: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Numbers of the `layer-similarity` analysis for L layers (L + 1 states).

    next_layer[l]: layer l's input vs layer l+1's input (for the last layer: its output);
    to_last_input[l]: layer l's input vs the last layer's input;
    to_output[l]: layer l's input vs the model's output."""
    require(len(states) >= 2, "states", len(states), "need the inputs of >= 1 layer and the output")
    matrix = similarity_matrix(states)
    layers = len(states) - 1
    return {
        "num_layers": layers,
        "next_layer": [float(matrix[i, i + 1]) for i in range(layers)],
        "to_last_input": [float(matrix[i, layers - 1]) for i in range(layers)],
        "to_output": [float(matrix[i, layers]) for i in range(layers)],
        "matrix": matrix.tolist(),
    }


def summarise_layer_similarity(result: dict[str, Any]) -> str:
    nxt = result["next_layer"]
    half = len(nxt) // 2
    first, second = nxt[:half], nxt[half:]
    lines = [
        f"adjacent-layer input cosine: mean {sum(first) / max(len(first), 1):.3f} in the first half of the "
        f"layers, {sum(second) / len(second):.3f} in the second half (min {min(nxt):.3f} at layer "
        f"{nxt.index(min(nxt))})",
        "cosine to the last layer's input by layer: "
        + " ".join(f"{i}:{v:.2f}" for i, v in enumerate(result["to_last_input"])),
    ]
    return "\n".join(lines)
