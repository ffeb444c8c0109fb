"""The rows of the correctness check: which cache spec runs at which size, and the tolerance
each is held to.

A row compares one cache spec on the device with the same spec on the CPU reference, both
with float32 model weights, on the same prompts and the same chunking. What may differ is
rounding (device BLAS, kernels, reduction order), and what that rounding can do depends on
the method, hence one tolerance per precision class and size:

- `fp32`: float32 storage, exact attention (full, ShadowKV at full rank with a covering
  budget). Tiny: 1e-4 (the test suite's bound for exact paths). Real: 2e-3, the bound
  `verify` holds kvforge to against transformers on the same model (30 layers of fp32
  rounding on logits of magnitude ~20).
- `fp16` / `bf16`: K/V stored in 16 bits. A rounding difference before the cast can move a
  stored value by one 16-bit ulp (2^-11 / 2^-8 relative).
- `lossy`: KIVI's quantisation (a value on a bin edge can land in the next bin, one
  scale step away) and ShadowKV's sparse selection (a near-tied chunk score can pick another
  chunk). The same algorithm runs on both sides; these bounds catch a broken kernel, not
  the method's own error, which the method's tests measure against `full`.

A position where the argmax differs, or where greedy tokens first diverge, is excused only
when the reference's top-two logit margin there is at most `2 x tolerance` (a near-tie that
rounding within the tolerance can flip).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.errors import require

SIZES = ("tiny", "real")
MODEL_KINDS = ("base", "swiftkv")

# precision class -> size -> max |logit diff| allowed between device and reference
TOLERANCES: dict[str, dict[str, float]] = {
    "fp32": {"tiny": 1e-4, "real": 2e-3},
    "fp16": {"tiny": 5e-3, "real": 5e-2},
    "bf16": {"tiny": 1e-2, "real": 2e-1},
    "lossy": {"tiny": 1e-2, "real": 2e-1},
}


@dataclass(frozen=True)
class Workload:
    """The prompts and steps of one size: prompt lengths (run as one batch), greedy tokens
    generated per prompt, prefill chunk, and logit rows scored at the end of each chunk."""

    prompt_lengths: tuple[int, ...]
    gen: int
    chunk: int
    scored: int

    def __post_init__(self) -> None:
        require(len(self.prompt_lengths) >= 1 and min(self.prompt_lengths) >= 1, "prompt_lengths",
                self.prompt_lengths, "must be one or more lengths >= 1")
        require(self.gen >= 1, "gen", self.gen, "must be >= 1")
        require(self.chunk >= 1, "chunk", self.chunk, "must be >= 1")
        require(1 <= self.scored <= self.chunk, "scored", self.scored, f"must be in [1, chunk={self.chunk}]")

    @property
    def longest(self) -> int:
        return max(self.prompt_lengths) + self.gen


# Tiny: every method's stored form is reached (KIVI quantises past 8 tokens, ShadowKV
# compresses at 24 and folds after 8 generated). Real: the longer prompt passes ShadowKV's
# default min_context (2048), the shorter one stays exact under the defaults.
WORKLOADS = {
    "tiny": Workload(prompt_lengths=(40, 27), gen=8, chunk=16, scored=4),
    "real": Workload(prompt_lengths=(2112, 700), gen=16, chunk=512, scored=8),
}


@dataclass(frozen=True)
class RowSpec:
    size: str
    model_kind: str
    method: str  # the row's label, e.g. "kivi-2"
    cache: str  # cache spec, as --cache takes it
    precision: str  # key of TOLERANCES

    def __post_init__(self) -> None:
        require(self.size in SIZES, "size", self.size, f"must be one of {list(SIZES)}")
        require(self.model_kind in MODEL_KINDS, "model_kind", self.model_kind, f"must be one of {list(MODEL_KINDS)}")
        require(self.precision in TOLERANCES, "precision", self.precision, f"must be one of {sorted(TOLERANCES)}")

    @property
    def tolerance(self) -> float:
        return TOLERANCES[self.precision][self.size]

    @property
    def name(self) -> str:
        return f"{self.size}/{self.model_kind}/{self.method}"


def full_spec(size: str) -> str:
    """The float32 full cache at `size`: the first row, and the baseline that a lossy row's
    error is measured against (compare.py)."""
    return "full:block_size=4" if size == "tiny" else "full"


def method_specs(size: str, kv_width: int) -> list[tuple[str, str, str]]:
    """(label, cache spec, precision) of every method at `size`; `kv_width` = kv_heads x
    head_dim of the model (ShadowKV's full rank)."""
    work = WORKLOADS[size]
    covering = math.ceil(work.longest / 8) * 8  # every chunk of 8 tokens selected
    full = full_spec(size)
    if size == "tiny":
        kivi = ",group=4,residual=8"
        shadow = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8"
        # fp32 coefficients: full rank then reproduces the keys exactly (the default stores 16 bits)
        exact = f"{shadow},rank={kv_width},budget={math.ceil(work.longest / 4) * 4},coefficient_dtype=compute"
        # The defaults' proportions at a size where compression and folding happen.
        lossy = ("shadowkv (defaults scaled)", f"{shadow},rank={max(1, round(kv_width / 6))},budget=8")
    else:
        kivi = ""
        exact = (f"shadowkv:rank={kv_width},budget={covering},min_context=512,generated_window=16,outliers=8,"
                 "coefficient_dtype=compute")
        lossy = ("shadowkv (defaults)", "shadowkv")
    sep = "," if ":" in full else ":"
    return [
        ("full", full, "fp32"),
        ("full fp16", f"{full}{sep}storage_dtype=float16", "fp16"),
        ("full bf16", f"{full}{sep}storage_dtype=bfloat16", "bf16"),
        ("kivi-2", f"kivi:bits=2{kivi}", "lossy"),
        ("kivi-4", f"kivi:bits=4{kivi}", "lossy"),
        ("shadowkv (exact)", exact, "fp32"),
        (lossy[0], lossy[1], "lossy"),
    ]


def row_specs(size: str, kv_width: int) -> list[RowSpec]:
    """Every method x model kind at `size`."""
    return [RowSpec(size, kind, label, spec, precision)
            for kind in MODEL_KINDS for label, spec, precision in method_specs(size, kv_width)]
