"""The compute dtype `--dtype auto` (the default of `generate`, `chat`, `serve` and `LLM`) picks.

On a CPU with bfloat16 arithmetic in hardware (AMX-BF16 or AVX-512 BF16) it is bfloat16: the
weights and the KV cache take half the bytes, and kvforge's kernels multiply bf16 in hardware
while they accumulate in float32. Where that hardware multiplies bf16 more slowly than float32
(kernels/bf16_products.py measures it), a prefill's large products run on exactly widened
operands instead, so bfloat16 comes close to float32's prefill speed while a decode step of up
to 32 sequences still reads half the bytes. Elsewhere, and on other devices, it is float32 (a GPU user
names the dtype). bfloat16 stays float32-equal enough on the shipped models: greedy argmax
agrees with float32 at (tie-aware) >= 98% of the positions of a held-out passage
(tests/models/test_auto_dtype.py, the check `kvforge verify` reports). `--dtype float32` is one
flag away, and the start-up line says which was picked and why.

`KVFORGE_AUTO_DTYPE` overrides what `auto` resolves to (the test suite pins it to float32 so that
its exactness tests do not depend on the CPU they run on).
"""

from __future__ import annotations

import os

import torch

AUTO = "auto"
ENV_OVERRIDE = "KVFORGE_AUTO_DTYPE"
# /proc/cpuinfo flag -> what it is called in the start-up line; the first found wins
BF16_CPU_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX-512 BF16"))


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def bf16_cpu_feature(flags: set[str] | None = None) -> str | None:
    """The name of this CPU's bfloat16 hardware (None without it)."""
    flags = cpu_flags() if flags is None else flags
    return next((name for flag, name in BF16_CPU_FLAGS if flag in flags), None)


def resolve_dtype(name: str | torch.dtype | None, device: str | torch.device = "cpu",
                  flags: set[str] | None = None) -> tuple[str | torch.dtype, str | None]:
    """(the dtype to load, why it was picked) for `name`; `auto`/None are resolved here, any
    other name is returned as given (parse_dtype validates it) with no reason."""
    if name is not None and (isinstance(name, torch.dtype) or str(name).strip().lower() != AUTO):
        return name, None
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        return override, f"--dtype auto: {override} (${ENV_OVERRIDE})"
    if torch.device(device).type != "cpu":
        return "float32", "--dtype auto: float32 (name a dtype for this device, e.g. --dtype bfloat16)"
    feature = bf16_cpu_feature(flags)
    if feature is None:
        return "float32", "--dtype auto: float32 (this CPU has no bfloat16 arithmetic)"
    return "bfloat16", f"--dtype auto: bfloat16 (this CPU has {feature}; --dtype float32 for full precision)"
