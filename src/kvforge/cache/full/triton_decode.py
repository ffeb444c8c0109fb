"""Decode attention over the paged `full` store as one Triton kernel (CUDA), plus a small
reduce kernel when a sequence's tokens are split.

`paged_decode_attention_triton` takes the arguments of `cache.attention.decode_attention`
(without `tile_pages`) and returns the same attention, parity-tested against it. It reads
the pages in place through the page table, as vLLM's paged attention does: one program
handles one (sequence, kv head, split) triple; the `heads // kv_heads` queries of the group
are loaded once (padded to 16 rows for `tl.dot`) and walk their split's share of the visible
tokens [visible_from, visible_to) in tiles of `BLOCK_T` tokens. Every token looks up its own
page (column (t - first_page_position) // block of its table row), so any block size works
and a tile may span pages. Scores, softmax and the weighted sum run in float32 with IEEE
dot products (no TF32), the step's own key and value seed split 0, and the result is
written in q's dtype.

Invariants the callers rely on:
- only visible tokens are read: table entries of hidden columns (padding, pages before a
  window) are never loaded, nor the K/V of hidden slots, so they may hold anything (-1, a
  scratch page, NaN bits from torch.empty);
- a row with visible_to == visible_from (a padding row of a CUDA-graph bucket, or a
  sequence with nothing stored) attends only to its own token;
- nothing is read on the host: the grid and the split count depend on shapes only (the
  batch, the table's width, the device), so the launch can be captured in a CUDA graph and
  replayed with new tables and lengths of the same shapes.

Split-K (flash-decoding): the range of token slots a table row can hold (width x block) is
cut into `splits` parts of a multiple of BLOCK_T tokens; each program writes its
unnormalised accumulator, running max and running sum, and `_reduce_kernel` merges them
(weights exp(max_s - max)). A part that lies past a sequence's end stays empty (max -inf,
sum 0) and weighs nothing. The count depends on the batch, so a sequence's output can differ
in the last float32 bits with what it is batched with.

float8 pages are not read here (their scales stay on the PyTorch paths; the cache refuses
decode_kernel=triton for them). Importing this module imports triton (kernels/triton_jit.py);
the cache imports it only when it resolved decode_kernel to "triton".
"""

from __future__ import annotations

import torch

from kvforge.errors import require
from kvforge.kernels.row_layout import last_dim_contiguous
from kvforge.kernels.triton_jit import INTERPRETED, decode_warps, jit, tl, triton

__all__ = ["choose_splits", "paged_decode_attention_triton"]

BLOCK_T = 32  # tokens per tile
MIN_DOT = 16  # smallest dimension tl.dot accepts
PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@jit
def _paged_decode_kernel(
        q_ptr, k_self_ptr, v_self_ptr, k_pages_ptr, v_pages_ptr, table_ptr, first_ptr, from_ptr, to_ptr,
        out_ptr, part_max_ptr, part_sum_ptr,
        sq_b, sq_h, sks_b, sks_h, svs_b, svs_h, skp_h, skp_p, skp_t, svp_h, svp_p, svp_t,
        stab_b, table_width, scale, split_tokens,
        QUERY_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        PAGE_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr):
    # Unit stride along D for every tensor (the launcher ensures it); pages otherwise any strides.
    # SPLIT: out_ptr/part_*_ptr hold one float32 part per split, [B, heads, splits(, D)],
    # unnormalised; otherwise out_ptr is the [B, heads, D] result in q's dtype.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    rows = tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_D)
    toks = tl.arange(0, BLOCK_T)
    row_ok = rows < QUERY_GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * QUERY_GROUP + rows
    q = tl.load(q_ptr + seq * sq_b + heads[:, None] * sq_h + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scale
    k_own = tl.load(k_self_ptr + seq * sks_b + kv_head * sks_h + dims, mask=dim_ok, other=0.0).to(tl.float32)
    v_own = tl.load(v_self_ptr + seq * svs_b + kv_head * svs_h + dims, mask=dim_ok, other=0.0).to(tl.float32)
    # The own token is always visible: it seeds max and sum of split 0, so every row is
    # finite. Other splits start empty; every tile they walk holds a visible token, so their
    # max is finite after the first tile (an empty split stays -inf with sum 0).
    first_split = split == 0
    running_max = tl.where(first_split, tl.sum(q * k_own[None, :], axis=1), float("-inf"))
    running_sum = tl.where(first_split, tl.full([BLOCK_Q], 1.0, tl.float32), 0.0)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32) + tl.where(first_split, v_own, 0.0)[None, :]
    first = tl.load(first_ptr + seq)
    begin = tl.load(from_ptr + seq) + split * split_tokens
    end = tl.minimum(tl.load(to_ptr + seq), begin + split_tokens)
    k_base = k_pages_ptr + kv_head * skp_h
    v_base = v_pages_ptr + kv_head * svp_h
    for start in range(begin, end, BLOCK_T):
        t = start + toks
        visible = t < end  # t >= begin >= visible_from: the window start is in `begin`
        column = (t - first) // PAGE_BLOCK
        offset = (t - first) % PAGE_BLOCK
        # Page ids are read for visible tokens only: hidden entries may hold anything.
        page = tl.load(table_ptr + seq * stab_b + column, mask=visible & (column < table_width),
                       other=0).to(tl.int64)
        kv_mask = visible[:, None] & dim_ok[None, :]
        k = tl.load(k_base + page[:, None] * skp_p + offset[:, None] * skp_t + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        scores = tl.where(visible[None, :], scores, float("-inf"))
        v = tl.load(v_base + page[:, None] * svp_p + offset[:, None] * svp_t + dims[None, :],
                    mask=kv_mask, other=0.0).to(tl.float32)  # 0 for hidden slots: no NaN can enter
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max
    head_rows = seq * QUERY_GROUP * tl.num_programs(1) + heads  # row of [B * heads]
    if SPLIT:
        part = head_rows * tl.num_programs(2) + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_max_ptr + part, running_max, mask=row_ok)
        tl.store(part_sum_ptr + part, running_sum, mask=row_ok)
    else:
        result = acc / running_sum[:, None]
        tl.store(out_ptr + head_rows[:, None] * HEAD_DIM + dims[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & dim_ok[None, :])


@jit
def _reduce_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, splits,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program per (sequence, head) row: out = sum_s w_s acc_s / sum_s w_s sum_s with
    w_s = exp(max_s - max); split 0 holds the own token, so max is finite."""
    row = tl.program_id(0).to(tl.int64)
    parts = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part_ok = parts < splits
    maxes = tl.load(part_max_ptr + row * splits + parts, mask=part_ok, other=float("-inf"))
    weights = tl.exp(maxes - tl.max(maxes, axis=0))
    total = tl.sum(weights * tl.load(part_sum_ptr + row * splits + parts, mask=part_ok, other=0.0), axis=0)
    acc = tl.load(part_acc_ptr + (row * splits + parts)[:, None] * HEAD_DIM + dims[None, :],
                  mask=part_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(out_ptr + row * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def paged_decode_attention_triton(
        q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, k_pages: torch.Tensor,
        v_pages: torch.Tensor, page_table: torch.Tensor, first_page_position: torch.Tensor,
        visible_from: torch.Tensor, visible_to: torch.Tensor, scale: float,
        splits: int | None = None) -> torch.Tensor:
    """One query per sequence over its own new key plus its stored keys, in float32.

    Arguments as `decode_attention`: q [B, heads, D]; k_self/v_self [B, kv_heads, D];
    k_pages/v_pages [kv_heads, num_pages, block, D] float32/bfloat16/float16 (any strides
    with unit stride along D, e.g. `store[layer]`); page_table [B, P]; the token in column j
    of row b has position first_page_position[b] + j and is visible iff visible_from[b] <=
    position < visible_to[b] <= first_page_position[b] + P * block. Returns [B, heads, D] in
    q's dtype. All tensors on one CUDA device (or on CPU when the module was imported with
    TRITON_INTERPRET=1). `splits`: parts of each row's token range run by separate programs
    (None: `choose_splits`, from shapes only)."""
    if triton is None:
        raise RuntimeError("the Triton paged attention kernel needs the `triton` package "
                           "(pip install 'kvforge[triton]')")
    if not (q.is_cuda or INTERPRETED):
        raise ValueError("paged_decode_attention_triton runs on CUDA tensors (or on CPU tensors "
                         "when TRITON_INTERPRET=1 was set before this module was imported)")
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    require(heads % kv_heads == 0, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    require(k_pages.dtype in PAGE_DTYPES and v_pages.dtype == k_pages.dtype, "k_pages.dtype", k_pages.dtype,
            f"must be one of {list(PAGE_DTYPES)}, as v_pages' (float8 pages take the PyTorch paths)")
    require(k_pages.shape[0] == kv_heads and k_pages.shape[-1] == dim and v_pages.shape == k_pages.shape,
            "k_pages", tuple(k_pages.shape), f"must be [kv_heads={kv_heads}, pages, block, head_dim={dim}], "
            f"as v_pages {tuple(v_pages.shape)}")
    require(page_table.dim() == 2 and page_table.shape[0] == batch, "page_table", tuple(page_table.shape),
            f"must be [batch={batch}, pages]")
    q, k_self, v_self, k_pages, v_pages = (last_dim_contiguous(t) for t in (q, k_self, v_self, k_pages, v_pages))
    page_table, first_page_position, visible_from, visible_to = (
        _as_int64(t) for t in (page_table, first_page_position, visible_from, visible_to))
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block = k_pages.shape[2]
    bound = page_table.shape[1] * block  # token slots a row's table can hold
    if splits is None:
        splits = choose_splits(batch * kv_heads, bound, q.device)
    require(1 <= splits <= MAX_SPLITS, "splits", splits, f"must be in 1..{MAX_SPLITS}")
    split_tokens = -(-max(bound, 1) // (splits * BLOCK_T)) * BLOCK_T  # a multiple of BLOCK_T
    splits = -(-max(bound, 1) // split_tokens)  # none of them wholly past the bound
    parts, part_max, part_sum = out, out, out  # unused without splits
    if splits > 1:
        parts = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    query_group = heads // kv_heads
    # Triton launches on the current CUDA device, which need not be q's; device_of(q) is a
    # no-op for CPU tensors (the interpreter).
    with torch.cuda.device_of(q):
        _paged_decode_kernel[(batch, kv_heads, splits)](
            q, k_self, v_self, k_pages, v_pages, page_table, first_page_position, visible_from, visible_to,
            parts, part_max, part_sum,
            q.stride(0), q.stride(1), k_self.stride(0), k_self.stride(1), v_self.stride(0), v_self.stride(1),
            *k_pages.stride()[:3], *v_pages.stride()[:3], page_table.stride(0), page_table.shape[1],
            float(scale), split_tokens,
            QUERY_GROUP=query_group, BLOCK_Q=max(MIN_DOT, triton.next_power_of_2(query_group)), HEAD_DIM=dim,
            BLOCK_D=max(MIN_DOT, triton.next_power_of_2(dim)), PAGE_BLOCK=block, BLOCK_T=BLOCK_T,
            SPLIT=splits > 1, num_warps=decode_warps())
        if splits > 1:
            _reduce_kernel[(batch * heads,)](parts, part_max, part_sum, out, splits, HEAD_DIM=dim,
                                             BLOCK_D=triton.next_power_of_2(dim),
                                             BLOCK_S=triton.next_power_of_2(splits))
    return out


PROGRAMS_PER_SM = 4  # programs per multiprocessor that split-K aims for
MIN_SPLIT_TILES = 4  # each split walks at least this many BLOCK_T tiles
# The reduce kernel holds [splits, head_dim] floats of one row at once: more would spill.
MAX_SPLITS = 32
INTERPRETED_PROGRAMS = 8  # programs aimed at in the interpreter (tests also force split counts)


def choose_splits(pairs: int, bound: int, device: torch.device) -> int:
    """Splits per (sequence, kv head) pair: enough programs to fill the GPU (PROGRAMS_PER_SM
    per multiprocessor), each walking at least MIN_SPLIT_TILES tiles, at most MAX_SPLITS.
    From shapes only (pairs, the table's slots), so choosing never synchronises."""
    target = PROGRAMS_PER_SM * _multiprocessors(device) if device.type == "cuda" else INTERPRETED_PROGRAMS
    most = max(1, min(MAX_SPLITS, bound // (MIN_SPLIT_TILES * BLOCK_T)))
    return max(1, min(most, -(-target // max(pairs, 1))))


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
