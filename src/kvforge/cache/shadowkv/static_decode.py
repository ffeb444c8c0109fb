"""The `shadowkv` method's decode-only steps in fixed shapes (cache/static_decode.py), for
the Triton kernels with the slow tier read in place (`slow_store=pinned` on CUDA): such a
step reads nothing on the host, so it can be captured in a CUDA graph.

Every row runs both of a global layer's attentions, each row keeps its own (`mixed_rows`,
1 where the sequence is exact): the inner `full` cache's over the exact sequences (the
others are its padding rows: they write its scratch page and see nothing stored) and the
sparse attention over the compressed ones (the others point at a scratch state). So one
fixed step (form "any") serves a batch of exact and compressed sequences in any mix, as
serving prompts of different lengths gives (a prompt shorter than min_context stays
exact). A step whose sequences are all compressed (the long-context serving the paper
measures) runs form "compressed", captured beside it: the sparse attention alone, without
the exact cache's page writes, its attention over padding rows and the per-row choice
(four kernels per global layer fewer). Sliding-window layers run their inner `full`
cache's fixed step over every row in both forms (every sequence keeps its window exact).
A bucket shorter than min_context never holds a compressed sequence: its step (`slots` 0)
is the inner caches' alone, with no sparse buffers or kernels, in one form.

The sparse buffers of a bucket of `rows` sequences of at most `max_tokens` tokens: the
chunk page table padded to `width` chunks, each sequence's k (chunks selected per KV head),
and per global layer the Triton kernels' pointer table (pointer_table.py: the per-sequence
K/V buffers, basis, coefficients, candidate mask and reuse-slot ids, with their sizes),
refilled from the host each step, so a fold that moves a sequence's state is seen by the
next step. The step selects `slots` chunks per (sequence, head), the bucket's largest k: a
sequence's own k masks the rest, as in a group of different k. (Chunks of equal score may
be ordered differently by a top-k over the bucket's width than over the group's; the picks
are then another choice among equals, which CUDA's top-k does not fix anyway.)

Rows that are not a compressed sequence point at the scratch state: no candidate chunk (so
no pick, miss or fetch), k = 0 (no slot id read or written), one buffer row, into which the
attention kernel writes the row's token and which it attends alone. A step in which a
sequence compresses, or with a table wider than the bucket, runs eagerly.

After the step, `finish` hands the host metadata the step's RoPE per layer (a fold at
`end_step` un-rotates the folded keys with it); the window append and folds run eagerly
in `end_step`, as in the dynamic step (the step's tokens are already in the buffers), and
the inner caches commit their host plans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvforge.batch import ForwardBatch
from kvforge.cache.full.static_decode import FullStaticLayout
from kvforge.cache.page_table import PageTable
from kvforge.cache.shadowkv.query_samples import QuerySampler
from kvforge.cache.shadowkv.sparse import SparseGroup, TritonLayerInputs
from kvforge.cache.shadowkv.state import LayerState, padded_page_tables
from kvforge.cache.shadowkv.step import ShadowKVStepMetadata
from kvforge.cache.static_decode import StaticDecode

# The scratch state's meta row (slots_start, window_start, rows used): slots and window at
# row 0, one row in use (the padding row's own token).
SCRATCH_META = torch.tensor([[0, 0, 1]], dtype=torch.long)


def scratch_state(kv_heads: int, head_dim: int, chunk: int, dtype: torch.dtype, coefficient_dtype: torch.dtype,
                  device: torch.device) -> LayerState:
    """What padding rows point at: one buffer row, rank 1, no candidate chunk, k = 0."""
    return LayerState(basis=torch.zeros((1, kv_heads * head_dim), dtype=dtype, device=device),
                      coefficients=torch.zeros((1, chunk, 1), dtype=coefficient_dtype, device=device),
                      outliers=torch.zeros((kv_heads, 0), dtype=torch.long, device=device),
                      keys=torch.zeros((kv_heads, 1, head_dim), dtype=dtype, device=device),
                      values=torch.zeros((kv_heads, 1, head_dim), dtype=dtype, device=device),
                      slot_ids=torch.zeros((kv_heads, 0), dtype=torch.long, device=device),
                      candidates=torch.zeros((kv_heads, 0), dtype=torch.bool, device=device))


class ShadowKVStaticDecode(StaticDecode[ShadowKVStepMetadata]):
    def __init__(self, begin_step: Callable[[ForwardBatch], ShadowKVStepMetadata], num_layers: int,
                 scratch: LayerState, chunk: int, device: torch.device, rows: int, width: int, slots: int,
                 exact: tuple[PageTable, int], sliding: tuple[PageTable, int] | None) -> None:
        """`begin_step`: the cache's (its checks and the step's host metadata, planned on the
        host); `num_layers`: global cache layers; `width`: chunks of the longest sequence;
        `slots`: the largest k (0: no compressed sequence fits the bucket); `exact`, `sliding`: the inner caches' page tables and their
        widths in pages (sliding None: no sliding-window layer)."""
        from kvforge.cache.shadowkv.pointer_table import FIELDS, sequence_info

        self.begin_step, self.num_layers, self.scratch = begin_step, num_layers, scratch
        self.chunk, self.device, self.width, self.slots = chunk, device, width, slots
        self.exact = FullStaticLayout(exact[0], rows, exact[1], prefix="exact.")
        self.sliding = FullStaticLayout(sliding[0], rows, sliding[1], prefix="sliding.") if sliding else None
        shapes: dict[str, tuple[int, ...]] = {}
        if slots:
            shapes.update({"table": (rows, width), "chunks_per_step": (rows,), "exact_row": (rows,)})
            shapes.update({f"{g}.info": (rows, FIELDS) for g in range(num_layers)})
        shapes.update(self.exact.shapes | (self.sliding.shapes if self.sliding else {}))
        super().__init__(rows, shapes, device)
        self.forms = ("any", "compressed") if slots else ("any",)
        self.row_order = torch.arange(rows, device=device)
        # one padding row of the pointer table (the scratch state: rows used 1, slots and
        # window at row 0)
        self.padding_info = sequence_info([scratch], SCRATCH_META, None)
        # Until the first step loads, every row is padding (a capture runs on these values).
        self.buffers.fill(self._padding() | {"token_ids": torch.zeros(rows, dtype=torch.long),
                                             "positions": torch.zeros(rows, dtype=torch.long)})

    def _padding(self) -> dict[str, torch.Tensor]:
        """Every row padding in every store."""
        rows = self.rows
        inner = self.exact.padding() | (self.sliding.padding() if self.sliding else {})
        if not self.slots:
            return inner
        return ({"table": torch.zeros((rows, self.width), dtype=torch.long),
                 "chunks_per_step": torch.zeros(rows, dtype=torch.long),
                 "exact_row": torch.zeros(rows, dtype=torch.long)}
                | {f"{g}.info": self.padding_info.expand(rows, -1).clone() for g in range(self.num_layers)} | inner)

    def form_of(self, host_meta: ShadowKVStepMetadata) -> str:
        return "compressed" if self.slots and host_meta.exact is None else "any"

    def make_meta(self, form: str = "any") -> ShadowKVStepMetadata:
        if form not in self.forms:
            raise ValueError(f"form {form!r}: this bucket's step has forms {list(self.forms)}")
        buffers = self.buffers.tensors
        inner = (self.batch, self.row_order, self.device)
        exact = self.exact.meta(buffers, *inner) if form == "any" else None
        sliding = self.sliding.meta(buffers, *inner) if self.sliding else None
        if not self.slots:  # every row an exact sequence or padding
            return ShadowKVStepMetadata(self.batch, exact=exact, sliding=sliding, exact_rows=None, compressing=(),
                                        compressed_spans=(), groups=(), any_compressed=False,
                                        queries=QuerySampler(enabled=False), fixed=True)
        likes = (self.scratch.keys, self.scratch.basis, self.scratch.coefficients)
        rows = self.rows
        group = SparseGroup(
            states=(), rows=self.row_order, queries=1, own_in_buffer=True, table=buffers["table"],
            chunks_per_step=buffers["chunks_per_step"], slots_start=self.row_order, rows_used=[],
            row_list=list(range(rows)), first_page=None, slots_full=False, meta=torch.zeros((0, 3), dtype=torch.long),
            triton_inputs=[TritonLayerInputs(buffers[f"{g}.info"], *likes) for g in range(self.num_layers)],
            fixed_slots=self.slots)
        return ShadowKVStepMetadata(
            self.batch, exact=exact, sliding=sliding, exact_rows=None, compressing=(), compressed_spans=(),
            groups=(group,), any_compressed=True, queries=QuerySampler(enabled=False),
            mixed_rows=buffers["exact_row"] if form == "any" else None, fixed=True)

    def plan(self, batch: ForwardBatch) -> tuple[ShadowKVStepMetadata, dict[str, torch.Tensor]] | None:
        host_meta = self.begin_step(batch)
        if host_meta.compressing or len(host_meta.groups) > 1 or any(not g.own_in_buffer for g in host_meta.groups):
            return None
        values = self._padding()
        if host_meta.groups and not (self.slots and self._place_compressed(host_meta.groups[0], values)):
            return None
        if host_meta.exact is not None:
            at = host_meta.exact_rows  # (None: every sequence is exact)
            exact = self.exact.values(host_meta.exact.groups, at)
            if exact is None:
                return None
            values |= exact
            if self.slots:
                values["exact_row"][at if at is not None else slice(0, len(batch.spans))] = 1
        if host_meta.sliding is not None:
            assert self.sliding is not None
            sliding = self.sliding.values(host_meta.sliding.groups, None)
            if sliding is None:
                return None
            values |= sliding
        return host_meta, values

    def _place_compressed(self, group: SparseGroup, values: dict[str, torch.Tensor]) -> bool:
        """Write the compressed sequences' sparse buffers at their rows; False when the
        bucket is too narrow for them."""
        from kvforge.cache.shadowkv.pointer_table import pointer_tables

        states = group.states
        if max(s.num_chunks for s in states) > self.width or group.k_max > self.slots:
            return False
        at = torch.tensor(group.row_list, dtype=torch.long)  # decode only: one row per sequence
        values["table"][at] = padded_page_tables(states, len(states), self.width)
        values["chunks_per_step"][at] = torch.tensor([s.chunks_per_step for s in states], dtype=torch.long)
        by_layer = [[group.layer(b, g) for b in range(len(states))] for g in range(self.num_layers)]
        # the scratch state first in every layer: `pointer_tables` holds every sequence's
        # tensors to its dtypes, which the kernels were captured with
        tables = pointer_tables([[self.scratch, *layers] for layers in by_layer],
                                torch.cat((SCRATCH_META, group.meta)))[:, 1:]
        for g in range(self.num_layers):
            values[f"{g}.info"][at] = tables[g]
        return True

    def finish(self, host_meta: ShadowKVStepMetadata, meta: ShadowKVStepMetadata, rows: int) -> None:
        host_meta.layer_ropes = dict(meta.layer_ropes)
