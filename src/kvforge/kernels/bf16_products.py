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
decode batch takes the packed copy, as it did before, and so the widened one.

A timing picks the form, and the two forms round differently, so on a CPU where they are
close a fresh measurement in every process would make the same greedy command print
different text from one run to the next (seen on this project's Xeon, whose attention ratio
sits at the margin). So the first verdict on a machine is remembered (`VERDICT_FILE` beside
the built kernels, keyed by the CPU, torch, the thread count, the margin and the attention
kernel's sources; a verdict with an unmeasured product, its kernel missing, is not kept)
and every later process takes it. A first timing taken on a busy machine sticks too, which
the start-up line's date and `measure` are for.

`KVFORGE_BF16_PRODUCTS` overrides it: `native` (bf16 products), `float32` (widened),
`measure` (measure again and remember that), `auto` or unset (the remembered verdict, else
measure and remember). The test suite pins `native` so that timing never decides what a
test computes.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvforge.errors import ConfigError

__all__ = ["ENV", "MODES", "WIDEN_MARGIN", "Bf16Products", "bf16_products", "measure_bf16_products"]

ENV = "KVFORGE_BF16_PRODUCTS"
MODES = ("auto", "native", "float32", "measure")
VERDICT_FILE = "kvforge_bf16_products.json"
WIDEN_MARGIN = 0.85  # widened only when it takes at most this share of the bf16 time
_REPEATS = 5
_UNMEASURED = "unmeasured"  # in the verdict's why for a product whose kernel is missing


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
    """This process's verdict (the environment's override, else the machine's remembered
    verdict, else measured once and remembered)."""
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
                key = _machine_key()
                _cached = None if mode == "measure" else _recall(key)
                if _cached is None:
                    _cached = measure_bf16_products()
                    if _UNMEASURED not in _cached.why:  # a missing kernel is no verdict to keep
                        _remember(key, _cached)
    return _cached


def verdict_path() -> Path:
    """The file holding this machine's verdicts (beside the built kernels)."""
    from kvforge.kernels.build import build_root

    return Path(build_root()) / VERDICT_FILE


def _machine_key() -> str:
    from kvforge.kernels.build import cpu_description

    here = Path(__file__).parent  # the timed attention kernel's source and its headers
    sources = [path.read_text() for path in (here / "cpu_causal_attention.cpp", here / "cpu_bf16_attention.h",
                                             here / "cpu_avx512_softmax.h") if path.is_file()]
    parts = [cpu_description(), torch.__version__, f"threads={torch.get_num_threads()}",
             f"margin={WIDEN_MARGIN}", *sources]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _recall(key: str) -> Bf16Products | None:
    """The verdict remembered under `key`, or None (none, or an unreadable file)."""
    try:
        entry = json.loads(verdict_path().read_text())[key]
        return Bf16Products(bool(entry["linear"]), bool(entry["attention"]),
                            f"{entry['why']}; remembered from {entry.get('when', 'an earlier run')} "
                            f"(${ENV}=measure measures again)")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _remember(key: str, verdict: Bf16Products) -> None:
    """Add the verdict to the file (best effort: an unwritable place only means the next
    process measures again). Written whole and renamed, so a reader never sees half a file."""
    path = verdict_path()
    try:
        try:
            entries = json.loads(path.read_text())
            entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            entries = {}
        entries[key] = {**asdict(verdict), "when": time.strftime("%Y-%m-%d %H:%M")}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)
    except OSError:
        pass


def _best_seconds(fn: Callable[[], object]) -> float:
    fn()  # first call: oneDNN picks and builds its kernel
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _linear_seconds() -> tuple[float, float] | None:
    # the engine's own path: a weight packed each way, multiplied through `packed_linear`; a
    # CPU on which oneDNN cannot pack bf16 (AVX2 only) runs the unpacked weight's F.linear
    from kvforge.kernels.cpu_prepack import packed_linear, prepack_weights
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1024, generator=generator).to(torch.bfloat16)
    native = (torch.randn(1024, 1024, generator=generator) / 32).to(torch.bfloat16)
    wide = native.clone()
    if prepack_weights([wide], "on", None, widen_bf16=True).widened != 1:
        return None
    packed = prepack_weights([native], "on", None).weights == 1
    bf16 = (lambda: packed_linear(x, native, None)) if packed else (lambda: torch.nn.functional.linear(x, native))
    return _best_seconds(bf16), _best_seconds(lambda: packed_linear(x, wide, None))


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
                notes.append(f"{name} {_UNMEASURED} (no kernel)")
                continue
            native, wide = seconds
            verdicts.append(wide <= WIDEN_MARGIN * native)
            notes.append(f"{name} bf16 / float32 time {native / wide:.2f}x")
    return Bf16Products(verdicts[0], verdicts[1], "measured on this CPU, " + ", ".join(notes))
