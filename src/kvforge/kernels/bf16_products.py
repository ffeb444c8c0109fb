"""Whether a bfloat16 model's prompt-sized products run faster in bf16 or widened to float32.

kvforge's bf16 arithmetic multiplies bf16 values and sums the products in float32. A product
of two bf16 values is exact in float32, so widening both operands to float32 first and
multiplying there computes the same products; for a linear layer only the order of the float32
sums may differ, and the result is rounded to bf16 once either way. (The widened attention
also keeps its softmax weights in float32 where the bf16 kernel rounds them, and GatedMLP's
widened chain skips the bf16 roundings between its products: both only more precise.)
Which form is faster depends on the CPU, and flags do not tell: with AMX tiles, or a core whose AVX-512 BF16 dot product runs at the
float32 FMA rate, bf16 wins; on a CPU whose bf16 dot product runs slower than its float32
FMAs (an Intel Xeon whose AMX the hypervisor hides, measured in docs/benchmarks.md), float32
wins. So `bf16_products()` measures it once per process, on the thread that first asks (an
engine asks at start-up, on the thread that will step it), for the two products a prefill
spends its time in:

- "linear": oneDNN's packed GEMM (`cpu_prepack`), a prompt-sized [256, 1024] x [1024, 1024];
  widened means the weights are packed as float32 and each call widens x and rounds y;
- "attention": kvforge's causal attention kernel (`cpu_causal_attention`) over 256 tokens;
  widened means q, k, v are widened and the float32 kernel's output is rounded to bf16
  (`prefill_attention`, which the caches call).

Each form's timing includes its conversions, and float32 is chosen only when it is at least
`WIDEN_MARGIN` faster, so a noisy measurement between two near-equal forms keeps bf16.
Decode steps of up to 32 sequences are untouched (cpu_linear.MAX_ROWS,
prefill_attention.WIDEN_MIN_QUERIES): they read the bf16 weights, half the bytes. A larger
decode batch takes the packed copy, as it did before, and so the widened one. Because a timing picks the form,
two processes on a CPU where the forms are close may round a result differently;
`KVFORGE_BF16_PRODUCTS` fixes the choice where that matters.

`KVFORGE_BF16_PRODUCTS` overrides the measurement: `native` (bf16 products), `float32`
(widened), `auto` or unset (measure). The test suite pins `native` so that timing never
decides what a test computes.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.errors import ConfigError

__all__ = ["ENV", "MODES", "WIDEN_MARGIN", "Bf16Products", "bf16_products", "measure_bf16_products"]

ENV = "KVFORGE_BF16_PRODUCTS"
MODES = ("auto", "native", "float32")
WIDEN_MARGIN = 0.85  # widened only when it takes at most this share of the bf16 time
_REPEATS = 5


@dataclass(frozen=True)
class Bf16Products:
    """Which prefill products of a bf16 model run widened to float32, and why."""

    linear: bool
    attention: bool
    why: str

    def describe(self) -> str:
        widened = [name for name, wide in (("linear layers", self.linear), ("attention", self.attention)) if wide]
        what = (f"prompt-sized {' and '.join(widened)} of bf16 models run in float32 (exact bf16 products)"
                if widened else "prompt-sized bf16 products run in bf16")
        return f"{what}: {self.why}"


_lock = threading.Lock()
_cached: Bf16Products | None = None


def bf16_products() -> Bf16Products:
    """This process's verdict (the environment's override, else measured once)."""
    global _cached
    mode = os.environ.get(ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(ENV, mode, f"must be one of {list(MODES)}")
    if mode == "native":
        return Bf16Products(False, False, f"${ENV}=native")
    if mode == "float32":
        return Bf16Products(True, True, f"${ENV}=float32")
    if _cached is None:  # checked again under the lock: two threads measure once
        with _lock:
            if _cached is None:
                _cached = measure_bf16_products()
    return _cached


def _best_seconds(fn: Callable[[], object]) -> float:
    fn()  # first call: oneDNN picks and builds its kernel
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _linear_seconds() -> tuple[float, float] | None:
    # the engine's own path: a weight packed each way, multiplied through `packed_linear`
    from kvforge.kernels.cpu_prepack import packed_linear, prepack_weights
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=generator).to(torch.bfloat16)
    native = (torch.randn(1024, 1024, generator=generator) / 32).to(torch.bfloat16)
    wide = native.clone()
    if (prepack_weights([native], "on", None).weights != 1
            or prepack_weights([wide], "on", None, widen_bf16=True).widened != 1):
        return None
    return _best_seconds(lambda: packed_linear(x, native, None)), _best_seconds(lambda: packed_linear(x, wide, None))


def _attention_seconds() -> tuple[float, float] | None:
    from kvforge.kernels.cpu_causal_attention import causal_attention_available
    if not (causal_attention_available(torch.bfloat16) and causal_attention_available(torch.float32)):
        return None
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(256, 8, 64, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(2, 256, 64, generator=generator).to(torch.bfloat16) for _ in range(2))
    run = torch.ops.kvforge_cpu_causal.causal_attention
    return (_best_seconds(lambda: run(q, k, v, 0.125)),
            _best_seconds(lambda: run(q.float(), k.float(), v.float(), 0.125)[0].to(torch.bfloat16)))


def measure_bf16_products() -> Bf16Products:
    """Time each product in both forms on this thread (tens of milliseconds) and decide."""
    verdicts, notes = [], []
    with torch.no_grad():
        for name, seconds in (("linear", _linear_seconds()), ("attention", _attention_seconds())):
            if seconds is None:
                verdicts.append(False)
                notes.append(f"{name} unmeasured (no kernel)")
                continue
            native, wide = seconds
            verdicts.append(wide <= WIDEN_MARGIN * native)
            notes.append(f"{name} bf16 / float32 time {native / wide:.2f}x")
    return Bf16Products(verdicts[0], verdicts[1], "measured on this CPU, " + ", ".join(notes))
