"""Sparse attention of compressed sequences for one layer (ShadowKV Algorithm 2).

For a group of compressed sequences in a step (every single-token span together, or one
multi-token span alone), per global layer:
1. selection: landmarks of each sequence's chunks (read in place when its chunk pages are
   one run of ids, as after compression; gathered otherwise), scores against the step's
   queries, top-k chunks per KV head (k = budget / chunk of each sequence); outlier
   chunks are not candidates (they are attended exactly);
2. chunk reuse: each (sequence, layer, KV head) has k reuse slots in its exact buffer
   (state.py) holding the chunks the previous step selected. A selected chunk
   already in a slot is a hit and stays where it is; the misses of the whole group are
   rebuilt (coefficients x the head's basis slice, then RoPE at the chunk's positions)
   and fetched (values from the slow tier) at once, then written into slots whose chunk
   was not selected again. Device tensors keep shapes fixed by the group, so the only
   host synchronisation of a layer is the copy of the misses' pages to the host, which
   gathers their values from the slow tier (host memory; see host_sync.py). Keys are
   rebuilt for every slot, one bmm over the heads of each sequence (ranks differ between
   sequences), queued before the host waits for that copy, and written where a miss landed. On CUDA the values go to the
   device on a side stream while keys are rebuilt (not yet run on a GPU);
3. attention, sequence by sequence, over the buffer rows in use: outlier chunks, selected
   slots, exact window (one softmax; slots not holding a chunk of this step are masked,
   which only happens when a sequence has fewer candidates than k). A decode token was
   written into the window by `write` and is part of the buffer; a multi-token span's own
   tokens are a separate, causal part.
The RoPE tables of rebuilt chunks (cos/sin per position, grown to the longest sequence)
are computed once per rotary embedding: scratch, not KV, and not in the byte accounting.

Decode groups (one query token each) in float32 on CPU go through the fused C++ kernel
(cpu_decode.py) when it builds and the `kernel` option is on: the same three
steps per (sequence, KV head) in one call per layer, with the same picks, slot ids and
outputs. On CUDA with `triton` installed (and `kernel` on), decode groups in any float
dtype go through a few Triton kernels over the whole group (`_attend_triton`). The PyTorch
code below is the reference, and it serves multi-token spans, other CPU dtypes, and CUDA
without triton. Chunk reuse (which slot a miss takes) is one function for every path
(slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.cache.shadowkv.attention import Part, masked_attention, sparse_attention
from kvforge.cache.shadowkv.chunk_rope import ChunkRope
from kvforge.cache.shadowkv.cpu_decode import cpu_shadowkv_kernel_available, shadowkv_decode_cpu
from kvforge.cache.shadowkv.select import chunk_scores, top_chunks
from kvforge.cache.shadowkv.slots import SlotMatch, match_slots, miss_pairs
from kvforge.cache.shadowkv.state import CompressedSequence, LayerState, padded_page_tables
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.kernels.row_layout import last_dim_contiguous
from kvforge.kernels.triton_runtime import triton_installed
from kvforge.rope import PositionedRope
from kvforge.step_plan import upload


@dataclass(frozen=True)
class TritonLayerInputs:
    """What the Triton kernels read of one layer of a decode group: the pointer table
    [B, FIELDS] (pointer_table.sequence_info) and tensors whose dtypes the kernels cast
    the K/V buffers', bases' and coefficients' pointers to."""

    info: torch.Tensor
    keys_like: torch.Tensor
    basis_like: torch.Tensor
    coefficients_like: torch.Tensor


@dataclass
class SparseGroup:
    """Compressed sequences attended together: B sequences with Q query tokens each. With
    `own_in_buffer` (decode, Q = 1) the step's token is the last window row of each buffer."""

    states: tuple[CompressedSequence, ...]
    rows: torch.Tensor  # [B * Q] rows of the batch, sequence-major
    queries: int  # Q
    own_in_buffer: bool
    table: torch.Tensor  # [B, Cmax] page ids (padding: page 0, never a candidate)
    chunks_per_step: torch.Tensor  # [B] k of each sequence
    slots_start: torch.Tensor  # [B] first reuse-slot row of each sequence's buffers
    rows_used: list[int]  # [B] buffer rows attention reads: [0, window end)
    row_list: list[int]  # `rows` as Python ints
    first_page: int | None  # the table is pages first_page.. in order (landmarks in place)
    # Every (sequence, head) has at least k candidates, so after a step every reuse slot
    # holds a chunk selected in it: attention needs no mask.
    slots_full: bool
    meta: torch.Tensor  # [B, 3] slots_start, window_start, rows_used of each buffer (int64)
    # Decode group served by the fused kernel, decided once per step (it also writes the
    # step's token into the buffers, so `write` leaves that to it).
    kernel: bool = False
    # The Triton path's pointer table of each global layer, when a fixed-shape step
    # (static_decode.py) filled it; None: built per layer from `states`.
    triton_inputs: list[TritonLayerInputs] | None = None
    # A fixed-shape step's reuse slots per (sequence, head), its bucket's largest k (0: the
    # group's largest k, `k_max`)
    fixed_slots: int = 0
    _candidates: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, states: list[CompressedSequence], rows: list[int], queries: int, own_in_buffer: bool,
              chunk: int, device: torch.device, kernel: bool = False) -> SparseGroup:
        width = max(s.num_chunks for s in states)
        # Built on the host from the page lists, then one copy to the device (step_plan).
        table_host = padded_page_tables(states, len(states), width)
        table, row_tensor, chunks_per_step, slots_start = upload(
            (table_host, torch.tensor(rows, dtype=torch.long),
             torch.tensor([s.chunks_per_step for s in states], dtype=torch.long),
             torch.tensor([s.slots_start for s in states], dtype=torch.long)), device)
        used = [s.window_start(chunk) + s.window + int(own_in_buffer) for s in states]
        first = states[0].run_start
        if first is None or any(s.num_chunks != width or s.run_start != first + b * width
                                for b, s in enumerate(states)):
            first = None
        full = all(s.num_chunks - s.num_outliers >= s.chunks_per_step for s in states)
        meta = torch.tensor([[s.slots_start, s.window_start(chunk), u] for s, u in zip(states, used)],
                            dtype=torch.long)
        return cls(tuple(states), row_tensor, queries, own_in_buffer, table, chunks_per_step, slots_start, used,
                   list(rows), first, full, meta, kernel and own_in_buffer)

    @property
    def size(self) -> int:
        """B: the group's sequences (a fixed-shape step's: its bucket's rows, padding included)."""
        return len(self.row_list) // self.queries

    @property
    def k_max(self) -> int:
        return self.fixed_slots or max(s.chunks_per_step for s in self.states)

    def layer(self, b: int, layer: int) -> LayerState:
        state = self.states[b].layers[layer]
        assert state is not None
        return state

    def candidates(self, layer: int) -> torch.Tensor:
        """[B, H, Cmax] selectable chunks: present and not an outlier of that head."""
        if layer not in self._candidates:
            masks = [self.layer(b, layer).candidates for b in range(self.size)]
            width = self.table.shape[1]
            if all(m.shape[1] == width for m in masks):
                self._candidates[layer] = torch.stack(masks)
            else:
                padded = masks[0].new_zeros((self.size, masks[0].shape[0], width))
                for b, m in enumerate(masks):
                    padded[b, :, :m.shape[1]] = m
                self._candidates[layer] = padded
        return self._candidates[layer]

    def slot_ids(self, layer: int, slots: int) -> torch.Tensor:
        """[B, H, slots] chunk id of every reuse slot (-2 beyond a sequence's own k)."""
        ids = [self.layer(b, layer).slot_ids for b in range(self.size)]
        if all(i.shape[1] == slots for i in ids):
            return torch.stack(ids)
        out = torch.full((self.size, ids[0].shape[0], slots), -2, dtype=torch.long, device=ids[0].device)
        for b, i in enumerate(ids):
            out[b, :, :i.shape[1]] = i
        return out


class SparseAttention:
    def __init__(self, store: ChunkStore, chunk: int, stats: ShadowKVStats, reuse: bool,
                 device: torch.device, kernel: bool = True, triton: bool | None = None) -> None:
        self.store = store
        self.chunk = chunk
        self.stats = stats
        self.reuse = reuse
        self.device = device
        # The fused C++ decode kernel serves decode groups when it applies (float32 on CPU)
        # and builds; everything else runs the PyTorch path below, the reference.
        self.kernel = kernel and device.type == "cpu" and store.landmarks.dtype == torch.float32
        # The Triton kernels (triton_decode.py) serve decode groups on CUDA when `triton` is
        # installed and `kernel` is on (None: decide so); True forces them (tests run them on
        # CPU tensors in Triton's interpreter), False keeps the PyTorch path.
        self.triton = kernel and device.type == "cuda" and triton_installed() if triton is None else triton
        # The Triton path reads the misses' values from the slow tier in place when the device
        # can (store.py): no host wait per layer, hit and miss counts stay on the device.
        self.values_in_place = store.values_in_place
        self.rope = ChunkRope(chunk)
        self._side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def attend(self, layer: int, group: SparseGroup, q: torch.Tensor, own_keys: torch.Tensor,
               own_values: torch.Tensor, rope: PositionedRope, scale: float) -> torch.Tensor:
        """q [B, Q, heads, D] (RoPE applied); own_keys/own_values [B, Q, H, D] (post-RoPE)
        -> [B, Q, heads, D]."""
        if group.kernel:
            return self._attend_kernel(layer, group, q, own_keys[:, 0], own_values[:, 0], rope, scale)
        if self.triton and group.own_in_buffer:
            return self._attend_triton(layer, group, q, own_keys[:, 0], own_values[:, 0], rope, scale)
        with self.stats.timed("selection"):
            if group.first_page is not None:  # one run of pages: a view of the store
                landmarks: torch.Tensor | list[torch.Tensor] = self.store.gather_landmarks(
                    layer, group.table, group.first_page)
            else:  # per sequence: a view where its pages are a run, else a gather
                landmarks = [self.store.sequence_landmarks(layer, s.page_table, s.run_start) for s in group.states]
            scores = chunk_scores(q, landmarks, group.candidates(layer), scale, surely_candidates=group.slots_full)
            picks, valid = top_chunks(scores, group.k_max)
            positions = torch.arange(picks.shape[-1], device=picks.device)
            valid &= (positions[None, :] < group.chunks_per_step[:, None])[:, None, :]
        slot_valid = self._fill_slots(layer, group, picks, valid, rope)
        with self.stats.timed("attention"):
            out = torch.empty_like(q)
            heads, chunk = own_keys.shape[2], self.chunk
            slot_rows: torch.Tensor | None = None  # [B, H, slots * chunk], built when a mask is needed
            for b, state in enumerate(group.states):
                st = group.layer(b, layer)
                used = group.rows_used[b]
                keys, values = st.keys[:, :used], st.values[:, :used]
                if group.own_in_buffer and group.slots_full:
                    out[b, 0] = masked_attention(q[b, 0], keys, values, None, scale)
                    continue
                if slot_rows is None:
                    slot_rows = slot_valid.repeat_interleave(chunk, dim=-1)
                mask = torch.ones((heads, used), dtype=torch.bool, device=self.device)
                mask[:, state.slots_start:state.window_start(chunk)] = slot_rows[b, :, :state.chunks_per_step * chunk]
                if group.own_in_buffer:
                    out[b, 0] = masked_attention(q[b, 0], keys, values, mask, scale)
                else:
                    out[b] = sparse_attention(q[b], [Part(keys, values, mask)], own_keys[b].transpose(0, 1),
                                              own_values[b].transpose(0, 1), scale)
        return out

    def writes_own_tokens(self, group: SparseGroup) -> bool:
        """Whether `attend` writes the group's decode tokens into their buffers itself (the
        fused CPU kernel and the Triton path do), so `write` leaves them alone."""
        return group.kernel or (self.triton and group.own_in_buffer)

    def uses_kernel(self, dtype: torch.dtype) -> bool:
        """Whether decode groups of queries in `dtype` go through the fused kernel."""
        return self.kernel and dtype == torch.float32 and cpu_shadowkv_kernel_available()

    def _attend_kernel(self, layer: int, group: SparseGroup, q: torch.Tensor, own_keys: torch.Tensor,
                       own_values: torch.Tensor, rope: PositionedRope, scale: float) -> torch.Tensor:
        """Decode group (Q = 1) through the fused kernel, which also writes the step's token
        (own_keys/own_values [B, H, D]) into the last window row: same picks, slot ids and
        outputs as the PyTorch path."""
        states = [group.layer(b, layer) for b in range(group.size)]
        for st in states:
            if not st.slot_ids.is_contiguous():  # a view left by the PyTorch path
                st.slot_ids = st.slot_ids.contiguous()
        dim = q.shape[-1]
        cos, sin = self.rope.tables(rope, group.table.shape[1], torch.float32, self.device)
        out, counters = shadowkv_decode_cpu(
            q[:, 0].contiguous(), self.store.landmarks[layer], self.store.values[layer], cos.view(-1, dim), sin.view(-1, dim), [s.page_table for s in group.states],
            [st.candidates for st in states], [st.basis for st in states], [st.coefficients for st in states],
            [st.keys for st in states],
            [st.values for st in states], [st.slot_ids for st in states], own_keys, own_values, group.meta, scale,
            self.reuse)
        self.stats.count(counters.misses, counters.hits)
        for phase in ("selection", "rebuild", "fetch", "attention"):
            self.stats.seconds[phase] += getattr(counters, phase)
        return out[:, None]

    def _attend_triton(self, layer: int, group: SparseGroup, q: torch.Tensor, own_keys: torch.Tensor,
                       own_values: torch.Tensor, rope: PositionedRope, scale: float) -> torch.Tensor:
        """Decode group (Q = 1) through the Triton kernels (triton_decode.py), each launched
        once over the whole group: landmark scores (then one topk), the reuse slots' ids read
        through the pointer table, the shared chunk reuse (slots.py), key rebuild into the
        slots receiving a miss, the misses' values (read in place from the slow tier, or from
        one staged fetch after the host learns them), the step's slot ids written back, and
        attention, which also writes the step's token (own_keys/own_values [B, H, D]) into its
        window row. Same picks, slot ids and outputs as the PyTorch path. The host only
        builds the pointer table (`sequence_info`, or the fixed step's, static_decode.py)."""
        # these import triton: only on this path
        from kvforge.cache.shadowkv import triton_decode as kernels
        from kvforge.cache.shadowkv import triton_slots as slot_kernels

        inputs = group.triton_inputs[layer] if group.triton_inputs is not None else self._triton_inputs(layer, group)
        query, info = q[:, 0].contiguous(), inputs.info
        kv_heads, slots, dim = own_keys.shape[1], group.k_max, query.shape[-1]
        in_place = self.values_in_place
        with self.stats.timed("selection"):
            scores = kernels.landmark_scores(query, self.store.landmarks[layer], group.table, info, scale)
            if in_place:
                top_scores, picks = torch.topk(scores, min(slots, scores.shape[-1]), dim=-1)
            else:
                picks, valid = top_chunks(scores, slots)
                positions = torch.arange(picks.shape[-1], device=picks.device)
                valid &= (positions[None, :] < group.chunks_per_step[:, None])[:, None, :]
        with self.stats.timed("rebuild"):
            if in_place:  # validity, matching, write-back and counts in one launch
                new_ids, filled = slot_kernels.match_in_place(info, top_scores, picks, group.chunks_per_step, slots,
                                                              self.reuse, self.stats.device_counter(self.device))
            else:
                held = slot_kernels.held_slot_ids(info, kv_heads, slots)
                match = match_slots(held, picks, valid, group.table, self.reuse)
                new_ids, filled = match.new_ids.contiguous(), match.filled.contiguous()
                slot_kernels.keep_slot_ids(info, new_ids)
            cos, sin = self.rope.tables(rope, group.table.shape[1], inputs.keys_like.dtype, self.device)
            kernels.rebuild_keys(info, inputs.keys_like, inputs.basis_like, inputs.coefficients_like, new_ids, filled,
                                 cos.view(-1, dim), sin.view(-1, dim), self.chunk)
        if in_place:
            with self.stats.timed("fetch"):
                slot_kernels.read_values_in_place(info, inputs.keys_like, self.store.values[layer], new_ids,
                                                  filled, group.table)
        else:
            fetched = self.fetch_misses(layer, match)
            if fetched is not None:
                with self.stats.timed("rebuild"):
                    kernels.write_values(info, inputs.keys_like, fetched.contiguous(), match.order, kv_heads, slots)
        with self.stats.timed("attention"):
            # the step's own K/V are read at their strides (v may be a packed projection's slice)
            out = kernels.slot_attention(query, last_dim_contiguous(own_keys), last_dim_contiguous(own_values), info,
                                         inputs.keys_like, new_ids, self.chunk, scale,
                                         mask_slots=not group.slots_full)
        return out[:, None]

    def _triton_inputs(self, layer: int, group: SparseGroup) -> TritonLayerInputs:
        """The pointer table of one layer of a decode group, built now (one host tensor, one copy)."""
        from kvforge.cache.shadowkv.pointer_table import sequence_info

        states = [group.layer(b, layer) for b in range(group.size)]
        info = sequence_info(states, group.meta, self.device)
        return TritonLayerInputs(info, states[0].keys, states[0].basis, states[0].coefficients)

    def _fill_slots(self, layer: int, group: SparseGroup, picks: torch.Tensor, valid: torch.Tensor,
                    rope: PositionedRope) -> torch.Tensor:
        """Make every valid pick [B, H, k'] present in a reuse slot; returns [B, H, slots]
        True for slots holding a chunk selected in this step.

        Every tensor on the device has a shape fixed by the group (B, H, slots), so nothing
        waits for the device but one copy to the host: the slow-tier pages of the misses,
        which the host gathers (host_sync). Keys are rebuilt for every slot of every
        (sequence, head) at once, one batched matmul with that head's basis slice, and
        written only where a miss landed; on the GPU that costs less than waiting for the
        miss count."""
        chunk, dim = self.chunk, self.store.landmarks.shape[-1]
        batch, heads = picks.shape[:2]
        with self.stats.timed("rebuild"):
            slots = group.k_max
            match = match_slots(group.slot_ids(layer, slots), picks, valid, group.table, self.reuse)
            chunks = match.new_ids.clamp(min=0)  # chunk of every slot (0 where nothing is written)
            rebuilt = self._rebuild(layer, group, chunks, rope)  # queued while the copy is on its way
        for b in range(group.size):  # the slot ids of this step (views into new_ids: no copy)
            st = group.layer(b, layer)
            st.slot_ids = match.new_ids[b, :, :st.slot_ids.shape[1]]
        fetched = self.fetch_misses(layer, match)
        if fetched is None:  # no misses (known on the host now): nothing to write
            return match.new_ids >= 0
        with self.stats.timed("rebuild"):
            values = rebuilt.new_empty((batch * heads * slots, chunk, dim))
            values.index_copy_(0, match.order[:fetched.shape[0]], fetched.to(values.dtype))
            values = values.view(batch, heads, slots * chunk, dim)
            rebuilt = rebuilt.view(batch, heads, slots * chunk, dim)
            written = match.filled.repeat_interleave(chunk, dim=-1)[..., None]  # [B, H, slots * chunk, 1]
            for b, state in enumerate(group.states):
                st = group.layer(b, layer)
                rows = slice(state.slots_start, state.window_start(chunk))
                width = state.chunks_per_step * chunk
                for buffer, new in ((st.keys, rebuilt), (st.values, values)):
                    region = buffer[:, rows]
                    region.copy_(torch.where(written[b, :, :width], new[b, :, :width].to(buffer.dtype), region))
        return match.new_ids >= 0

    def fetch_misses(self, layer: int, match: SlotMatch) -> torch.Tensor | None:
        """Wait for the host copy of `match`, count hits and misses, and fetch the misses'
        values [M, chunk, D] (in `match.order`) onto the device in one staged copy; None
        without misses. On CUDA the copy runs on a side stream, beside the rebuild queued
        before (not yet run on a GPU)."""
        host = match.to_host.tolist()
        misses, hits = host[0], host[1]
        self.stats.count(misses, hits)
        if not misses:
            return None
        side = self._side_stream
        if side is None:
            with self.stats.timed("fetch"):
                return self.store.fetch_values(layer, *miss_pairs(host, misses, match.total))
        with self.stats.timed("fetch"), torch.cuda.stream(side):
            fetched = self.store.fetch_values(layer, *miss_pairs(host, misses, match.total))
        torch.cuda.current_stream(self.device).wait_stream(side)
        fetched.record_stream(torch.cuda.current_stream(self.device))
        return fetched

    def _rebuild(self, layer: int, group: SparseGroup, chunks: torch.Tensor, rope: PositionedRope) -> torch.Tensor:
        """Keys [B, H, slots, chunk, D] (post-RoPE) of chunk `chunks` [B, H, slots]: the
        chunk's coefficients [chunk, r] x the (sequence, head)'s basis slice [r, D], one
        bmm over the heads of each sequence (its rank is its own)."""
        batch, heads, slots = chunks.shape
        chunk, dim = self.chunk, self.store.landmarks.shape[-1]
        keys = chunks.new_empty((batch, heads, slots * chunk, dim), dtype=self.store.landmarks.dtype)
        for b in range(batch):
            st = group.layer(b, layer)
            coefficients = st.coefficients.index_select(0, chunks[b].reshape(-1))  # [H * slots, chunk, r]
            basis = st.basis.view(-1, heads, dim).transpose(0, 1)  # [H, r, D]
            torch.bmm(coefficients.view(heads, slots * chunk, -1).to(keys.dtype), basis.to(keys.dtype), out=keys[b])
        keys = self.rope.apply(keys.view(-1, chunk, dim), chunks.view(-1), rope, group.table.shape[1])
        return keys.view(batch, heads, slots, chunk, dim)
