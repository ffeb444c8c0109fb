"""ShadowKV's decode step for one global layer as Triton kernels over a whole decode group.

The PyTorch path (sparse.py) is the reference; these kernels compute the same landmark
scores, rebuilt keys, value write-back and attention for every sequence of a decode group
(one query token each) in one launch each, with no loop
over sequences or heads on the host:
- `landmark_scores`: q . landmark x scale per query head, softmax over the sequence's
  candidate chunks, max over the query heads of a KV group -> [B, H, Cmax] float32
  (-inf for non-candidates and padding); one program per (sequence, KV head), two passes
  over the chunks (running max and sum, then probabilities);
- `rebuild_keys`: keys of the slots that receive a miss = coefficients [chunk, r] x the
  head's basis slice [r, D], rotated at the chunk's positions, written into the slot; one
  program per (sequence, KV head, slot), which does nothing for a slot without a miss;
- `write_values`: values of the misses (one staged copy from the slow tier, in the
  order of their flat (sequence, head, slot) index) into their slots; one program per miss;
- `slot_attention`: the step's token written into the last window row, then the group's
  query heads over the buffer rows in use (outliers, reuse slots, exact window, the token),
  online softmax in tiles of rows; slots whose id is < 0 are masked when `mask_slots` (a
  sequence with fewer candidates than k).
Dot products and softmax run in float32 (IEEE dots, no TF32); results are written in the
buffers' / q's dtype.

Each sequence's own tensors are addressed through `info`, the layer's pointer table
(pointer_table.py). The reuse slots' kernels and the in-place value read are in
triton_slots.py.

Importing this module imports triton (kernels/triton_jit.py); sparse.py imports it only
for a decode group on the Triton path, so CPU runs never import triton.
"""

from __future__ import annotations

import torch

from kvforge.cache.shadowkv.pointer_table import (
    BASIS,
    CANDIDATES,
    CHUNKS,
    COEFFICIENTS,
    FIELDS,
    KEYS,
    RANK,
    ROWS,
    ROWS_USED,
    SLOTS_START,
    VALUES,
    WINDOW_START,
    table_pointer,
)
from kvforge.errors import require
from kvforge.kernels.triton_jit import INTERPRETED, decode_warps, jit, tl, triton

__all__ = ["check_device", "landmark_scores", "rebuild_keys", "slot_attention", "write_values"]

MIN_DOT = 16  # smallest dimension tl.dot accepts
BLOCK_C = 32  # chunks per tile of the scores
BLOCK_N = 32  # buffer rows per tile of the attention
BLOCK_R = 16  # rank columns per tile of the rebuild


@jit
def _scores_kernel(q_ptr, landmarks_ptr, table_ptr, info_ptr, scores_ptr, sq_b, sq_h, sl_h, sl_p, stab_b, width,
                   scale, QUERY_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, NFIELDS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    kv_heads = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * sq_b + (kv_head * QUERY_GROUP + rows)[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale
    chunks = tl.load(info_ptr + seq * NFIELDS + CHUNKS)
    allowed_ptr = table_pointer(info_ptr + seq * NFIELDS, CANDIDATES, tl.int8) + kv_head * chunks
    lm_base = landmarks_ptr + kv_head * sl_h
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    # Pass 1: per query head, the max and the sum of exp over the candidate chunks.
    for start in range(0, chunks, BLOCK):
        c = start + cols
        allowed = tl.load(allowed_ptr + c, mask=c < chunks, other=0) != 0
        page = tl.load(table_ptr + seq * stab_b + c, mask=allowed, other=0).to(tl.int64)
        lm = tl.load(lm_base + page[:, None] * sl_p + dims[None, :], mask=allowed[:, None] & dim_ok[None, :],
                     other=0.0).to(tl.float32)
        logits = tl.where(allowed[None, :], tl.dot(q, tl.trans(lm), input_precision="ieee"), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # no candidate yet: nothing to rescale
        running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
        running_max = new_max
    # Pass 2: probabilities, max over the query heads of the group; every column of the
    # table's width is written (-inf where not a candidate).
    safe = tl.where(running_max == float("-inf"), 0.0, running_max)
    inverse = 1.0 / tl.where(running_sum > 0, running_sum, 1.0)
    for start in range(0, width, BLOCK):
        c = start + cols
        allowed = tl.load(allowed_ptr + c, mask=c < chunks, other=0) != 0
        page = tl.load(table_ptr + seq * stab_b + c, mask=allowed, other=0).to(tl.int64)
        lm = tl.load(lm_base + page[:, None] * sl_p + dims[None, :], mask=allowed[:, None] & dim_ok[None, :],
                     other=0.0).to(tl.float32)
        logits = tl.dot(q, tl.trans(lm), input_precision="ieee")
        probs = tl.exp(logits - safe[:, None]) * inverse[:, None]
        score = tl.max(tl.where(row_ok[:, None], probs, float("-inf")), axis=0)
        score = tl.where(allowed, score, float("-inf"))
        tl.store(scores_ptr + (seq * kv_heads + kv_head) * width + c, score, mask=c < width)


@jit
def _rebuild_kernel(info_ptr, keys_like, basis_like, coef_like, new_ids_ptr, filled_ptr, cos_ptr, sin_ptr,
                    basis_width, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_R: tl.constexpr, NFIELDS: tl.constexpr):
    # slots on the grid's x axis: CUDA caps y and z at 65,535, x at 2**31 - 1
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    slot_index = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(0) + slot
    if tl.load(filled_ptr + slot_index) != 0:  # only slots that receive a miss are written
        chunk_id = tl.load(new_ids_ptr + slot_index)
        info = info_ptr + seq * NFIELDS
        keys = table_pointer(info, KEYS, keys_like.dtype.element_ty)
        basis = table_pointer(info, BASIS, basis_like.dtype.element_ty)
        coefficients = table_pointer(info, COEFFICIENTS, coef_like.dtype.element_ty)
        rank = tl.load(info + RANK)
        rows = tl.load(info + ROWS)
        first_row = tl.load(info + SLOTS_START) + slot * CHUNK
        tokens = tl.arange(0, BLOCK_T)
        halves = tl.arange(0, BLOCK_HALF)
        token_ok = tokens < CHUNK
        half_ok = halves < HALF
        low = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)
        high = tl.zeros([BLOCK_T, BLOCK_HALF], tl.float32)
        coef_base = coefficients + chunk_id * CHUNK * rank
        basis_base = basis + kv_head * HEAD_DIM  # row j of the head's slice: basis_base + j * basis_width
        for start in range(0, rank, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            r_ok = r < rank
            a = tl.load(coef_base + tokens[:, None] * rank + r[None, :], mask=token_ok[:, None] & r_ok[None, :],
                        other=0.0).to(tl.float32)
            b_mask = r_ok[:, None] & half_ok[None, :]
            b_low = tl.load(basis_base + r[:, None] * basis_width + halves[None, :], mask=b_mask,
                            other=0.0).to(tl.float32)
            b_high = tl.load(basis_base + r[:, None] * basis_width + HALF + halves[None, :], mask=b_mask,
                             other=0.0).to(tl.float32)
            low += tl.dot(a, b_low, input_precision="ieee")
            high += tl.dot(a, b_high, input_precision="ieee")
        # RoPE at positions chunk_id x chunk + t: rotate_half(x) = (-x[half:], x[:half]).
        mask = token_ok[:, None] & half_ok[None, :]
        table = (chunk_id * CHUNK + tokens)[:, None] * HEAD_DIM + halves[None, :]
        cos_low = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
        cos_high = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        sin_low = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
        sin_high = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        out = keys + (kv_head * rows + first_row + tokens)[:, None] * HEAD_DIM + halves[None, :]
        element = keys_like.dtype.element_ty
        tl.store(out, (low * cos_low - high * sin_low).to(element), mask=mask)
        tl.store(out + HALF, (high * cos_high + low * sin_high).to(element), mask=mask)


@jit
def _values_kernel(info_ptr, values_like, fetched_ptr, order_ptr, kv_heads, slots, CHUNK: tl.constexpr,
                   BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NFIELDS: tl.constexpr):
    miss = tl.program_id(0).to(tl.int64)
    flat = tl.load(order_ptr + miss)  # (sequence, head, slot) of the miss
    seq = flat // (kv_heads * slots)
    kv_head = (flat // slots) % kv_heads
    slot = flat % slots
    info = info_ptr + seq * NFIELDS
    values = table_pointer(info, VALUES, values_like.dtype.element_ty)
    rows = tl.load(info + ROWS)
    first_row = tl.load(info + SLOTS_START) + slot * CHUNK
    tokens = tl.arange(0, BLOCK_T)
    dims = tl.arange(0, BLOCK_D)
    mask = (tokens < CHUNK)[:, None] & (dims < HEAD_DIM)[None, :]
    data = tl.load(fetched_ptr + (miss * CHUNK + tokens)[:, None] * HEAD_DIM + dims[None, :], mask=mask)
    tl.store(values + (kv_head * rows + first_row + tokens)[:, None] * HEAD_DIM + dims[None, :],
             data.to(values_like.dtype.element_ty), mask=mask)


@jit
def _attention_kernel(q_ptr, own_k_ptr, own_v_ptr, info_ptr, keys_like, slot_ids_ptr, out_ptr, sq_b, sq_h, so_b,
                      so_h, sv_b, sv_h, slots, scale,
                      QUERY_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, MASK_SLOTS: tl.constexpr,
                      NFIELDS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    kv_heads = tl.num_programs(1)
    group_rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    offsets = tl.arange(0, BLOCK)
    row_ok = group_rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * QUERY_GROUP + group_rows
    q = tl.load(q_ptr + seq * sq_b + heads[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale
    info = info_ptr + seq * NFIELDS
    element = keys_like.dtype.element_ty
    keys = table_pointer(info, KEYS, element)
    values = table_pointer(info, VALUES, element)
    rows = tl.load(info + ROWS)
    slots_start = tl.load(info + SLOTS_START)
    window_start = tl.load(info + WINDOW_START)
    used = tl.load(info + ROWS_USED)
    ids = slot_ids_ptr + (seq * kv_heads + kv_head) * slots
    # The step's own token (the last row in use) comes from own_k/own_v, is stored into
    # that row for later steps, and seeds the softmax: it is always visible, so every
    # query head has a finite max and a sum >= 1.
    k_own = tl.load(own_k_ptr + seq * so_b + kv_head * so_h + dims, mask=dim_ok, other=0.0)
    v_own = tl.load(own_v_ptr + seq * sv_b + kv_head * sv_h + dims, mask=dim_ok, other=0.0)
    last = (kv_head * rows + used - 1) * HEAD_DIM + dims
    tl.store(keys + last, k_own.to(element), mask=dim_ok)
    tl.store(values + last, v_own.to(element), mask=dim_ok)
    # as the buffer holds them (rounded to its dtype)
    k_own = k_own.to(element).to(tl.float32)
    v_own = v_own.to(element).to(tl.float32)
    running_max = tl.sum(q * k_own[None, :], axis=1)
    running_sum = tl.full([BLOCK_G], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_own[None, :]
    for start in range(0, used - 1, BLOCK):
        row = start + offsets
        visible = row < used - 1
        if MASK_SLOTS:  # a slot holding no chunk of this step (id < 0) is not attended
            in_slots = (row >= slots_start) & (row < window_start)
            held = tl.load(ids + (row - slots_start) // CHUNK, mask=visible & in_slots, other=0)
            visible = visible & (~in_slots | (held >= 0))
        kv_mask = visible[:, None] & dim_ok[None, :]
        base = (kv_head * rows + row)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(keys + base, mask=kv_mask, other=0.0).to(tl.float32)
        logits = tl.where(visible[None, :], tl.dot(q, tl.trans(k), input_precision="ieee"), float("-inf"))
        v = tl.load(values + base, mask=kv_mask, other=0.0).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))  # finite: seeded by the own token
        probs = tl.exp(logits - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * sq_b + heads[:, None] * sq_h + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


def check_device(t: torch.Tensor, what: str) -> None:
    if triton is None:
        raise RuntimeError("the Triton ShadowKV kernels need the `triton` package (pip install 'kvforge[triton]')")
    if not (t.is_cuda or INTERPRETED):
        raise ValueError(f"{what} runs on CUDA tensors (or on CPU tensors when TRITON_INTERPRET=1 was set before "
                         f"kvforge.kernels.triton_jit was imported)")


def _block(n: int) -> int:
    return max(MIN_DOT, triton.next_power_of_2(n))


def landmark_scores(q: torch.Tensor, landmarks: torch.Tensor, table: torch.Tensor, info: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """q [B, heads, D] (RoPE applied); landmarks [H, P, D] (unit stride along D); table
    [B, Cmax] int64 page ids -> scores [B, H, Cmax] float32, as `select.chunk_scores` for
    one query token."""
    check_device(q, "landmark_scores")
    batch, heads, dim = q.shape
    kv_heads, width = landmarks.shape[0], table.shape[1]
    require(landmarks.stride(-1) == 1 and q.stride(-1) == 1, "landmarks", tuple(landmarks.stride()),
            "and q must have unit stride along head_dim")
    scores = torch.empty((batch, kv_heads, width), dtype=torch.float32, device=q.device)
    with torch.cuda.device_of(q):
        _scores_kernel[(batch, kv_heads)](
            q, landmarks, table, info, scores, q.stride(0), q.stride(1), landmarks.stride(0), landmarks.stride(1),
            table.stride(0), width, float(scale), QUERY_GROUP=heads // kv_heads,
            BLOCK_G=_block(heads // kv_heads), HEAD_DIM=dim, BLOCK_D=_block(dim), BLOCK=BLOCK_C, NFIELDS=FIELDS,
            num_warps=decode_warps())
    return scores


def rebuild_keys(info: torch.Tensor, keys_like: torch.Tensor, basis_like: torch.Tensor, coef_like: torch.Tensor,
                 new_ids: torch.Tensor, filled: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 chunk: int) -> None:
    """Rebuild into the key buffers (in place) the chunk new_ids[b, h, j] of every slot
    with filled[b, h, j] ([B, H, slots] int64 / bool, contiguous); cos/sin [N, D] tables
    of positions 0..N-1 with N >= chunk x (most chunks of a sequence)."""
    check_device(new_ids, "rebuild_keys")
    batch, kv_heads, slots = new_ids.shape
    dim = cos.shape[-1]
    if new_ids.numel() == 0:
        return
    with torch.cuda.device_of(new_ids):
        _rebuild_kernel[(slots, kv_heads, batch)](
            info, keys_like, basis_like, coef_like, new_ids, filled, cos, sin, kv_heads * dim, CHUNK=chunk,
            BLOCK_T=_block(chunk), HEAD_DIM=dim, HALF=dim // 2, BLOCK_HALF=_block(dim // 2), BLOCK_R=BLOCK_R,
            NFIELDS=FIELDS)


def write_values(info: torch.Tensor, values_like: torch.Tensor, fetched: torch.Tensor, order: torch.Tensor,
                 kv_heads: int, slots: int) -> None:
    """fetched [M, chunk, D] (contiguous) into the value buffers: miss m into the slot with
    flat index order[m] = (b x kv_heads + h) x slots + j."""
    check_device(fetched, "write_values")
    misses, chunk, dim = fetched.shape
    if misses == 0:
        return
    with torch.cuda.device_of(fetched):
        _values_kernel[(misses,)](info, values_like, fetched, order, kv_heads, slots, CHUNK=chunk,
                                  BLOCK_T=triton.next_power_of_2(chunk), HEAD_DIM=dim,
                                  BLOCK_D=triton.next_power_of_2(dim), NFIELDS=FIELDS)


def slot_attention(q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, info: torch.Tensor,
                   keys_like: torch.Tensor, slot_ids: torch.Tensor, chunk: int, scale: float,
                   mask_slots: bool) -> torch.Tensor:
    """q [B, heads, D] (contiguous) over each sequence's buffer rows [0, rows used), slots
    with slot_ids [B, H, slots] < 0 masked when `mask_slots` -> [B, heads, D] in q's dtype.
    The last row in use is the step's token own_k/own_v [B, H, D] (each head's D values
    contiguous; the rows and heads at any strides, e.g. v as a slice of a packed q/k/v
    projection), which the kernel writes into the buffers."""
    check_device(q, "slot_attention")
    require(own_k.stride(-1) == 1 and own_v.shape == own_k.shape and own_v.stride(-1) == 1, "own_k",
            tuple(own_k.shape), f"must be [B, H, D] as own_v {tuple(own_v.shape)}, each head's D values contiguous")
    batch, heads, dim = q.shape
    kv_heads, slots = slot_ids.shape[1], slot_ids.shape[2]
    out = torch.empty_like(q)
    with torch.cuda.device_of(q):
        _attention_kernel[(batch, kv_heads)](
            q, own_k, own_v, info, keys_like, slot_ids, out, q.stride(0), q.stride(1), own_k.stride(0),
            own_k.stride(1), own_v.stride(0), own_v.stride(1), slots, float(scale),
            QUERY_GROUP=heads // kv_heads, BLOCK_G=_block(heads // kv_heads), HEAD_DIM=dim, BLOCK_D=_block(dim),
            CHUNK=chunk, BLOCK=BLOCK_N, MASK_SLOTS=mask_slots, NFIELDS=FIELDS, num_warps=decode_warps())
    return out
