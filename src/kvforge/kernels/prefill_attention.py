"""The causal prefill attention the caches call on the CPU: kvforge's kernel
(`cpu_causal_attention`), except that a bf16 call of more than WIDEN_MIN_QUERIES queries runs
the float32 kernel on exactly widened q, k, v, rounding the output to bf16 once, where
`bf16_products` measured that form faster on this CPU. The score products are the same (a
bf16 product is exact in float32); the softmax weights stay float32 where the bf16 kernel
rounds them to bf16, which is only more precise. A few queries over a long history (a decode
step, a short chunk) keep the bf16 kernel: widening the whole K/V would cost them more than it
gains.

Apart from the kernel's module so that `bf16_products`, which times the kernel, never imports
a module that imports it. Returns what `cpu_causal_attention.causal_attention` returns: (out,
lse) or None when the call is not eligible.
"""

from __future__ import annotations

import torch

from kvforge.kernels import cpu_causal_attention as kernel
from kvforge.kernels.bf16_products import bf16_products

__all__ = ["WIDEN_MIN_QUERIES", "causal_attention"]

WIDEN_MIN_QUERIES = 32  # as cpu_linear.MAX_ROWS: above it a call is prompt-sized


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`cpu_causal_attention.causal_attention(q, k, v, scale)`, widened where the module
    docstring says."""
    if (q.dtype == torch.bfloat16 and k.dtype == v.dtype == torch.bfloat16 and q.dim() == 3
            and q.shape[0] > WIDEN_MIN_QUERIES and kernel.causal_attention_available(torch.float32)
            and bf16_products().attention):
        widened = kernel.causal_attention(q.float(), k.float(), v.float(), scale)
        if widened is not None:
            return widened[0].to(q.dtype), widened[1]
    return kernel.causal_attention(q, k, v, scale)
