"""Landmarks, outlier chunks and top-k chunk selection (ShadowKV, Algorithms 1 and 2).

- Landmark of a chunk = mean of its post-RoPE keys, per KV head.
- A chunk is poorly summarised by its landmark when some key in it points away from the
  mean: its score is the minimum cosine similarity between its keys and the landmark.
  The `count` lowest-scoring chunks per KV head are outliers, kept exact.
- Decode: approximate scores q . landmark x scale per query head, softmax over the
  candidate chunks, summed over the step's query tokens, max over the query heads of each
  KV group; the top-k chunks per KV head are attended exactly (after reconstruction).

Shapes: keys per head [H, n, D]; landmarks per head [H, C, D], of a batch [H, B, C, D];
queries [B, Q, heads, D] with heads = H x group (query head h reads KV head h // group).
"""

from __future__ import annotations

import torch


def chunk_landmarks(keys: torch.Tensor, chunk: int) -> torch.Tensor:
    """keys [H, C * chunk, D] -> landmarks [H, C, D] (float32 mean, then keys' dtype)."""
    heads, n, dim = keys.shape
    return keys.float().view(heads, n // chunk, chunk, dim).mean(dim=2).to(keys.dtype)


def chunk_min_cosine(keys: torch.Tensor, landmarks: torch.Tensor) -> torch.Tensor:
    """[H, C]: min over each chunk's keys of cos(key, its chunk's landmark)."""
    heads, chunks, dim = landmarks.shape
    k = keys.float().view(heads, chunks, -1, dim)
    cosine = torch.nn.functional.cosine_similarity(k, landmarks.float()[:, :, None, :], dim=-1, eps=1e-12)
    return cosine.amin(dim=-1)


def outlier_chunks(min_cosine: torch.Tensor, count: int) -> torch.Tensor:
    """[H, min(count, C)] chunk indices with the lowest scores per head, ascending index."""
    count = min(count, min_cosine.shape[-1])
    chosen = torch.topk(min_cosine, count, dim=-1, largest=False).indices
    return chosen.sort(dim=-1).values


def chunk_scores(q: torch.Tensor, landmarks: torch.Tensor | list[torch.Tensor], candidates: torch.Tensor,
                 scale: float, surely_candidates: bool = False) -> torch.Tensor:
    """Selection score per (sequence, KV head, chunk) [B, H, C].

    q [B, Q, heads, D]; landmarks head-major [H, B, C, D] (a strided view works without a
    copy) or one [H, C_b, D] per sequence; candidates [B, H, C] bool (False: not
    selectable: padding, outliers). Softmax over candidate chunks per query token and
    head, summed over query tokens, max over the query heads of a group. Non-candidates
    get -inf. `surely_candidates`: every (sequence, head) has a candidate (skips a NaN
    guard)."""
    batch, queries, heads, dim = q.shape
    chunks = candidates.shape[2]
    kv_heads = candidates.shape[1]
    group = heads // kv_heads
    qh = (q.float() * scale).view(batch, queries, kv_heads, group, dim).permute(2, 0, 3, 1, 4)
    qh = qh.reshape(kv_heads, batch, group * queries, dim)  # a small copy: contiguous
    if isinstance(landmarks, list):  # per sequence, padded (padding is not a candidate)
        logits = qh.new_zeros((kv_heads, batch, group * queries, chunks))
        for b, lm in enumerate(landmarks):
            logits[:, b, :, :lm.shape[1]] = torch.bmm(qh[:, b], lm.float().transpose(1, 2))
    elif landmarks.is_contiguous():
        lm = landmarks.float()
        logits = torch.bmm(qh.reshape(-1, group * queries, dim), lm.view(-1, chunks, dim).transpose(1, 2))
    else:  # one bmm per KV head over its [B, C, D] slice (contiguous in each head)
        lm = landmarks.float()
        logits = torch.stack([torch.bmm(qh[h], lm[h].transpose(1, 2)) for h in range(kv_heads)])
    logits = logits.view(kv_heads, batch, group, queries, chunks)
    allowed = candidates.transpose(0, 1)  # [H, B, C]
    logits = logits.masked_fill_(~allowed[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not surely_candidates:  # a head without candidates: all -inf, softmax NaN -> 0
        probs = probs.nan_to_num_(0.0)
    score = probs.sum(dim=3).amax(dim=2)  # sum over query tokens, max over the group: [H, B, C]
    return score.masked_fill_(~allowed, float("-inf")).transpose(0, 1)


def top_chunks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [B, H, k'], valid [B, H, k']) of the k highest scores, k' = min(k, C); a
    pick with score -inf (fewer candidates than k) is invalid."""
    k = min(k, scores.shape[-1])
    values, indices = torch.topk(scores, k, dim=-1)
    return indices, torch.isfinite(values)
