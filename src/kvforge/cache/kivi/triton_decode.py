"""Decode attention over the paged KIVI store as one fused Triton kernel (CUDA).

`kivi_decode_attention_triton` has exactly the arguments and semantics of
`decode_reference.kivi_decode_attention_reference` (see its docstring for the
layout) and is parity-tested against it. One program handles one (sequence, kv head,
split) triple: the `heads // kv_heads` queries of the group are loaded once (padded to 16
rows so `tl.dot` applies) and walk their split's share of the visible tokens
[visible_from, n) in tiles of `BLOCK_T`.
Tiles start at multiples of `BLOCK_T` (tokens before visible_from are masked) and are cut
into parts of `SUB` tokens, the largest power of two dividing the group (at most a tile), so
each part lies in one page and starts on a byte of its codes. For each part the kernel loads
every channel's key codes as consecutive bytes and each token's value codes as one row,
unpacks them with shifts and a mask, dequantises them with the fp16 scale and zero (key:
per channel of the page; value: per token and channel group, loaded once per token and
spread over the group's channels when the group is a power of two), or reads the
full-precision residual instead (t >= nk for keys, t >= nv for values: ring row t % R of
the sequence's slot), and feeds both into an online softmax in float32. Nothing is
dequantised beyond the current tile. Reading a tile's codes as rows rather than one token
at a time is what lets the compiler move them in 8- and 16-byte accesses
(tests/kernels/test_triton_compile.py). A page's codes and scales must be contiguous (a view
of one layer of the store is).

Dot products run in float32 with IEEE precision (no TF32), which is what makes the kernel
match the reference to ~1e-6; a tensor-core (fp16/bf16 operand) variant is not written.

Split-K (flash-decoding): with one program per (sequence, kv head) pair a batch of 16 on a
3-KV-head model runs 48 programs on a GPU of 132 multiprocessors, each walking the whole
context alone (on an H100 this kernel then took most of the step's device time;
docs/benchmarks.md#measurements-behind-design-choices).
The token range is therefore cut into `splits` equal parts of a
multiple of `BLOCK_T` tokens; each program writes its unnormalised accumulator, running
max and running sum, and `_combine_kernel` merges the parts (weights exp(max_s - max)).
The step's own token seeds split 0 only. The number of splits comes from the page
table's width (a bound known on the host, so choosing it never synchronises); parts of a
sequence that lie past its end stay empty (max -inf, sum 0) and weigh nothing.

Importing this module never fails: without the `triton` package `triton_available()` is
False and the launcher raises. Tensors on CUDA run the compiled kernel (compiled at the
first launch of each configuration), on the device of `q`. With TRITON_INTERPRET=1 in the
environment when this module is imported (`triton.jit` decides at decoration time), the
same kernel runs in Triton's interpreter on CPU tensors (`triton_interpreted()`): that is
how it is tested without a GPU (tests/conftest.py sets it).
"""

from __future__ import annotations

import torch

from kvforge.cache.kivi.quant import SUPPORTED_BITS, codes_per_byte
from kvforge.errors import require
from kvforge.kernels.row_layout import last_dim_contiguous
from kvforge.kernels.triton_jit import INTERPRETED as _INTERPRETED
from kvforge.kernels.triton_jit import decode_warps, tl, triton, triton_available
from kvforge.kernels.triton_jit import jit as _jit

__all__ = ["kivi_decode_attention_triton", "triton_available", "triton_interpreted"]

BLOCK_T = 32  # tokens per tile
MIN_DOT = 16  # smallest dimension tl.dot accepts


def triton_interpreted() -> bool:
    """True when the kernel below was decorated for Triton's interpreter, so it runs on CPU
    tensors (TRITON_INTERPRET=1 was set when this module was imported)."""
    return _INTERPRETED


@_jit
def _kivi_decode_kernel(
        q_ptr, k_self_ptr, v_self_ptr,
        k_codes_ptr, k_scale_ptr, k_zero_ptr, v_codes_ptr, v_scale_ptr, v_zero_ptr,
        k_res_ptr, v_res_ptr, slot_ptr, table_ptr, first_ptr, nk_ptr, nv_ptr, from_ptr, n_ptr, out_ptr,
        sq_b, sq_h, sks_b, sks_h, svs_b, svs_h,
        skc_h, skc_p, sks_hh, sks_p, svc_h, svc_p, svp_h, svp_p,
        skr_s, skr_h, skr_r, k_ring, svr_s, svr_h, svr_r, v_ring, stab_b, table_width, scale,
        part_max_ptr, part_sum_ptr, split_tokens,
        QUERY_GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BITS: tl.constexpr, VALUE_BITS: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_T: tl.constexpr,
        SUB: tl.constexpr, PARTS: tl.constexpr, GROUPS_BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    # Unit stride along D is required of q/k_self/v_self/residuals/out (the launcher
    # ensures it); the quantised store's heads and pages may have any strides, and within a
    # page its rows are contiguous (the launcher checks), so their strides are constants and
    # the compiler knows each row's alignment.
    # SPLIT: out_ptr/part_*_ptr hold one part per split, [B, heads, splits(, D)], unnormalised;
    # otherwise out_ptr is the [B, heads, D] result in q's dtype.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    # keys in BITS-bit codes, values in VALUE_BITS-bit ones
    PER_BYTE: tl.constexpr = 8 // BITS
    V_PER_BYTE: tl.constexpr = 8 // VALUE_BITS
    K_ROW: tl.constexpr = GROUP // PER_BYTE  # bytes of a channel's codes in a page
    V_ROW: tl.constexpr = HEAD_DIM // V_PER_BYTE  # bytes of a token's value codes
    V_GROUPS: tl.constexpr = HEAD_DIM // GROUP  # value scales of a token
    MASK: tl.constexpr = (1 << BITS) - 1
    V_MASK: tl.constexpr = (1 << VALUE_BITS) - 1
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
    # The own token is always visible: it seeds max and sum of split 0, so rows stay finite.
    # Other splits start empty; each tile they walk holds a visible token, so their max is
    # finite after the first tile (and an empty split stays -inf with sum 0).
    first_split = split == 0
    running_max = tl.where(first_split, tl.sum(q * k_own[None, :], axis=1), float("-inf"))
    running_sum = tl.where(first_split, tl.full([BLOCK_Q], 1.0, tl.float32), 0.0)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32) + tl.where(first_split, v_own, 0.0)[None, :]
    nk = tl.load(nk_ptr + seq)
    nv = tl.load(nv_ptr + seq)
    lo = tl.load(from_ptr + seq)
    # Tiles start at multiples of BLOCK_T (tokens before `lo` are masked), so each of a
    # tile's PARTS parts of SUB tokens lies in one page at a byte boundary of its codes.
    begin = (lo // BLOCK_T) * BLOCK_T + split * split_tokens
    end = tl.minimum(tl.load(n_ptr + seq), begin + split_tokens)
    first_column = tl.load(first_ptr + seq) // GROUP  # logical page of table column 0
    k_res_base = k_res_ptr + tl.load(slot_ptr + seq) * skr_s + kv_head * skr_h
    v_res_base = v_res_ptr + tl.load(slot_ptr + seq) * svr_s + kv_head * svr_h
    parts = tl.arange(0, PARTS)
    part_bytes = tl.arange(0, SUB // PER_BYTE)
    shifts = tl.arange(0, PER_BYTE) * BITS  # code j of a byte sits at bit j * BITS
    v_shifts = tl.arange(0, V_PER_BYTE) * VALUE_BITS
    row_bytes = tl.arange(0, BLOCK_D // V_PER_BYTE)  # a value token's packed channels
    row_byte_ok = row_bytes < V_ROW
    for start in range(begin, end, BLOCK_T):
        t = start + toks
        visible = (t >= lo) & (t < end)
        key_quantised = visible & (t < nk)
        value_quantised = visible & (t < nv)
        # A part reads its page only if one of its visible tokens is quantised (others may
        # be released: -1 in the table).
        part_first = start + parts * SUB
        seen_from = tl.maximum(part_first, lo)
        part_end = tl.minimum(part_first + SUB, end)
        keys_in_page = seen_from < tl.minimum(part_end, nk)
        values_in_page = seen_from < tl.minimum(part_end, nv)
        column = part_first // GROUP - first_column
        page = tl.load(table_ptr + seq * stab_b + column, mask=(keys_in_page | values_in_page)
                       & (column >= 0) & (column < table_width), other=0).to(tl.int64)
        # Keys: each channel's codes of the part are SUB // PER_BYTE consecutive bytes,
        # unpacked to [PARTS, D, SUB] (token s of a part: byte s // PER_BYTE, bit
        # (s % PER_BYTE) * BITS), then laid out as [BLOCK_T, D]; scale/zero per (page, channel).
        k_mask = keys_in_page[:, None] & dim_ok[None, :]
        k_param = kv_head * sks_hh + page[:, None] * sks_p + dims[None, :]
        # part_first is a multiple of SUB, which divides GROUP
        first_byte = tl.multiple_of((part_first % GROUP) // PER_BYTE, SUB // PER_BYTE)
        k_bytes = tl.load(k_codes_ptr + kv_head * skc_h + (page * skc_p)[:, None, None] + (dims * K_ROW)[None, :, None]
                          + (first_byte[:, None, None] + part_bytes[None, None, :]),
                          mask=k_mask[:, :, None], other=0).to(tl.int32)
        k_code = tl.reshape((k_bytes[:, :, :, None] >> shifts[None, None, None, :]) & MASK, [PARTS, BLOCK_D, SUB])
        k_hat = (tl.load(k_zero_ptr + k_param, mask=k_mask, other=0.0).to(tl.float32)[:, :, None]
                 + k_code.to(tl.float32) * tl.load(k_scale_ptr + k_param, mask=k_mask, other=0.0)
                 .to(tl.float32)[:, :, None])
        k_hat = tl.reshape(tl.permute(k_hat, (0, 2, 1)), [BLOCK_T, BLOCK_D])
        k_res = tl.load(k_res_base + (t % k_ring)[:, None] * skr_r + dims[None, :],
                        mask=(visible & (t >= nk))[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        k = tl.where(key_quantised[:, None], k_hat, k_res)  # 0 for hidden tokens
        scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        scores = tl.where(visible[None, :], scores, float("-inf"))
        # Values: a token's codes are one row of V_ROW bytes (channel d: byte d // V_PER_BYTE,
        # bit (d % V_PER_BYTE) * VALUE_BITS); scale/zero per (page, token, channel group
        # d // GROUP).
        token_page = tl.reshape(tl.broadcast_to(page[:, None], [PARTS, SUB]), [BLOCK_T])
        offset = t % GROUP
        v_bytes = tl.load(v_codes_ptr + kv_head * svc_h + (token_page * svc_p + offset * V_ROW)[:, None]
                          + row_bytes[None, :], mask=value_quantised[:, None] & row_byte_ok[None, :],
                          other=0).to(tl.int32)
        v_code = tl.reshape((v_bytes[:, :, None] >> v_shifts[None, None, :]) & V_MASK, [BLOCK_T, BLOCK_D])
        v_row = kv_head * svp_h + token_page * svp_p + offset * V_GROUPS
        if GROUPS_BLOCK > 0:  # a power-of-two group: load a token's V_GROUPS scales, spread them
            groups = tl.arange(0, GROUPS_BLOCK)
            v_mask = value_quantised[:, None] & (groups < V_GROUPS)[None, :]
            v_param = v_row[:, None] + groups[None, :]
            v_zero = tl.load(v_zero_ptr + v_param, mask=v_mask, other=0.0).to(tl.float32)
            v_scale = tl.load(v_scale_ptr + v_param, mask=v_mask, other=0.0).to(tl.float32)
            v_hat = tl.reshape(v_zero[:, :, None] + tl.reshape(v_code.to(tl.float32), [BLOCK_T, GROUPS_BLOCK, GROUP])
                               * v_scale[:, :, None], [BLOCK_T, BLOCK_D])
        else:  # each channel reads its group's scale
            v_mask = value_quantised[:, None] & dim_ok[None, :]
            v_param = v_row[:, None] + (dims // GROUP)[None, :]
            v_hat = (tl.load(v_zero_ptr + v_param, mask=v_mask, other=0.0).to(tl.float32)
                     + v_code.to(tl.float32) * tl.load(v_scale_ptr + v_param, mask=v_mask, other=0.0).to(tl.float32))
        v_res = tl.load(v_res_base + (t % v_ring)[:, None] * svr_r + dims[None, :],
                        mask=(visible & (t >= nv))[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        v = tl.where(value_quantised[:, None], v_hat, v_res)  # 0 for hidden tokens (masked loads)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        running_max = new_max
    head_rows = seq * QUERY_GROUP * tl.num_programs(1) + heads  # row of [B * heads]
    if SPLIT:
        splits = tl.num_programs(2)
        part = head_rows * splits + split
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part_max_ptr + part, running_max, mask=row_ok)
        tl.store(part_sum_ptr + part, running_sum, mask=row_ok)
    else:
        tl.store(out_ptr + head_rows[:, None] * HEAD_DIM + dims[None, :], acc / running_sum[:, None],
                 mask=row_ok[:, None] & dim_ok[None, :])


@_jit
def _combine_kernel(part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, splits,
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
    tl.store(out_ptr + row * HEAD_DIM + dims, out, mask=dims < HEAD_DIM)


def kivi_decode_attention_triton(
        q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor,
        k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
        v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
        k_residual: torch.Tensor, v_residual: torch.Tensor, slots: torch.Tensor,
        page_table: torch.Tensor, first_page_position: torch.Tensor,
        nk: torch.Tensor, nv: torch.Tensor, visible_from: torch.Tensor, n: torch.Tensor,
        scale: float, bits: int, group: int, splits: int | None = None,
        value_bits: int | None = None) -> torch.Tensor:
    """Fused KIVI decode attention; arguments and result as
    `kivi_decode_attention_reference`. All tensors on one CUDA device (or on CPU with
    TRITON_INTERPRET=1). Raises RuntimeError without triton. `splits`: parts of each
    sequence's token range run by separate programs (None: `choose_splits`). `bits`: of the
    key codes; `value_bits`: of the value codes (None: `bits`)."""
    if triton is None:
        raise RuntimeError("the Triton KIVI attention kernel needs the `triton` package "
                           "(pip install 'kvforge[triton]')")
    if not (q.is_cuda or _INTERPRETED):
        raise ValueError("kivi_decode_attention_triton runs on CUDA tensors (or on CPU tensors "
                         "when TRITON_INTERPRET=1 was set before this module was imported)")
    vbits = bits if value_bits is None else value_bits
    require(bits in SUPPORTED_BITS, "bits", bits, f"must be one of {list(SUPPORTED_BITS)}")
    require(vbits in SUPPORTED_BITS, "value_bits", vbits, f"must be one of {list(SUPPORTED_BITS)}")
    batch, heads, dim = q.shape
    kv_heads = k_self.shape[1]
    require(heads % kv_heads == 0, "heads", heads, f"must be a multiple of kv_heads={kv_heads}")
    require(dim % group == 0, "group", group, f"must divide head_dim={dim}")
    require(group % codes_per_byte(bits) == 0, "group", group,
            f"must be a multiple of {codes_per_byte(bits)} ({bits}-bit codes fill whole bytes)")
    require(dim % codes_per_byte(vbits) == 0, "head_dim", dim,
            f"must be a multiple of {codes_per_byte(vbits)} ({vbits}-bit value codes fill whole bytes)")
    require(tuple(k_codes.shape[2:]) == (dim, group * bits // 8), "k_codes", tuple(k_codes.shape),
            f"must be [kv_heads, pages, {dim}, {group * bits // 8}] for {bits}-bit codes, group {group}")
    require(tuple(v_codes.shape[2:]) == (group, dim // codes_per_byte(vbits)), "v_codes", tuple(v_codes.shape),
            f"must be [kv_heads, pages, {group}, {dim * vbits // 8}] for {vbits}-bit codes, group {group}")
    require(k_scale.stride() == k_zero.stride() and v_scale.stride() == v_zero.stride(), "scale strides",
            (k_scale.stride(), k_zero.stride()), "scale and zero of keys (and of values) must share strides")
    loose = [name for name, t in (("k_codes", k_codes), ("k_scale", k_scale), ("v_codes", v_codes),
                                  ("v_scale", v_scale)) if not _pages_contiguous(t)]
    require(not loose, "quantised store", loose, "must hold each page contiguously (heads and pages may have any "
            "strides, as in a view of one layer of the store)")
    query_group = heads // kv_heads
    q, k_self, v_self, k_residual, v_residual = (last_dim_contiguous(t) for t in (q, k_self, v_self, k_residual, v_residual))
    page_table = _as(page_table, torch.int64)
    slots, first_page_position, nk, nv, visible_from, n = (
        _as(t, torch.int64) for t in (slots, first_page_position, nk, nv, visible_from, n))
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)  # (the kernels' stores round to it)
    if batch == 0:
        return out
    # Tokens a sequence's tiles span: at most its table's pages plus a residual ring, and
    # the part of the first tile before visible_from.
    bound = page_table.shape[1] * group + max(k_residual.shape[2], v_residual.shape[2]) + BLOCK_T - 1
    group_power = group & -group  # the largest power of two dividing group
    sub = min(group_power, BLOCK_T)  # tokens of a tile part, all in one page
    block_d = max(MIN_DOT, triton.next_power_of_2(dim))
    # With a power-of-two group, [tokens, block_d // group] value scales are loaded and spread
    # over their channels; otherwise each channel gathers its own (0).
    groups_block = block_d // group if group == group_power else 0
    if splits is None:
        splits = choose_splits(batch * kv_heads, bound, q.device)
    require(1 <= splits <= MAX_SPLITS, "splits", splits, f"must be in 1..{MAX_SPLITS}")
    split_tokens = -(-max(bound, 1) // (splits * BLOCK_T)) * BLOCK_T  # a multiple of BLOCK_T
    splits = -(-max(bound, 1) // split_tokens)  # none of them wholly past the bound
    parts = out
    part_max = part_sum = out  # unused without splits
    if splits > 1:
        parts = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    # Triton launches on the current CUDA device, which need not be q's (cuda:1 while cuda:0
    # is current); device_of(q) is a no-op for CPU tensors (the interpreter).
    with torch.cuda.device_of(q):
        _kivi_decode_kernel[(batch, kv_heads, splits)](
            q, k_self, v_self, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
            k_residual, v_residual, slots, page_table, first_page_position, nk, nv, visible_from, n, parts,
            q.stride(0), q.stride(1), k_self.stride(0), k_self.stride(1), v_self.stride(0), v_self.stride(1),
            *k_codes.stride()[:2], *k_scale.stride()[:2], *v_codes.stride()[:2], *v_scale.stride()[:2],
            *k_residual.stride()[:3], k_residual.shape[2], *v_residual.stride()[:3], v_residual.shape[2],
            page_table.stride(0), page_table.shape[1],
            float(scale), part_max, part_sum, split_tokens,
            QUERY_GROUP=query_group, BLOCK_Q=max(MIN_DOT, triton.next_power_of_2(query_group)), HEAD_DIM=dim,
            BLOCK_D=block_d, BITS=bits, VALUE_BITS=vbits, GROUP=group, BLOCK_T=BLOCK_T, SUB=sub, PARTS=BLOCK_T // sub,
            GROUPS_BLOCK=groups_block, SPLIT=splits > 1, num_warps=decode_warps())
        if splits > 1:
            _combine_kernel[(batch * heads,)](parts, part_max, part_sum, out, splits, HEAD_DIM=dim,
                                              BLOCK_D=triton.next_power_of_2(dim),
                                              BLOCK_S=triton.next_power_of_2(splits))
    return out


PROGRAMS_PER_SM = 4  # programs per multiprocessor that split-K aims for
MIN_SPLIT_TILES = 4  # each split walks at least this many BLOCK_T tiles
# The combine kernel holds [splits, head_dim] floats of one row at once: more would spill
# registers (a batch of one at 64K tokens would otherwise ask for ~400 splits).
MAX_SPLITS = 32
INTERPRETED_PROGRAMS = 8  # programs aimed at in the interpreter (tests force their split counts)


def choose_splits(pairs: int, bound: int, device: torch.device) -> int:
    """Splits per (sequence, kv head) pair: enough programs to fill the GPU
    (PROGRAMS_PER_SM per multiprocessor), each still walking MIN_SPLIT_TILES tiles, at most
    MAX_SPLITS. The count depends on the batch (its size and widest table), so a sequence's
    output can differ in the last float32 bits with what it is batched with."""
    target = PROGRAMS_PER_SM * _multiprocessors(device) if device.type == "cuda" else INTERPRETED_PROGRAMS
    most = max(1, min(MAX_SPLITS, bound // (MIN_SPLIT_TILES * BLOCK_T)))
    return max(1, min(most, -(-target // max(pairs, 1))))


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _pages_contiguous(t: torch.Tensor) -> bool:
    """Whether the dimensions after [kv_heads, pages] are laid out contiguously."""
    expected = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()
