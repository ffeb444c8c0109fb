"""FP8 storage of the `full` cache (`full:storage_dtype=float8_e4m3fn|float8_e5m2`): each
stored key and value row (one token of one KV head, head_dim elements) is scaled by its
own largest magnitude, as SwiftKV's FP8 KV (per-token quantisation, Sec. 5.3 / B.1):

    scale = max(|x|) / FORMAT_MAX   (float32, one per token and KV head)
    code  = float8(x / scale)       (round to nearest by torch's cast)
    x^    = float32(code) x scale

so every row uses the format's whole range. A row of zeros keeps scale TINY (codes 0).
`dequantize` is the definition every reader of FP8 pages uses.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
TINY = torch.finfo(torch.float32).tiny


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES.values()


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D] in the FP8 `dtype`, scales [...] float32)."""
    wide = x.float()
    scale = (wide.abs().amax(dim=-1) / torch.finfo(dtype).max).clamp_min(TINY)
    return (wide / scale[..., None]).to(dtype), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., D] and their scales [...] -> float32 [..., D]."""
    return codes.float() * scales[..., None]
