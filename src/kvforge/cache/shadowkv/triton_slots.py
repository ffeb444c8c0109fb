"""ShadowKV's reuse slots and value reads on the Triton path (sparse.py `_attend_triton`):
kernels over a whole decode group, one program per (sequence, KV head), addressing each
sequence's tensors through its pointer table (pointer_table.py).

- `held_slot_ids` / `keep_slot_ids`: each sequence's reuse-slot chunk ids [H, k] (its own
  tensor, k its own) into the group's [B, H, slots] (-2 past its k) before matching, and the
  step's ids back into them after (the staged path, which matches with slots.match_slots);
- `match_in_place`: when values are read in place, all of the chunk reuse in one launch
  instead: the picks' validity (a finite score, within the sequence's k), the held ids read,
  slots.match_slots' rule (hits stay, the r-th miss takes the r-th free slot), the new ids
  written back and the miss and hit counts added to a device counter;
- `read_values_in_place`: the values of the slots receiving a miss, read straight from the
  slow tier at their page when the device can read it (`ChunkStore.values_in_place`: host
  memory page-locked for CUDA); one program per (sequence, KV head, slot), so the host never
  learns the misses and the step never waits for the device.

Importing this module imports triton, as triton_decode.py does.
"""

from __future__ import annotations

import torch

from kvforge.cache.shadowkv.pointer_table import (
    ALIGNMENT_BYTES,
    FIELDS,
    OWN_SLOTS,
    ROWS,
    SLOT_IDS,
    SLOTS_START,
    VALUES,
    aligned_pointer,
    table_pointer,
)
from kvforge.cache.shadowkv.triton_decode import check_device
from kvforge.errors import require
from kvforge.kernels.triton_jit import jit, tl, triton

__all__ = ["held_slot_ids", "keep_slot_ids", "match_in_place", "read_values_in_place"]

MATCH_TILE = 4096  # most elements of a picks x slots tile of the match kernel (whatever k is)


@jit
def _values_in_place_kernel(info_ptr, values_like, slow_address, new_ids_ptr, filled_ptr, table_ptr, stab_b,
                            slow_head_stride, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_D: tl.constexpr, NFIELDS: tl.constexpr):
    # slots on the grid's x axis: CUDA caps y and z at 65,535, x at 2**31 - 1
    slot = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    seq = tl.program_id(2).to(tl.int64)
    slot_index = (seq * tl.num_programs(1) + kv_head) * tl.num_programs(0) + slot
    if tl.load(filled_ptr + slot_index) != 0:  # only slots that receive a miss are written
        page = tl.load(table_ptr + seq * stab_b + tl.load(new_ids_ptr + slot_index)).to(tl.int64)
        element = values_like.dtype.element_ty
        # the slow tier of this layer, [H, P, chunk, D] contiguous, at its host address
        source = aligned_pointer(slow_address, element) + kv_head * slow_head_stride + page * CHUNK * HEAD_DIM
        info = info_ptr + seq * NFIELDS
        values = table_pointer(info, VALUES, element)
        rows = tl.load(info + ROWS)
        first_row = tl.load(info + SLOTS_START) + slot * CHUNK
        tokens = tl.arange(0, BLOCK_T)
        dims = tl.arange(0, BLOCK_D)
        mask = (tokens < CHUNK)[:, None] & (dims < HEAD_DIM)[None, :]
        data = tl.load(source + tokens[:, None] * HEAD_DIM + dims[None, :], mask=mask)
        tl.store(values + (kv_head * rows + first_row + tokens)[:, None] * HEAD_DIM + dims[None, :], data, mask=mask)


@jit
def _own_slot_ids(info_ptr, seq, kv_head, NFIELDS: tl.constexpr):
    """(pointer to the slot ids of a (sequence, KV head), the sequence's own k)."""
    info = info_ptr + seq * NFIELDS
    own = tl.load(info + OWN_SLOTS)
    return table_pointer(info, SLOT_IDS, tl.int64) + kv_head * own, own


@jit
def _held_kernel(info_ptr, held_ptr, slots, BLOCK_S: tl.constexpr, NFIELDS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ids, own = _own_slot_ids(info_ptr, seq, kv_head, NFIELDS)
    j = tl.arange(0, BLOCK_S)
    held = tl.load(ids + j, mask=j < own, other=-2)  # -2: past the sequence's own k (never free)
    tl.store(held_ptr + (seq * tl.num_programs(1) + kv_head) * slots + j, held, mask=j < slots)


@jit
def _keep_kernel(info_ptr, new_ids_ptr, slots, BLOCK_S: tl.constexpr, NFIELDS: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    ids, own = _own_slot_ids(info_ptr, seq, kv_head, NFIELDS)
    j = tl.arange(0, BLOCK_S)
    new = tl.load(new_ids_ptr + (seq * tl.num_programs(1) + kv_head) * slots + j, mask=j < own)
    tl.store(ids + j, new, mask=j < own)


@jit
def _match_tile(top_scores_ptr, top_ids_ptr, pair, start, picks, own_k, held, in_slots, BLOCK_K: tl.constexpr):
    """Picks [start, start + BLOCK_K) of a (sequence, head): (pick ids, valid, same [BLOCK_K,
    BLOCK_S]: pick i is held in slot j)."""
    i = start + tl.arange(0, BLOCK_K)
    in_picks = i < picks
    score = tl.load(top_scores_ptr + pair * picks + i, mask=in_picks, other=float("-inf"))
    pick = tl.load(top_ids_ptr + pair * picks + i, mask=in_picks, other=-3)
    # a pick with score -inf (fewer candidates than k) or past the sequence's own k is invalid
    valid = in_picks & (score > float("-inf")) & (i < own_k)
    same = (pick[:, None] == held[None, :]) & valid[:, None] & in_slots[None, :]
    return pick, valid, same


@jit
def _match_kernel(info_ptr, top_scores_ptr, top_ids_ptr, k_ptr, new_ids_ptr, filled_ptr, counts_ptr, picks, slots,
                  REUSE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, NFIELDS: tl.constexpr):
    # Picks are taken BLOCK_K at a time against every slot, so a tile is BLOCK_K x BLOCK_S
    # whatever k is: one pass finds the slots holding a pick again (kept), the second gives
    # the r-th miss the r-th free slot, counting misses over the tiles before.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    pair = seq * tl.num_programs(1) + kv_head
    j = tl.arange(0, BLOCK_S)
    in_slots = j < slots
    own_k = tl.load(k_ptr + seq)
    ids, own = _own_slot_ids(info_ptr, seq, kv_head, NFIELDS)
    held = tl.load(ids + j, mask=in_slots & (j < own), other=-2)  # -2: past the own k, never free
    if not REUSE:
        held = tl.minimum(held, -1)  # forget everything: every pick is a miss
    kept = j < 0
    for start in range(0, picks, BLOCK_K):
        _, _, same = _match_tile(top_scores_ptr, top_ids_ptr, pair, start, picks, own_k, held, in_slots, BLOCK_K)
        kept = kept | (tl.max(same.to(tl.int32), axis=0) > 0)
    free = ~kept & (held > -2) & in_slots
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    new = tl.where(kept, held, -1)
    filled = j < 0
    misses = tl.sum(filled.to(tl.int32), axis=0)  # 0, as a tensor carried through the loop
    hits = misses
    for start in range(0, picks, BLOCK_K):
        pick, valid, same = _match_tile(top_scores_ptr, top_ids_ptr, pair, start, picks, own_k, held, in_slots,
                                        BLOCK_K)
        hit = tl.max(same.to(tl.int32), axis=1) > 0
        miss = valid & ~hit
        miss_rank = misses + tl.cumsum(miss.to(tl.int32), axis=0) - 1
        assign = miss[:, None] & free[None, :] & (free_rank[None, :] == miss_rank[:, None])
        got = tl.max(assign.to(tl.int32), axis=0) > 0
        new = tl.where(got, tl.sum(tl.where(assign, pick[:, None], 0), axis=0), new)
        filled = filled | got
        misses += tl.sum(miss.to(tl.int32), axis=0)
        hits += tl.sum(hit.to(tl.int32), axis=0)
    tl.store(new_ids_ptr + pair * slots + j, new, mask=in_slots)
    tl.store(filled_ptr + pair * slots + j, filled, mask=in_slots)
    tl.store(ids + j, new, mask=in_slots & (j < own))
    tl.atomic_add(counts_ptr, misses.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, hits.to(tl.int64))


def read_values_in_place(info: torch.Tensor, values_like: torch.Tensor, slow: torch.Tensor, new_ids: torch.Tensor,
                         filled: torch.Tensor, table: torch.Tensor) -> None:
    """Copy into the value buffers, for every slot with filled[b, h, j] ([B, H, slots],
    contiguous), the values of chunk new_ids[b, h, j] from `slow`, one layer of the slow tier
    [H, P, chunk, D] (contiguous, the buffers' dtype, readable by the kernel at its host
    address: host memory page-locked for CUDA, or any CPU tensor in the interpreter), at the
    sequence's page table[b, chunk] ([B, Cmax] int64)."""
    check_device(new_ids, "read_values_in_place")
    batch, kv_heads, slots = new_ids.shape
    chunk, dim = slow.shape[2], slow.shape[3]
    require(slow.is_contiguous() and slow.dtype == values_like.dtype and slow.shape[0] == kv_heads, "slow",
            f"{tuple(slow.shape)} {slow.dtype}",
            f"must be one contiguous layer [H={kv_heads}, P, chunk, D] in the buffers' dtype {values_like.dtype}")
    require(slow.data_ptr() % ALIGNMENT_BYTES == 0, "slow", f"at address {slow.data_ptr():#x}",
            f"must start on a {ALIGNMENT_BYTES}-byte boundary (the kernel reads its rows in vector accesses)")
    if new_ids.numel() == 0:
        return
    with torch.cuda.device_of(new_ids):
        _values_in_place_kernel[(slots, kv_heads, batch)](
            info, values_like, slow.data_ptr(), new_ids, filled, table, table.stride(0), slow.stride(0), CHUNK=chunk,
            BLOCK_T=triton.next_power_of_2(chunk), HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim),
            NFIELDS=FIELDS)


def held_slot_ids(info: torch.Tensor, kv_heads: int, slots: int) -> torch.Tensor:
    """[B, H, slots] chunk ids held by each sequence's reuse slots (-1 empty, -2 past its
    own k), as `SparseGroup.slot_ids`, read through `info`'s SLOT_IDS pointers."""
    check_device(info, "held_slot_ids")
    batch = info.shape[0]
    held = torch.empty((batch, kv_heads, slots), dtype=torch.int64, device=info.device)
    if held.numel():
        with torch.cuda.device_of(info):
            _held_kernel[(batch, kv_heads)](info, held, slots, BLOCK_S=triton.next_power_of_2(slots), NFIELDS=FIELDS)
    return held


def keep_slot_ids(info: torch.Tensor, new_ids: torch.Tensor) -> None:
    """The step's ids new_ids [B, H, slots] (contiguous) into each sequence's own [H, k]."""
    check_device(new_ids, "keep_slot_ids")
    batch, kv_heads, slots = new_ids.shape
    if new_ids.numel():
        with torch.cuda.device_of(new_ids):
            _keep_kernel[(batch, kv_heads)](info, new_ids, slots, BLOCK_S=triton.next_power_of_2(slots),
                                            NFIELDS=FIELDS)


def match_in_place(info: torch.Tensor, top_scores: torch.Tensor, top_ids: torch.Tensor, k: torch.Tensor,
                   slots: int, reuse: bool, counts: torch.Tensor, tile: int = MATCH_TILE
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk reuse of a layer in one launch: top_scores/top_ids [B, H, k'] (a topk of
    the landmark scores, best first), k [B] each sequence's own k, the held ids read and the
    new ones written back through `info`; returns (new_ids [B, H, slots] int64, filled
    [B, H, slots] bool) as slots.match_slots, and adds the layer's (misses, hits) to
    `counts` [2] (int64, on the device). `tile`: most elements of a picks x slots tile."""
    check_device(top_ids, "match_in_place")
    batch, kv_heads, picks = top_ids.shape
    new_ids = torch.empty((batch, kv_heads, slots), dtype=torch.int64, device=top_ids.device)
    filled = torch.empty((batch, kv_heads, slots), dtype=torch.bool, device=top_ids.device)
    block_slots = triton.next_power_of_2(slots)
    if new_ids.numel():
        with torch.cuda.device_of(top_ids):
            _match_kernel[(batch, kv_heads)](
                info, top_scores.contiguous(), top_ids.contiguous(), k, new_ids, filled, counts, picks, slots,
                REUSE=reuse, BLOCK_K=max(1, min(triton.next_power_of_2(max(picks, 1)), tile // block_slots)),
                BLOCK_S=block_slots, NFIELDS=FIELDS)
    return new_ids, filled
