"""Linear weights prepacked once for oneDNN, for the prefill-sized linear calls on a CPU.

ATen's `F.linear` on a CPU hands oneDNN the plain [N, K] weight, which oneDNN reorders into
its blocked layout on every call; at prefill sizes (more rows than `cpu_linear.MAX_ROWS`)
that reorder is a visible share of the product, most of all in float32 and at a few hundred
rows (a chat turn). `prepack_weights` makes the blocked copy once
(`torch.ops.mkldnn._reorder_linear_weight`) and attaches it to its weight tensor;
`packed_linear` then runs `torch.ops.mkldnn._linear_pointwise` on it. vLLM's CPU backend
does the same and drops the plain weight; kvforge keeps it, because its decode kernels
(`cpu_linear`, the fused decode layer) read the plain layout. The copy therefore adds the
linear weights' bytes once more, which is what the policy bounds:

- "auto" packs float32 and bfloat16 weights on a CPU with oneDNN when the copy takes at most
  `AUTO_MEMORY_SHARE` of the memory available at start-up (bfloat16 ones as they are only on a
  CPU whose oneDNN has bf16 products, `onednn_packs`; elsewhere widened or not at all);
- "on" packs whenever oneDNN can, "off" never (and drops copies an earlier engine made).

bf16 weights are packed as float32 when `widen_bf16` says their products run faster widened on
this CPU (`bf16_products`): each call then widens x, multiplies in float32 and rounds y to bf16
once, the same products as bf16's (exact in float32) summed in another order. The copy then
takes twice the bf16 weights' bytes, and the policy's bound counts them so; where float32
copies would not fit under "auto", bf16 ones are made instead.

Invariants:
- a packed copy is used only while its weight is unchanged since packing (the same storage
  and `_version`) and only for calls that F.linear would compute the same way up to rounding: x of the
  weight's dtype on the CPU, a bias of that dtype or none, no autograd. Anything else, and
  any weight without a copy, runs F.linear (`packed_linear` returns None).
- results differ from F.linear by rounding only (oneDNN's blocking of the same sums), and are
  in the weight's dtype whichever form the copy has.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.errors import require
from kvforge.kernels.prepack_policy import PREPACK_POLICIES
from kvforge.sizes import meminfo_bytes

__all__ = ["AUTO_MEMORY_SHARE", "PACKABLE_DTYPES", "PREPACK_POLICIES", "PrepackReport", "available_memory_bytes", "drop_packed",
           "has_widened_copy", "onednn_packs", "packed_linear", "packed_linear_float32", "prepack_available",
           "prepack_weights"]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
AUTO_MEMORY_SHARE = 0.25
# On a packed weight: (its tensor when packed, detached: same storage and version counter;
# its version then; the packed copy; whether that copy is the bf16 weight widened to float32).
# Holding the storage keeps its address from being reused, so "same address and version"
# means "unchanged" even across `weight.data = ...` (which keeps the version counter) and
# module casts.
_ATTRIBUTE = "_kvforge_onednn_packed"


@dataclass(frozen=True)
class PrepackReport:
    """What `prepack_weights` did: `weights` packed copies holding `bytes`, made in
    `seconds`, of which `reused` were an earlier engine's copies of unchanged weights (kept,
    not made again); `skipped` says why none were made (None when some were)."""

    weights: int
    bytes: int
    seconds: float
    skipped: str | None = None
    reused: int = 0
    widened: int = 0

    def describe(self) -> str:
        if self.skipped is not None:
            return f"linear weights not prepacked for oneDNN: {self.skipped}"
        kept = f", {self.reused} of them an earlier engine's copies kept" if self.reused else ""
        wide = f", {self.widened} bf16 weights packed as float32" if self.widened else ""
        return (f"prepacked {self.weights} linear weights for oneDNN's prefill products "
                f"({self.bytes / 2**20:.0f} MiB more memory{kept}{wide}, {self.seconds:.2f} s)")


def prepack_available() -> bool:
    """True when this torch build offers oneDNN's packed linear ops."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack and multiply a `dtype` weight on this CPU: float32 wherever the
    ops exist; bfloat16 only on a CPU with its bf16 instructions (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; an AVX2-only CPU refuses the reorder). A bf16 weight it cannot pack
    natively is still packed widened to float32 when `widen_bf16` asks for it."""
    if not prepack_available() or dtype not in PACKABLE_DTYPES:
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory the kernel could hand out now (MemAvailable), or None where unknown."""
    return meminfo_bytes("MemAvailable", meminfo)


def _packable(weight: torch.Tensor, widen_bf16: bool) -> bool:
    # an inference tensor has no version counter to tell a changed weight by
    return (weight.dim() == 2 and weight.is_cpu and weight.dtype in PACKABLE_DTYPES and not weight.is_inference()
            and weight.numel() > 0 and onednn_packs(torch.float32 if _widens(weight, widen_bf16) else weight.dtype))


def _widens(weight: torch.Tensor, widen_bf16: bool) -> bool:
    return widen_bf16 and weight.dtype == torch.bfloat16


def _copy_bytes(weight: torch.Tensor, widen_bf16: bool) -> int:
    return weight.numel() * (4 if _widens(weight, widen_bf16) else weight.element_size())


def prepack_weights(weights: Iterable[torch.Tensor], policy: str, available_bytes: int | None,
                    widen_bf16: bool = False) -> PrepackReport:
    """Attach a oneDNN-packed copy to each packable weight under `policy` (see the module
    docstring); `available_bytes` is the memory "auto" may take its share of (None: unknown,
    so "auto" packs nothing). `widen_bf16`: pack bf16 weights as float32."""
    require(policy in PREPACK_POLICIES, "prepack_weights", policy, f"must be one of {list(PREPACK_POLICIES)}")
    weights = list({id(weight): weight for weight in weights}.values())  # a tied weight once
    if policy == "off":
        drop_packed(weights)
        return PrepackReport(0, 0, 0.0, "--prepack-weights off")
    if not prepack_available():
        return PrepackReport(0, 0, 0.0, "this torch build has no oneDNN packed linear ops")
    packable = [w for w in weights if _packable(w, widen_bf16)]
    if not packable:
        return PrepackReport(0, 0, 0.0, "no float32 or bfloat16 CPU linear weights oneDNN can pack on this CPU")
    total = sum(_copy_bytes(w, widen_bf16) for w in packable)
    if (policy == "auto" and widen_bf16 and available_bytes is not None and total > AUTO_MEMORY_SHARE * available_bytes
            and onednn_packs(torch.bfloat16)):
        widen_bf16 = False  # bf16 copies where float32 ones would not fit: still faster than none
        total = sum(_copy_bytes(w, widen_bf16) for w in packable)
    if policy == "auto":
        if available_bytes is None:
            return PrepackReport(0, 0, 0.0, "the available memory is unknown (--prepack-weights on packs anyway)")
        if total > AUTO_MEMORY_SHARE * available_bytes:
            return PrepackReport(0, 0, 0.0, f"the copy ({total / 2**20:.0f} MiB) would take more than "
                                 f"{AUTO_MEMORY_SHARE:.0%} of the available memory ({available_bytes / 2**20:.0f} MiB); "
                                 "--prepack-weights on packs anyway")
    start = time.perf_counter()
    reused = 0
    with torch.no_grad():
        for weight in packable:
            wide = _widens(weight, widen_bf16)
            current = _current_copy(weight)
            if current is not None and current[1] == wide:
                reused += 1  # packed by an earlier engine on the same model, and unchanged since
                continue
            source = weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(source.float() if wide else source, None)
            setattr(weight, _ATTRIBUTE, (source, weight._version, packed, wide))
    return PrepackReport(len(packable), total, time.perf_counter() - start, reused=reused,
                         widened=sum(_widens(w, widen_bf16) for w in packable))


def drop_packed(weights: Iterable[torch.Tensor]) -> None:
    """Free the packed copies of `weights` (a model that moves or casts its parameters)."""
    for weight in weights:
        if hasattr(weight, _ATTRIBUTE):
            delattr(weight, _ATTRIBUTE)


def _current_copy(weight: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
    """(`weight`'s packed copy, whether it is widened to float32) while the weight is
    unchanged since packing, else None."""
    entry = getattr(weight, _ATTRIBUTE, None)
    if entry is None:
        return None
    source, version, packed, wide = entry
    if weight.data_ptr() != source.data_ptr() or weight._version != version or weight.dtype != source.dtype:
        return None
    return packed, wide


def _qualifies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, x_dtypes: tuple) -> bool:
    if x.dtype not in x_dtypes or not x.is_cpu or (bias is not None and (bias.dtype != weight.dtype or not bias.is_cpu)):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` on `weight`'s packed copy, or None when there is none or
    the call does not qualify (module docstring). With a widened copy x may also be float32
    holding bf16 values (`widened_input`: one x widened once for several products)."""
    current = _current_copy(weight)
    if current is None:
        return None
    packed, wide = current
    if not _qualifies(x, weight, bias, (weight.dtype, torch.float32) if wide else (weight.dtype,)):
        return None
    if wide:  # exact bf16 products in float32, rounded to bf16 once
        return _widened_product(x, packed, bias).to(weight.dtype)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`x @ weight.T + bias` in float32, not rounded, on `weight`'s widened copy (a bf16 weight
    packed as float32); x bf16 (widened exactly) or float32. None when the weight has no
    widened copy or the call does not qualify. For a chain of products that keeps its
    activations in float32 between them (GatedMLP's prefill)."""
    current = _current_copy(weight)
    if current is None or not current[1] or not _qualifies(x, weight, bias, (torch.bfloat16, torch.float32)):
        return None
    return _widened_product(x, current[0], bias)


def has_widened_copy(weight: torch.Tensor) -> bool:
    """True when `weight` is a bf16 weight whose current packed copy is float32."""
    current = _current_copy(weight)
    return current is not None and current[1]


def _widened_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x if x.dtype == torch.float32 else x.float(), packed,
                                              None if bias is None else bias.float(), "none", [], "")
