"""Options of the `full` cache method (`--cache full:key=value,...`), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache.full.fp8 import FP8_DTYPES
from kvforge.errors import require

# float8 formats store a float32 scale per token and KV head beside the codes (fp8.py).
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, **FP8_DTYPES}
DECODE_KERNELS = ("auto", "triton", "torch", "gather")


@dataclass(frozen=True)
class FullCacheConfig:
    # None stores K/V in the model's compute dtype.
    storage_dtype: str | None = None
    block_size: int = 16
    # Stored tokens read per tile by batched decode attention (bounds temporaries).
    decode_tile_tokens: int = 1024
    # Batched decode attention (decode_kernels.py): "auto" uses the paged Triton kernel on
    # CUDA when triton is installed (16/32-bit pages), the compiled CPU kernel for CPU tensors
    # when it builds, else `gathered_decode_attention` (one gather + SDPA); "triton",
    # "torch" (the tiled PyTorch `decode_attention`) and "gather" force one. All compute the
    # same attention (cache/attention.py).
    decode_kernel: str = "auto"
    # The gathered decode path (decode_kernel=gather, or auto off the CPU) copies every
    # sequence's table padded to the batch's widest: a step whose K (or V) gather would exceed
    # this many bytes, or whose padding would more than double the rows, takes the tiled path.
    decode_gather_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        require(self.storage_dtype is None or self.storage_dtype in STORAGE_DTYPES, "storage_dtype",
                self.storage_dtype, f"must be one of {sorted(STORAGE_DTYPES)}")
        require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        require(self.decode_tile_tokens >= self.block_size, "decode_tile_tokens", self.decode_tile_tokens,
                "must be >= block_size")
        require(self.decode_gather_max_bytes >= 0, "decode_gather_max_bytes", self.decode_gather_max_bytes,
                "must be >= 0")
        require(self.decode_kernel in DECODE_KERNELS, "decode_kernel", self.decode_kernel,
                f"must be one of {list(DECODE_KERNELS)}")
