"""One GEMM for a layer's q/k/v projections and one for its MLP's gate/up (vLLM's
`qkv_proj` and `gate_up_proj`): on a GPU each GEMM is a kernel launch, so packing takes
a decode step's layer from seven GEMMs to four.

Packing costs no memory and keeps Hugging Face's names: the parts' weights (and biases)
are concatenated once and each `nn.Linear`'s parameter is re-pointed at its row slice of
the concatenation, so the state dict, loading by name and the CPU kernels (which read each
projection's weight) are unchanged, and an in-place update of a part (`load_state_dict`, an
optimizer step) is an update of the packed tensor.

INVARIANT: the packed tensor is used only while it *is* the parts' storage and no gradient
is wanted. `PackedLinear.usable` checks, on every call, that each part still holds the
Parameters it was packed with and that their data still start at their slices (a `.to()`,
a cast, `.data =` or a reassigned weight breaks this: the layer then runs the separate
GEMMs, never a stale copy), and that autograd does not need the parts' own parameters
(training goes through the separate GEMMs, whose gradients reach the parameters by name).

Where: `packs_projections(device)` is the engine's rule (CUDA; `KVFORGE_PACKED_PROJECTIONS`
= 0 or 1 turns it off or on for every device), which `ModelRunner` applies before any step
or capture through `models.layers.pack_projections` (the layers know what they can pack).
On the CPU the compiled decode layer reads the projections one by one, and bf16 prompts
use per-weight float32 copies, so packing there would gain nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvforge.errors import ConfigError

PACKED_PROJECTIONS_ENV = "KVFORGE_PACKED_PROJECTIONS"


@dataclass(frozen=True)
class PackedLinear:
    """The concatenation of `parts` along their output features: y = x W^T + b holds each
    part's output in `widths` consecutive columns, in order."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    parts: tuple[nn.Linear, ...]
    widths: tuple[int, ...]
    # each part's (weight, bias) parameters as packed, and the addresses of their slices:
    # the packed tensors hold these storages alive, so nothing else can start there
    params: tuple[tuple[nn.Parameter, nn.Parameter | None], ...]
    addresses: tuple[tuple[int, int | None], ...]

    def usable(self) -> bool:
        """The packed tensors still are the parts' storage, and no gradient is wanted of them."""
        if torch.is_grad_enabled() and any(p.requires_grad for part in self.parts for p in part.parameters()):
            return False
        return self.aliased()

    def aliased(self) -> bool:
        """Each part still holds the parameters it was packed with (a reassigned weight is a
        new Parameter), and their data still start at their slices (`.data =`, `.to()` and
        casts move it). Identity and integer compares only: this runs in every layer of
        every eager step."""
        for part, (weight, bias), (weight_at, bias_at) in zip(self.parts, self.params, self.addresses):
            held = part._parameters
            if held["weight"] is not weight or weight.data_ptr() != weight_at:
                return False
            if held.get("bias") is not bias or (bias is not None and bias.data_ptr() != bias_at):
                return False
        return True

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each part's columns of the packed output (views: rows keep the packed stride)."""
        return out.split(self.widths, dim=-1)


def pack_linears(parts: Sequence[nn.Linear]) -> PackedLinear | None:
    """Concatenate the parts' weights (and biases) and re-point each part's parameters at
    its slice. None, packing nothing, when the parts differ in input size, dtype, device or
    having a bias, a weight is on the meta device (not loaded yet), or the device has no
    room for the concatenation (packing is only ever a speed-up)."""
    first = parts[0]
    for part in parts:
        w = part.weight
        if (w.shape[1] != first.weight.shape[1] or w.dtype != first.weight.dtype or w.device != first.weight.device
                or (part.bias is None) != (first.bias is None) or w.is_meta):
            return None
    # A normal tensor (not an inference-mode one, which training could not use later) and no graph.
    with torch.inference_mode(False), torch.no_grad():
        try:
            weight = torch.cat([part.weight.detach() for part in parts])
            bias = None if first.bias is None else torch.cat([part.bias.detach() for part in parts])
        except torch.OutOfMemoryError:
            return None
        row = 0
        addresses = []
        for part in parts:
            width = part.weight.shape[0]
            part.weight.data = weight[row:row + width]
            if bias is not None:
                part.bias.data = bias[row:row + width]
            addresses.append((part.weight.data_ptr(), None if bias is None else part.bias.data_ptr()))
            row += width
    if weight.is_cuda:
        # The parts' old tensors were allocations of their own, which the caching allocator
        # would keep (too small for the next pack): hand them back, so packing a model adds
        # no reserved memory and fits beside a KV cache that took the rest.
        torch.cuda.empty_cache()
    return PackedLinear(weight, bias, tuple(parts), tuple(part.weight.shape[0] for part in parts),
                        tuple((part.weight, part.bias) for part in parts), tuple(addresses))


def still_packed(pack: PackedLinear | None) -> PackedLinear | None:
    """The pack while it still is its parts' storage; else None (dropping it frees the
    storage a move or cast left behind)."""
    return pack if pack is not None and pack.aliased() else None


def packs_projections(device: torch.device) -> bool:
    """The engine's rule: on CUDA, unless KVFORGE_PACKED_PROJECTIONS=0; everywhere with =1."""
    setting = os.environ.get(PACKED_PROJECTIONS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ConfigError(PACKED_PROJECTIONS_ENV, setting, "must be 0 (never pack), 1 (pack on every device) "
                          "or unset (pack on CUDA)")
    if setting:
        return setting == "1"
    return device.type == "cuda"
