"""ShadowKV decode groups through the Triton kernels (triton_decode.py): the Triton path.

For a decode group (one query token per sequence) and one global layer, the same steps as the PyTorch path of sparse.py,
each over the whole group at once:
1. `landmark_scores` (one kernel), then one `torch.topk` for the picks;
2. `slots.match_slots`: hits and the slots the misses take (the same batched PyTorch
   operations as the PyTorch path, so both place misses alike), and the one host copy;
3. `rebuild_keys` (one kernel), queued before the host waits for that copy, writes the
   keys of every slot that receives a miss;
4. the misses' values, fetched from the slow tier in one staged copy (on CUDA on a side
   stream, beside the rebuild), written into their slots by `write_values` (one kernel);
5. `slot_attention` (one kernel) writes the step's token into the last window row and
   attends over outliers + slots + exact window + that token, with the slot mask only when some sequence has fewer candidates than k (`slots_full` False).
The per-sequence tensors are addressed through a pointer table built once per layer and
step (`sequence_info`). What stays on the host per sequence is Python bookkeeping with no
device work: reading data pointers, and storing each sequence's slot ids as a view of the
group's new ids.

Imported by sparse.py only when a decode group takes this path (CUDA with triton, or a
test in Triton's interpreter), so CPU runs never import triton.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvforge.cache.shadowkv.select import top_chunks
from kvforge.cache.shadowkv.slots import match_slots
from kvforge.cache.shadowkv.triton_decode import (
    landmark_scores,
    rebuild_keys,
    sequence_info,
    slot_attention,
    write_values,
)
from kvforge.rope import PositionedRope

if TYPE_CHECKING:
    from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup


def attend_decode(sparse: SparseAttention, layer: int, group: SparseGroup, q: torch.Tensor, own_keys: torch.Tensor,
                  own_values: torch.Tensor, rope: PositionedRope, scale: float) -> torch.Tensor:
    """q [B, 1, heads, D] (RoPE applied), own_keys/own_values [B, 1, H, D] (post-RoPE: the
    step's tokens, which the attention kernel writes into the last window row, where `write`
    leaves them to it) -> [B, 1, heads, D]; the buffers, slot ids and statistics are updated
    as the PyTorch path updates them."""
    states = [group.layer(b, layer) for b in range(group.size)]
    query = q[:, 0].contiguous()
    keys = [st.keys for st in states]
    bases = [st.basis for st in states]
    coefficients = [st.coefficients for st in states]
    info = sequence_info(keys, [st.values for st in states], bases, coefficients,
                         [st.candidates for st in states], group.meta, sparse.device)
    with sparse.stats.timed("selection"):
        scores = landmark_scores(query, sparse.store.landmarks[layer], group.table, info, scale)
        picks, valid = top_chunks(scores, group.k_max)
        positions = torch.arange(picks.shape[-1], device=picks.device)
        valid &= (positions[None, :] < group.chunks_per_step[:, None])[:, None, :]
    with sparse.stats.timed("rebuild"):
        slots = group.k_max
        match = match_slots(group.slot_ids(layer, slots), picks, valid, group.table, sparse.reuse)
        new_ids, dim = match.new_ids.contiguous(), query.shape[-1]
        cos, sin = sparse.rope.tables(rope, group.table.shape[1], keys[0].dtype, sparse.device)
        # queued while the host copy of the match is on its way
        rebuild_keys(info, keys[0], bases[0], coefficients[0], new_ids, match.filled.contiguous(),
                     cos.view(-1, dim), sin.view(-1, dim), sparse.chunk)
    fetched = sparse.fetch_misses(layer, group, match)
    if fetched is not None:
        with sparse.stats.timed("rebuild"):
            write_values(info, states[0].values, fetched.contiguous(), match.order, states[0].keys.shape[0],
                         slots)
    with sparse.stats.timed("attention"):
        out = slot_attention(query, own_keys[:, 0].contiguous(), own_values[:, 0].contiguous(), info, keys[0],
                             new_ids, sparse.chunk, scale,
                             mask_slots=not group.slots_full)
    return out[:, None]
