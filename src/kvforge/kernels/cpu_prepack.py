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
  `AUTO_MEMORY_SHARE` of the memory available at start-up;
- "on" packs whenever oneDNN can, "off" never (and drops copies an earlier engine made).

Invariants:
- a packed copy is used only while its weight is unchanged since packing (the same storage
  and `_version`) and only for calls that F.linear would compute the same way up to rounding: x of the
  weight's dtype on the CPU, a bias of that dtype or none, no autograd. Anything else, and
  any weight without a copy, runs F.linear (`packed_linear` returns None).
- results differ from F.linear by rounding only (oneDNN's blocking of the same sums).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.errors import require
from kvforge.kernels.prepack_policy import PREPACK_POLICIES

__all__ = ["AUTO_MEMORY_SHARE", "PACKABLE_DTYPES", "PREPACK_POLICIES", "PrepackReport", "available_memory_bytes", "drop_packed",
           "packed_linear", "prepack_available", "prepack_weights"]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
AUTO_MEMORY_SHARE = 0.25
# On a packed weight: (its tensor when packed, detached: same storage and version counter;
# its version then; the packed copy). Holding the storage keeps its address from being
# reused, so "same address and version" means "unchanged" even across `weight.data = ...`
# (which keeps the version counter) and module casts.
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

    def describe(self) -> str:
        if self.skipped is not None:
            return f"linear weights not prepacked for oneDNN: {self.skipped}"
        kept = f", {self.reused} of them an earlier engine's copies kept" if self.reused else ""
        return (f"prepacked {self.weights} linear weights for oneDNN's prefill products "
                f"({self.bytes / 2**20:.0f} MiB more memory{kept}, {self.seconds:.2f} s)")


def prepack_available() -> bool:
    """True when this torch build offers oneDNN's packed linear ops."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The memory the kernel could hand out now (MemAvailable), or None where unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _packable(weight: torch.Tensor) -> bool:
    # an inference tensor has no version counter to tell a changed weight by
    return (weight.dim() == 2 and weight.is_cpu and weight.dtype in PACKABLE_DTYPES and not weight.is_inference()
            and weight.numel() > 0)


def prepack_weights(weights: Iterable[torch.Tensor], policy: str, available_bytes: int | None) -> PrepackReport:
    """Attach a oneDNN-packed copy to each packable weight under `policy` (see the module
    docstring); `available_bytes` is the memory "auto" may take its share of (None: unknown,
    so "auto" packs nothing)."""
    require(policy in PREPACK_POLICIES, "prepack_weights", policy, f"must be one of {list(PREPACK_POLICIES)}")
    weights = list({id(weight): weight for weight in weights}.values())  # a tied weight once
    if policy == "off":
        drop_packed(weights)
        return PrepackReport(0, 0, 0.0, "--prepack-weights off")
    if not prepack_available():
        return PrepackReport(0, 0, 0.0, "this torch build has no oneDNN packed linear ops")
    packable = [w for w in weights if _packable(w)]
    if not packable:
        return PrepackReport(0, 0, 0.0, "no float32 or bfloat16 CPU linear weights")
    total = sum(w.numel() * w.element_size() for w in packable)
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
            if _current_copy(weight) is not None:
                reused += 1  # packed by an earlier engine on the same model, and unchanged since
                continue
            source = weight.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(source, None)
            setattr(weight, _ATTRIBUTE, (source, weight._version, packed))
    return PrepackReport(len(packable), total, time.perf_counter() - start, reused=reused)


def drop_packed(weights: Iterable[torch.Tensor]) -> None:
    """Free the packed copies of `weights` (a model that moves or casts its parameters)."""
    for weight in weights:
        if hasattr(weight, _ATTRIBUTE):
            delattr(weight, _ATTRIBUTE)


def _current_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight`'s packed copy while the weight is unchanged since packing, else None."""
    entry = getattr(weight, _ATTRIBUTE, None)
    if entry is None:
        return None
    source, version, packed = entry
    if weight.data_ptr() != source.data_ptr() or weight._version != version or weight.dtype != source.dtype:
        return None
    return packed


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` on `weight`'s packed copy, or None when there is none or
    the call does not qualify (module docstring)."""
    packed = _current_copy(weight)
    if (packed is None or x.dtype != weight.dtype or not x.is_cpu
            or (bias is not None and (bias.dtype != weight.dtype or not bias.is_cpu))):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
