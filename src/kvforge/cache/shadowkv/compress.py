"""Compression of one global layer of a sequence (ShadowKV Algorithm 1) and folding of
exact tail tokens into chunks (ShadowKV+). Pure tensor functions; storage is the caller's.

Compression of n tokens with prefix p = C x chunk (the rest, [p, n), stays exact):
- landmarks: chunk means of the post-RoPE prefix keys; per chunk the min cosine
  similarity of its keys to the mean; the `outliers` lowest chunks per KV head keep their
  exact keys and values;
- pre-RoPE keys of all n tokens -> their spectrum (lowrank.py), the layer's rank r from
  the config's rule (which may read the spectrum and which keys stay exact: `LayerKeys`),
  basis B [r, W]; coefficients of the prefix tokens A = K_pre @ B^T;
- the prefix values go to the slow tier (all chunks, outliers included, so any chunk can
  be fetched by id; the outliers' copy on the fast tier is what attention reads).
Folding m whole chunks of the exact tail projects their pre-RoPE keys onto the existing
basis and adds their landmarks and values, exactly like prefix chunks (no new outliers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.cache.shadowkv.lowrank import KeySpectrum, key_spectrum, project
from kvforge.cache.shadowkv.select import chunk_landmarks, chunk_min_cosine, outlier_chunks
from kvforge.cache.shadowkv.state import LayerState, buffer_rows
from kvforge.rope import PositionedRope


@dataclass(frozen=True)
class LayerKeys:
    """What a rank rule may read about one layer of one sequence at compression:
    keys_pre [n, W] and their spectrum, keys_post/values [H, n, D] of positions 0..n-1,
    `exact` [H, n] the keys compression keeps exact (outlier chunks, the local tail)."""

    spectrum: KeySpectrum
    keys_pre: torch.Tensor
    keys_post: torch.Tensor
    values: torch.Tensor
    exact: torch.Tensor
    rope: PositionedRope


@dataclass(frozen=True)
class ChunkData:
    """What goes into chunk pages for C chunks."""

    coefficients: torch.Tensor  # [C, chunk, r]
    landmarks: torch.Tensor  # [H, C, D]
    values: torch.Tensor  # [H, C, chunk, D]


def unrotate(keys: torch.Tensor, first_position: int, rope: PositionedRope) -> torch.Tensor:
    """Post-RoPE keys [H, m, D] at positions first.. -> pre-RoPE keys [m, H, D] (RoPE at -p
    is the inverse rotation)."""
    positions = torch.arange(first_position, first_position + keys.shape[1], device=keys.device)
    return rope.apply_at(keys.transpose(0, 1), -positions)


def _chunk_data(keys_post: torch.Tensor, keys_pre: torch.Tensor, values: torch.Tensor, basis: torch.Tensor,
                chunk: int, landmarks: torch.Tensor | None = None) -> ChunkData:
    heads, m, dim = keys_post.shape
    count = m // chunk
    coefficients = project(keys_pre.reshape(m, -1), basis).view(count, chunk, -1)
    landmarks = chunk_landmarks(keys_post, chunk) if landmarks is None else landmarks
    return ChunkData(coefficients, landmarks, values.reshape(heads, count, chunk, dim))


def compress_layer(keys_post: torch.Tensor, values: torch.Tensor, rope: PositionedRope, prefix: int,
                   layer_rank: Callable[[LayerKeys], int], chunk: int, outliers: int, window_capacity: int,
                   chunks_per_step: int, coefficient_dtype: torch.dtype | None = None
                   ) -> tuple[LayerState, ChunkData]:
    """keys_post/values [H, n, D] of positions 0..n-1; prefix a multiple of chunk with
    n - prefix <= window_capacity; `layer_rank` gives the layer's rank from what it may
    read (`LayerKeys`); the layer stores its coefficients in `coefficient_dtype` (None: the
    keys' dtype)."""
    heads, n, dim = keys_post.shape
    keys_pre = unrotate(keys_post, 0, rope)  # [n, H, D]
    landmarks = chunk_landmarks(keys_post[:, :prefix], chunk)
    chosen = outlier_chunks(chunk_min_cosine(keys_post[:, :prefix], landmarks), outliers)  # [H, O]
    exact = torch.zeros((heads, n), dtype=torch.bool, device=keys_post.device)
    exact[:, prefix:] = True
    exact[:, :prefix].view(heads, -1, chunk).scatter_(
        1, chosen[:, :, None].expand(-1, -1, chunk), True)
    flat_pre = keys_pre.reshape(n, heads * dim)
    spectrum = key_spectrum(flat_pre)
    basis = spectrum.basis(layer_rank(LayerKeys(spectrum, flat_pre, keys_post, values, exact, rope)))
    data = _chunk_data(keys_post[:, :prefix], keys_pre[:prefix], values[:, :prefix], basis, chunk, landmarks)
    count = chosen.shape[1]
    _, window_start, rows = buffer_rows(count, chunk, window_capacity, chunks_per_step)
    keys = keys_post.new_zeros((heads, rows, dim))  # zeros: masked rows must stay finite
    vals = values.new_zeros((heads, rows, dim))
    gather = chosen[:, :, None, None].expand(heads, count, chunk, dim)
    keys[:, :count * chunk] = keys_post[:, :prefix].reshape(heads, -1, chunk, dim).gather(1, gather) \
        .reshape(heads, -1, dim)
    vals[:, :count * chunk] = data.values.gather(1, gather).reshape(heads, -1, dim)
    keys[:, window_start:window_start + n - prefix] = keys_post[:, prefix:]
    vals[:, window_start:window_start + n - prefix] = values[:, prefix:]
    slot_ids = torch.full((heads, chunks_per_step), -1, dtype=torch.long, device=keys_post.device)
    candidates = torch.ones((heads, prefix // chunk), dtype=torch.bool, device=keys_post.device)
    candidates.scatter_(1, chosen, False)
    stored = data.coefficients.to(coefficient_dtype or data.coefficients.dtype)
    return LayerState(basis, stored, chosen, keys, vals, slot_ids, candidates), data


def append_coefficients(layer: LayerState, first_chunk: int, coefficients: torch.Tensor, capacity: int) -> None:
    """Store folded chunks' coefficients [m, chunk, r] at rows first_chunk.. of the layer,
    its storage grown to `capacity` chunks if smaller (the caller reserved those bytes)."""
    end = first_chunk + coefficients.shape[0]
    assert end <= capacity
    if capacity > layer.coefficients.shape[0]:
        grown = layer.coefficients.new_empty((capacity, *layer.coefficients.shape[1:]))
        grown[:first_chunk] = layer.coefficients[:first_chunk]
        layer.coefficients = grown
    layer.coefficients[first_chunk:end] = coefficients.to(layer.coefficients.dtype)


def fold_chunks(keys_post: torch.Tensor, values: torch.Tensor, first_position: int, basis: torch.Tensor,
                rope: PositionedRope, chunk: int) -> ChunkData:
    """keys_post/values [H, m, D] (m a multiple of chunk) at positions first.. -> chunk data
    on the existing basis."""
    return _chunk_data(keys_post, unrotate(keys_post, first_position, rope), values, basis, chunk)
