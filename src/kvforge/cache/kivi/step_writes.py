"""What a KIVI step leaves in storage (`KIVICache.end_step`): the tokens that leave the
residuals, quantised into their pages (`flush_group`), then the step's rows that stay in the
residual rings and sink buffers (`write_residuals`).

Order matters and is the caller's: a layer group's flush reads the rings before the residual
writes overwrite them. Both work on every written layer at once (one indexed read or write
per tensor, not one per layer: a write per layer and ring is a dispatch per layer and ring
in every step; docs/benchmarks.md#measurements-behind-design-choices). On the CPU the value
flush from the rings and the ring writes are one C++ call each
(`cpu_quant.flush_value_tokens`, `cpu_quant.write_ring_rows`), which write the same bytes as
the PyTorch expressions here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvforge.cache.kivi.cpu_quant import flush_value_tokens, write_ring_rows
from kvforge.cache.kivi.plan import Flush, ResidualWrites
from kvforge.cache.kivi.store import KIVIStore, store_key_pages, store_value_tokens
from kvforge.step_plan import upload

StepKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # cache layer -> the step's (k, v) rows


def _layer_index(layers: Sequence[int], device: torch.device) -> torch.Tensor:
    return upload(torch.tensor(list(layers), dtype=torch.long), device)


def flush_group(store: KIVIStore, flush: Flush, layers: Sequence[int], step_kv: StepKV,
                residual_dtype: torch.dtype, device: torch.device) -> None:
    """Quantise the tokens of this step that leave the residuals (the plan's `Flush` for the
    layer group `layers`) into their pages: one call for the whole group when every layer of
    it was written this step, else layer by layer."""
    if not flush.key_pages.numel() and not flush.value_slots.numel():
        return
    if all(layer in step_kv for layer in layers):
        parts = [(list(layers), store.all_layers(), True)]
    else:  # some layer not written this step (not done by the engine): layer by layer
        parts = [([layer], store.layer(index, layer), False)
                 for index, layer in enumerate(layers) if layer in step_kv]
    for written, view, whole_group in parts:
        index = _layer_index(written, device)

        def leaving(res: torch.Tensor, which: int, source: tuple[torch.Tensor, torch.Tensor],
                    rows: torch.Tensor, order: torch.Tensor, written: list[int] = written,
                    index: torch.Tensor = index, whole_group: bool = whole_group) -> torch.Tensor:
            """[layers, tokens, H, D] (no layer dim for one layer): residual reads, then rows
            of the step, put back in token order, in residual_dtype."""
            slots, offsets = source
            tokens = res[index[:, None], slots, :, offsets]
            if rows.numel():
                new = torch.stack([step_kv[layer][which][rows] for layer in written])
                tokens = torch.cat((tokens, new.to(residual_dtype)), dim=1)
            tokens = tokens[:, order]
            return tokens if whole_group else tokens[0]

        if flush.key_pages.numel():
            keys = leaving(store.k_res, 0, flush.key_res, flush.key_rows, flush.key_order)
            fill_to, fill_from = flush.key_fill
            if fill_to.numel():
                keys = keys.index_copy(-3, fill_to, keys.index_select(-3, fill_from))
            store_key_pages(view, keys, flush.key_pages)
        if flush.value_slots.numel():
            # Every leaving value still in a ring (a decode step's): the C++ op reads them there.
            if whole_group and not flush.value_rows.numel() and flush_value_tokens(
                    store.v_res, index, *flush.value_res, flush.value_order, view.v_codes, view.v_scale,
                    view.v_zero, flush.value_slots, view.vbits, view.value_group):
                continue
            values = leaving(store.v_res, 1, flush.value_res, flush.value_rows, flush.value_order)
            store_value_tokens(view, values, flush.value_slots)


def write_residuals(store: KIVIStore, writes: ResidualWrites, step_kv: StepKV, residual_dtype: torch.dtype,
                    device: torch.device) -> None:
    """The step's rows that stay in the residual rings (every written layer in one indexed
    write per ring) and the sink tokens it wrote."""
    written = list(step_kv)
    layers = _layer_index(written, device)
    for ring, which, (rows, slots, offsets), every_row in (
            (store.k_res, 0, writes.key, writes.key_rows_all),
            (store.v_res, 1, writes.value, writes.value_rows_all)):
        if rows.numel():
            sources = [step_kv[layer][which] for layer in written]
            if write_ring_rows(ring, layers, sources, rows, slots, offsets):
                continue
            values = torch.stack(sources)
            ring[layers[:, None], slots[None], :, offsets[None]] = (
                values if every_row else values[:, rows]).to(residual_dtype)
    rows, slots, tokens = writes.sink
    if rows.numel() and store.k_sink is not None and store.v_sink is not None:
        for cache_layer, (k, v) in step_kv.items():
            store.k_sink[cache_layer][slots, :, tokens] = k[rows].to(residual_dtype)
            store.v_sink[cache_layer][slots, :, tokens] = v[rows].to(residual_dtype)
