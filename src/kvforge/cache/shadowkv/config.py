"""Configuration of the `shadowkv` cache method (`--cache shadowkv --cache-opt k=v`).

Defaults follow the paper's setting for Llama-3-8B (chunks of 8 tokens, 48 outlier chunks)
except two, each read from the model instead (the paper's values stay as `rank=paper` and
`budget=paper`):
- rank: the paper fixes it at about 1/6 of kv_heads x head_dim (160 of 1024), far too few
  directions for a model with one 256-wide KV head (gemma3-270m's decode perplexity at 8K
  rises far above the full cache's; docs/benchmarks.md#measurements-behind-design-choices)
  and more than smollm2-135m needs. `rank=attention` (default) measures, per layer
  and sequence at compression, how much rank-r keys change the attention output of the
  prompt's last queries (attention_rank.py) and keeps a rank whose change is at most
  `attention_error`; `rank=auto` reads only the pre-RoPE key spectrum: the smallest rank
  whose retained share of the key energy reaches `energy`. Both stay within
  [rank_min, kv width]. Key energy alone cannot tell the two models apart (smollm2 needs
  most of its directions for nearly all of its energy yet barely uses them; gemma3 needs
  its tail; docs/cache-methods.md#quality-settings), the attention change can;
- sparse budget: the paper's 1.56% of the context (at least 128 tokens) per KV head;
  `budget=auto` also gives every layer at least `layer_budget` selected tokens over its
  KV heads (a one-KV-head model selects for all its query heads from one budget).
Sequences shorter than `min_context` tokens are never compressed (exact attention, like
`full`).
Compression happens at the end of the step that completes a prompt (see shadowkv.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvforge.cache.shadowkv.attention_rank import AttentionProbe, QuerySample, attention_rank
from kvforge.cache.shadowkv.compress import LayerKeys
from kvforge.cache.shadowkv.lowrank import rank_for_energy
from kvforge.errors import require
from kvforge.sizes import parse_bytes

SLOW_STORES = ("memory", "mmap", "pinned")
RANK_RULES = ("auto", "attention", "paper")
BUDGET_RULES = ("auto", "paper")
COEFFICIENT_DTYPES = ("float16", "compute")
LAYER_BUDGET_DEFAULT = 512
ENERGY_DEFAULT = 0.999
ATTENTION_ERROR_DEFAULT = 0.1
RANK_STEP = 8  # rank=attention tries ranks in steps of this many directions


@dataclass(frozen=True)
class ShadowKVConfig:
    # Rank r of the pre-RoPE keys over all KV heads: an integer (every layer), "paper"
    # (round(kv_heads x head_dim / 6), the paper's ratio), "attention" (per layer and
    # sequence from the attention change, see `attention_error`) or "auto" (per layer and
    # sequence from the key spectrum, see `energy`).
    rank: int | str = "attention"
    # rank=auto (and rank=attention for a layer no query reached): share of the pre-RoPE
    # keys' squared Frobenius norm the kept directions must retain (1.0: full rank, exact
    # keys); chosen by measurement (docs/results/eval).
    energy: float = ENERGY_DEFAULT
    # rank=attention: the largest relative change of the prompt's last queries' attention
    # output that low-rank keys may cause (attention_rank.py); chosen by measurement.
    attention_error: float = ATTENTION_ERROR_DEFAULT
    rank_min: int = 16  # rank=auto|attention: never fewer directions than this (capped at the KV width)
    # Storage of the low-rank key coefficients: "float16" (half the fast-tier bytes of the
    # compute dtype float32; rebuilt keys are computed in the compute dtype) or "compute"
    # (the compute dtype: bit-exact rebuilds, for exactness tests and studies).
    coefficient_dtype: str = "float16"
    chunk: int = 8  # tokens per landmark chunk
    outliers: int = 48  # chunks per KV head and layer kept exact on the fast tier
    # Sparse budget per KV head in tokens: an integer (a multiple of `chunk`), "paper"
    # (max(budget_floor, budget_fraction x the sequence length at compression), the paper's
    # 1.56%) or "auto": the paper's rule, but never fewer than `layer_budget` tokens per
    # layer over its KV heads (layer_budget / kv_heads per head), so a model with few KV
    # heads (gemma3: one) still attends enough of its context; rounded up to whole chunks.
    budget: int | str = "auto"
    budget_fraction: float = 0.0156
    budget_floor: int = 128
    layer_budget: int = LAYER_BUDGET_DEFAULT
    local: int = 32  # most recent tokens kept exact at compression (a multiple of `chunk`)
    # Exact window for tokens written after compression: when the exact tail (local +
    # generated) exceeds local + generated_window, just enough of its oldest whole chunks
    # are folded into the low-rank store (ShadowKV+) to bring it back under that bound, so
    # generation length is not capped and the most recent tokens always stay exact.
    generated_window: int = 256
    # A sequence is compressed at the end of the first step that leaves it with at least
    # this many tokens and asks logits for its last token (a prompt's last chunk, a decode
    # token); shorter sequences stay exact.
    min_context: int = 2048
    reuse: bool = True  # keep the previous step's selected chunks (temporal locality)
    block_size: int = 16  # page size of the exact (not yet compressed) storage
    # Slow tier for the values of compressed chunks: "memory" (a pageable tensor in RAM; on
    # CUDA only a staging buffer of each fetch is pinned, and each global layer of a decode
    # step waits once for the host to learn which pages to gather), "mmap" (a temporary
    # file, so a context can exceed RAM) or "pinned" (RAM page-locked for the whole slow
    # budget at start-up; on CUDA the Triton decode kernels read the missed values from it
    # in place, so a decode step never waits for the host; on a CPU it is "memory").
    slow_store: str = "memory"
    slow_budget: str | None = None  # bytes of the slow tier, e.g. 16GiB; None: the kv budget
    slow_dir: str | None = None  # directory of the mmap file (None: the system temp dir)
    # CPU threads of ShadowKV's own PyTorch phases (compression, folding, the PyTorch decode
    # path: many small operations, see threads.py); 0: torch's current setting.
    # The fused decode kernel always splits its (sequence, KV head) pairs over torch's threads.
    threads: int = 1
    # Decode steps through the fused C++ CPU kernel (cpu_decode.py) when it applies
    # (float32 on CPU) and builds, and through the Triton kernels (triton_decode.py) on CUDA
    # when triton is installed; False: always the PyTorch path (the reference).
    kernel: bool = True
    # How kv_budget is split between the exact, sliding and chunk stores and the per-sequence
    # state (split.py): in the proportions of one sequence of this many tokens; None: half for
    # the longest sequence that half holds alone (at most the longest the engine allows), the
    # rest for compressed sequences (min_context proportions between exact and compressed
    # state, chunk pages sized per token).
    # Longer values give the exact store more (longer prompts), fewer compressed sequences fit.
    split_context: int | None = None
    # The fraction of kv_budget for the exact store (prompts until they compress), the rest
    # for what decoding sequences hold (sliding windows, chunk pages, per-sequence state);
    # None: as split_context says (split.py).
    exact_share: float | None = None

    def __post_init__(self) -> None:
        require(self.chunk >= 1, "chunk", self.chunk, "must be >= 1")
        require(self.rank in RANK_RULES or (type(self.rank) is int and self.rank >= 1), "rank", self.rank,
                f"must be an integer >= 1 or one of {list(RANK_RULES)}")
        require(0 < self.energy <= 1, "energy", self.energy, "must be in (0, 1]")
        require(0 < self.attention_error < 1, "attention_error", self.attention_error, "must be in (0, 1)")
        require(self.rank_min >= 1, "rank_min", self.rank_min, "must be >= 1")
        require(self.coefficient_dtype in COEFFICIENT_DTYPES, "coefficient_dtype", self.coefficient_dtype,
                f"must be one of {list(COEFFICIENT_DTYPES)}")
        require(self.outliers >= 0, "outliers", self.outliers, "must be >= 0")
        fixed_budget = type(self.budget) is int
        require(self.budget in BUDGET_RULES or fixed_budget, "budget", self.budget,
                f"must be a token count or one of {list(BUDGET_RULES)}")
        require(not fixed_budget or self.budget >= self.chunk, "budget", self.budget,
                f"must be at least one chunk (chunk={self.chunk})")
        require(not fixed_budget or self.budget % self.chunk == 0, "budget", self.budget,
                f"must be a multiple of chunk={self.chunk}")
        require(self.layer_budget >= 0, "layer_budget", self.layer_budget, "must be >= 0")
        require(0 < self.budget_fraction <= 1, "budget_fraction", self.budget_fraction, "must be in (0, 1]")
        require(self.budget_floor >= self.chunk, "budget_floor", self.budget_floor,
                f"must be at least one chunk (chunk={self.chunk})")
        require(self.local >= 0 and self.local % self.chunk == 0, "local", self.local,
                f"must be a multiple of chunk={self.chunk} (>= 0)")
        require(self.generated_window >= self.chunk, "generated_window", self.generated_window,
                f"must be >= chunk={self.chunk} (at least one chunk is folded at a time)")
        require(self.min_context >= self.local + self.chunk, "min_context", self.min_context,
                f"must be >= local + chunk = {self.local + self.chunk} (something to compress)")
        require(self.threads >= 0, "threads", self.threads, "must be >= 0 (0: torch's setting)")
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.exact_share is None or 0 < self.exact_share < 1, "exact_share", self.exact_share,
                "must be None or in (0, 1)")
        require(self.split_context is None or self.split_context >= self.min_context, "split_context",
                self.split_context, f"must be None or >= min_context={self.min_context} (a compressed sequence)")
        require(self.slow_store in SLOW_STORES, "slow_store", self.slow_store, f"must be one of {list(SLOW_STORES)}")
        if self.slow_budget is not None:
            parse_bytes(self.slow_budget, "slow_budget")  # raises ConfigError naming slow_budget
        require(self.slow_dir is None or self.slow_store == "mmap", "slow_dir", self.slow_dir,
                "only applies with slow_store=mmap")

    def rank_bounds(self, kv_width: int) -> tuple[int, int]:
        """(least, most) rank of any layer for keys of width kv_heads x head_dim: equal
        unless rank=auto|attention, which only learn a layer's rank at compression."""
        if self.rank in ("auto", "attention"):
            return min(self.rank_min, kv_width), kv_width
        rank = max(1, round(kv_width / 6)) if self.rank == "paper" else int(self.rank)
        require(rank <= kv_width, "rank", rank, f"must be <= kv_heads x head_dim = {kv_width}")
        return rank, rank

    def layer_rank(self, cumulative_energy: torch.Tensor) -> int:
        """The rank of one layer of one sequence from its keys' cumulative energy [W]
        (share of the squared norm the top 1..W directions retain)."""
        width = cumulative_energy.numel()
        least, most = self.rank_bounds(width)
        if least == most or self.energy >= 1.0:
            return most
        return max(least, rank_for_energy(cumulative_energy, self.energy))

    def choose_rank(self, layer: LayerKeys, sample: QuerySample | None, scale: float) -> int:
        """The rank of one layer of one sequence at compression. rank=attention reads the
        query sample; without one (no attention call of the compressing step reached this
        layer) it falls back to the energy rule."""
        if self.rank != "attention" or sample is None:
            return self.layer_rank(layer.spectrum.energy)
        least, most = self.rank_bounds(layer.keys_pre.shape[1])
        probe = AttentionProbe(layer.keys_pre, layer.spectrum.directions, layer.keys_post, layer.values,
                               layer.exact, sample, layer.rope, scale)
        return attention_rank(probe, self.attention_error, least, RANK_STEP)

    def rank_rule(self, sample: QuerySample | None, scale: float) -> Callable[[LayerKeys], int]:
        """`choose_rank` for one layer of one sequence, as compress_layer takes it."""
        return lambda keys: self.choose_rank(keys, sample, scale)

    def budget_tokens(self, num_tokens: int, kv_heads: int) -> int:
        """Sparse budget per KV head (tokens, whole chunks) of a sequence compressed at
        `num_tokens` in a model with `kv_heads` KV heads per layer."""
        if type(self.budget) is int:
            return self.budget
        wanted = max(self.budget_floor, math.ceil(self.budget_fraction * num_tokens))
        if self.budget == "auto":
            wanted = max(wanted, math.ceil(self.layer_budget / kv_heads))
        return math.ceil(wanted / self.chunk) * self.chunk

    def coefficient_storage(self, compute_dtype: torch.dtype) -> torch.dtype:
        return torch.float16 if self.coefficient_dtype == "float16" else compute_dtype

    def slow_bytes(self, kv_budget: int) -> int:
        return parse_bytes(self.slow_budget, "slow_budget") if self.slow_budget is not None else kv_budget

    @property
    def window_capacity(self) -> int:
        """Exact tail tokens a compressed sequence holds at most after a step."""
        return self.local + self.generated_window
