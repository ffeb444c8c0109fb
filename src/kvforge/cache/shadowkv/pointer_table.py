"""The pointer table through which ShadowKV's Triton decode kernels address each sequence's
own tensors (triton_decode.py, triton_slots.py).

Per-sequence tensors (K/V buffers, basis, coefficients, candidate masks, reuse-slot ids) are
separate tensors of different sizes (ranks, chunk counts and buffer rows differ per
sequence), so the kernels read them through `info`, an int64 tensor [B, FIELDS] per layer
and step holding their data pointers and sizes, rather than pooling them into group-wide
tensors: pooling would copy every sequence's state each step or change how state.py owns
it, whereas a pointer table is B x FIELDS integers built on the host and copied once. A
pointer is cast in the kernel to the element type of a "like" tensor of the same dtype
(every sequence's tensor of a kind shares one dtype; checked on the host). Every addressed
tensor is contiguous (checked when a row is made) and starts on a 16-byte boundary (one
that does not is replaced by an aligned copy when its row is made), so the kernels take
each pointer through `table_pointer`, which tells the compiler so: loads along head_dim
then compile to 16-byte vector loads (8 bf16 each) instead of one 2-byte load per element
(what it must assume of a pointer made from an integer). A `LayerState` keeps its row
(`kernel_view`) until one of its tensors is replaced, so a step rebuilds only the per-step
columns.

Importing this module imports triton (the columns are Triton constants); it is imported
only where a Triton kernel may run.
"""

from __future__ import annotations

import torch

from kvforge.cache.shadowkv.state import LayerState
from kvforge.errors import require
from kvforge.kernels.triton_jit import jit, tl
from kvforge.step_plan import pack

__all__ = ["ALIGNMENT_BYTES", "FIELDS", "aligned_pointer", "pointer_tables", "sequence_info", "table_pointer"]

ALIGNMENT_BYTES = 16  # every tensor the table addresses starts on such a boundary

# Columns of `info` [B, FIELDS] (int64): data pointers, then sizes (constexpr: kernels read them).
FIELDS = 13
_constexpr = tl.constexpr if tl is not None else int
(KEYS, VALUES, BASIS, COEFFICIENTS, CANDIDATES, SLOT_IDS, RANK, CHUNKS, ROWS, SLOTS_START, WINDOW_START, ROWS_USED,
 OWN_SLOTS) = (_constexpr(column) for column in range(FIELDS))
_PER_STEP = slice(9, 12)  # SLOTS_START, WINDOW_START, ROWS_USED: filled for each step
assert [getattr(c, "value", c) for c in (SLOTS_START, WINDOW_START, ROWS_USED)] == [9, 10, 11]
_ALIGNMENT = _constexpr(ALIGNMENT_BYTES)  # (kernels read only constexpr globals)


_TENSORS = ("keys", "values", "basis", "coefficients", "candidates", "slot_ids")


def _layer_row(layer: LayerState) -> tuple[list[int], tuple[torch.dtype, ...]]:
    """A layer state's pointers and sizes (every column of `info` but the per-step ones) and
    its tensors' dtypes, derived once per set of tensors (`LayerState.kernel_view`)."""
    view = layer.kernel_view
    if view is None:
        if not layer.slot_ids.is_contiguous():  # a view left by the PyTorch path (sparse.py)
            layer.slot_ids = layer.slot_ids.contiguous()
        for name in _TENSORS:
            t = getattr(layer, name)
            require(t.is_contiguous(), name, tuple(t.shape), "must be contiguous")
            if t.data_ptr() % ALIGNMENT_BYTES:  # (a view at an offset): allocations are aligned
                setattr(layer, name, t.clone())
        tensors = [getattr(layer, name) for name in _TENSORS]
        row = [t.data_ptr() for t in tensors] + [layer.basis.shape[0], layer.candidates.shape[1],
                                                 layer.keys.shape[1], 0, 0, 0, layer.slot_ids.shape[1]]
        view = layer.kernel_view = (row, tuple(t.dtype for t in tensors))
    return view  # type: ignore[return-value]


def pointer_tables(layers: list[list[LayerState]], meta: torch.Tensor) -> torch.Tensor:
    """The host `info` of several layers of one group at once: [L, B, FIELDS] from
    layers[l][b], the `LayerState` of sequence b in layer l (see `sequence_info`)."""
    rows = []
    dtypes = None
    for states in layers:
        for layer in states:
            row, kinds = _layer_row(layer)
            dtypes = dtypes or kinds
            require(kinds == dtypes, "dtypes", kinds, f"must be one set in the group ({dtypes})")
            rows.append(row)
    host = torch.tensor(rows, dtype=torch.int64).view(len(layers), -1, FIELDS)
    host[:, :, _PER_STEP] = meta
    return host


def sequence_info(layers: list[LayerState], meta: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """`info` [B, FIELDS] of one layer of a group: per sequence (its `LayerState`) the data
    pointers of its K/V buffers [H, R, D], basis [r, H x D], coefficients [>= C, chunk, r],
    candidate mask [H, C] (bool) and reuse-slot ids [H, k] (int64), then r, C, R, its meta
    row (slots_start, window_start, rows used; host int64 [B, 3]) and k. Every sequence's
    tensors must have the first one's dtypes (the kernels cast pointers to one type). One
    host tensor, copied once to `device` (None: left on the host)."""
    host = pointer_tables([layers], meta)[0]
    return host if device is None else pack([host], device)[0]


@jit
def table_pointer(info, column: tl.constexpr, element: tl.constexpr):
    """Column `column` of a sequence's `info` row as a pointer to `element`, 16-byte aligned
    (`_layer_row` holds every addressed tensor to it): what lets the compiler vectorise."""
    return aligned_pointer(tl.load(info + column), element)


@jit
def aligned_pointer(address, element: tl.constexpr):
    """An integer address, which the caller holds to ALIGNMENT_BYTES, as a pointer to
    `element` that the compiler knows is so aligned (a pointer made from an integer has no
    known alignment, so every element would otherwise move in an access of its own)."""
    return tl.multiple_of(address.to(tl.pointer_type(element)), _ALIGNMENT)
