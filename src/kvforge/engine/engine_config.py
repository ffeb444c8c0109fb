"""Engine configuration: validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.errors import require
from kvforge.kernels.prepack_policy import PREPACK_POLICIES

ADMISSION_POLICIES = ("optimistic", "reserve")


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 1 << 30
    # Tokens computed per step, all requests together (prefill chunks + decode tokens).
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # "optimistic" (vLLM-style): a waiting request is admitted when its next chunk fits, and
    # running requests are preempted later if the cache runs out. "reserve": admitted only
    # when the cache's bytes for every running request's whole lifetime (prompt + max_tokens,
    # `cache.sequence_bytes`) plus its own fit the budget, so nothing is ever preempted.
    admission: str = "optimistic"
    # Time every step split into linear layers, attention, sampling and the rest
    # (`LLMEngine.step_timer`, kvforge.step_timing); costs little on CPU, syncs on CUDA.
    step_timing: bool = False
    # Reuse the K/V of earlier requests' token prefixes (engine/prefix_cache.py).
    prefix_caching: bool = True
    # On a CUDA device, decode-only steps replay CUDA graphs captured at start-up
    # (engine/decode_graphs.py); True runs every step eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Decode steps with a sequence longer than this run eagerly (vLLM's name).
    max_seq_len_to_capture: int = 8192
    # Decode steps of more sequences than this run eagerly (None: max_num_seqs; vLLM's name).
    max_cudagraph_capture_size: int | None = None
    # On a CPU, the linear weights' oneDNN-packed copy for prefill-sized products:
    # "auto" (when the copy fits a share of the free memory), "on" or "off" (kernels/cpu_prepack.py).
    prepack_weights: str = "auto"

    def __post_init__(self) -> None:
        require(self.kv_budget_bytes > 0, "kv_budget", self.kv_budget_bytes, "must be > 0 bytes")
        require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens,
                "must be >= 1")
        require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        require(self.admission in ADMISSION_POLICIES, "admission", self.admission,
                f"must be one of {list(ADMISSION_POLICIES)}")
        require(self.max_seq_len_to_capture >= 2, "max_seq_len_to_capture", self.max_seq_len_to_capture,
                "must be >= 2")
        require(self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 1,
                "max_cudagraph_capture_size", self.max_cudagraph_capture_size, "must be >= 1")
        require(self.prepack_weights in PREPACK_POLICIES, "prepack_weights", self.prepack_weights,
                f"must be one of {list(PREPACK_POLICIES)}")
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len,
                "must be >= 2")
