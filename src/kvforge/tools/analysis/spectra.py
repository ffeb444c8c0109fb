"""ShadowKV's motivation: pre-RoPE keys of a long passage are low-rank (far lower than
post-RoPE keys, values or the layer inputs), so they can be stored as a rank-r SVD; and
most chunks of 8 consecutive post-RoPE keys are well summarised by their mean, so chunk
means can serve as landmarks, the few poorly summarised chunks being kept exactly.

Spectra are of the raw matrix (no centring, as ShadowKV factorises it): rows = tokens,
columns = all KV heads concatenated (kv_heads * head_dim) for K/V. The layer input is
taken after the layer's input norm (what k_proj/v_proj read, so rank(K) <= its rank): the
raw residual stream is unusable here, since a few attention-sink tokens carry "massive
activations" (norms ~100x the others) that alone hold most of its energy.
`mean_energy` (the share of the energy in the mean row, i.e. a shared offset) is reported
beside each spectrum because it explains much of the keys' low rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.cache.shadowkv.lowrank import rank_for_energy
from kvforge.errors import require
from kvforge.tools.analysis.capture import Activations

ENERGY_LEVELS = (0.90, 0.95, 0.99)
SHADOWKV_CHUNK = 8
MATRIX_KINDS = ("keys_pre_rope", "keys_post_rope", "values", "layer_input")


def cumulative_energy(matrix: torch.Tensor) -> torch.Tensor:
    """Fraction of the squared Frobenius norm captured by the best rank-1..n approximation
    of `matrix` [T, C] (Eckart-Young): cumsum(s^2) / sum(s^2), float64 [min(T, C)]."""
    require(matrix.dim() == 2, "matrix", tuple(matrix.shape), "must be 2-D [tokens, channels]")
    x = matrix.double()
    # s^2 are the eigenvalues of the smaller Gram matrix (in float64 the squaring costs no
    # accuracy that matters at the energy levels we read), and much faster than an SVD
    # (docs/benchmarks.md#measurements-behind-design-choices).
    gram = x.T @ x if x.shape[0] >= x.shape[1] else x @ x.T
    squares = torch.linalg.eigvalsh(gram).flip(0).clamp_min(0.0)
    total = squares.sum()
    require(bool(total > 0), "matrix", "all zeros", "has no energy to distribute")
    return squares.cumsum(0) / total


def mean_energy(matrix: torch.Tensor) -> float:
    """Share of the squared norm of `matrix` [T, C] in its mean row (T * |mean|^2 / |X|^2)."""
    x = matrix.double()
    return float(x.shape[0] * x.mean(dim=0).pow(2).sum() / x.pow(2).sum())


def chunk_min_cosine(keys: torch.Tensor, chunk: int = SHADOWKV_CHUNK) -> torch.Tensor:
    """ShadowKV's outlier score per chunk: the lowest cosine similarity between a key of
    the chunk and the chunk's mean. keys [T, heads, dim] -> [heads, T // chunk] (a trailing
    partial chunk is left out, as ShadowKV keeps it in the local window)."""
    require(keys.dim() == 3, "keys", tuple(keys.shape), "must be [tokens, heads, head_dim]")
    require(chunk >= 1, "chunk", chunk, "must be >= 1")
    count = keys.shape[0] // chunk
    require(count >= 1, "tokens", keys.shape[0], f"need at least one chunk of {chunk}")
    grouped = keys[:count * chunk].double().transpose(0, 1).reshape(keys.shape[1], count, chunk, keys.shape[2])
    mean = grouped.mean(dim=2, keepdim=True)
    cosine = torch.nn.functional.cosine_similarity(grouped, mean.expand_as(grouped), dim=-1, eps=1e-12)
    return cosine.min(dim=-1).values


def _matrices(acts: Activations, layer: int) -> dict[str, torch.Tensor]:
    flat = lambda t: t.reshape(t.shape[0], -1)  # noqa: E731  [T, heads, dim] -> [T, heads * dim]
    return {"keys_pre_rope": flat(acts.keys_pre[layer]), "keys_post_rope": flat(acts.keys_post[layer]),
            "values": flat(acts.values[layer]), "layer_input": acts.attention_inputs[layer]}


def key_spectra(acts: Activations, layers: Sequence[int] | None = None) -> dict[str, Any]:
    """Numbers of the `key-spectra` analysis for `layers` (default: every layer)."""
    layers = list(range(acts.num_layers)) if layers is None else list(layers)
    require(all(0 <= i < acts.num_layers for i in layers), "layers", layers,
            f"must be in [0, {acts.num_layers})")
    per_layer = []
    for layer in tqdm(layers, desc="spectra", unit="layer"):
        entry: dict[str, Any] = {"layer": layer}
        for kind, matrix in _matrices(acts, layer).items():
            energy = cumulative_energy(matrix)
            entry[kind] = {"dim": matrix.shape[1], "energy": energy.tolist(), "mean_energy": mean_energy(matrix),
                           "rank": {f"{level:.2f}": rank_for_energy(energy, level) for level in ENERGY_LEVELS}}
        scores = chunk_min_cosine(acts.keys_post[layer])
        entry["chunk_min_cosine"] = {"values": scores.flatten().tolist(),
                                     "median": float(scores.median()), "min": float(scores.min())}
        per_layer.append(entry)
    return {"num_tokens": acts.num_tokens, "chunk": SHADOWKV_CHUNK, "energy_levels": list(ENERGY_LEVELS),
            "layers": per_layer}


def mean_rank(result: dict[str, Any], kind: str, level: str) -> float:
    ranks = [entry[kind]["rank"][level] for entry in result["layers"]]
    return sum(ranks) / len(ranks)


def summarise_key_spectra(result: dict[str, Any]) -> str:
    first = result["layers"][0]
    lines = [f"rank for 90/95/99% energy, mean over {len(result['layers'])} layers "
             f"({result['num_tokens']} tokens):"]
    for kind in MATRIX_KINDS:
        ranks = "/".join(f"{mean_rank(result, kind, f'{level:.2f}'):.1f}" for level in result["energy_levels"])
        shared = sum(entry[kind]["mean_energy"] for entry in result["layers"]) / len(result["layers"])
        lines.append(f"  {kind:<15} {ranks}  of {first[kind]['dim']}  (mean row holds {100 * shared:.0f}% of the energy)")
    scores = torch.tensor([v for entry in result["layers"] for v in entry["chunk_min_cosine"]["values"]])
    lines.append(f"chunk ({result['chunk']} post-RoPE keys) min cosine to the mean: median {scores.median():.3f}, "
                 f"{100 * float((scores < 0.5).double().mean()):.1f}% of chunks below 0.5")
    return "\n".join(lines)
