"""The vocabulary projection in float32: `x @ W.T + b` with the sums kept unrounded.

A bf16 model's logits rounded to bf16 are 0.125 apart near |y| = 25 (8 significant bits), so
two candidates the model ranks 0.05 apart often round to one value, and greedy argmax then
takes the lower token id: which token wins a near tie becomes an accident of rounding, and a
bf16 engine's greedy text drifts from the model's (measured on smollm2-135m's chat answer in
docs/benchmarks.md). Every form below multiplies the model's own bf16 values exactly in
float32 and never rounds the result:

- CPU, at most `MAX_ROWS` rows (decode, a prompt's last token): the small-M kernel's float
  output (`small_m_linear_float_out`), the same reads and arithmetic as `linear` without the
  final rounding (on a CPU with AMX: the AVX512-BF16 path, as the tile path writes bf16
  only), so it is M-invariant as `linear` is and costs nothing more;
- CUDA: cuBLAS's float32 output from 2-byte inputs (`torch.mm(..., out_dtype=float32)`);
- elsewhere (more rows on a CPU, no kernel, autograd): the product of the widened operands,
  the weight widened `_WIDEN_ROWS` vocabulary rows at a time so a large vocabulary never
  needs a float32 copy of the whole matrix. Widening the weight at every call makes this
  the slow form for a decode step (where the kernels are off or did not build).

float32 and float64 weights are multiplied as they are (`linear`): their logits already are.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kvforge.kernels.cpu_linear import linear, small_m_eligible
from kvforge.step_timing import current_timer

__all__ = ["vocab_logits"]

_WIDEN_ROWS = 8192  # vocabulary rows widened at a time off the kernels (32 MiB at K = 1024)
_cuda_float_out: bool | None = None  # whether this torch's CUDA mm takes out_dtype (tried once)


def vocab_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` in float32 (at least) and unrounded; counted as "linear"
    by a recording step timer, as `linear` is."""
    if weight.dtype in (torch.float32, torch.float64):
        return linear(x, weight, bias)
    timer = current_timer()
    if timer is not None:
        return timer.measure("linear", _float_logits, x, weight, bias)
    return _float_logits(x, weight, bias)


def _float_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                              or (bias is not None and bias.requires_grad))
    rows = x.reshape(-1, x.shape[-1])
    if small_m_eligible(x, weight, bias):
        rows = rows if rows.is_contiguous() else rows.contiguous()
        bias = bias if bias is None or bias.is_contiguous() else bias.contiguous()
        out = torch.ops.kvforge_cpu_linear.small_m_linear_float_out(rows, weight, bias)
    elif x.is_cuda and not needs_grad and x.dtype == weight.dtype:
        out = _cuda_float_product(rows, weight)
        if bias is not None:
            out = out + bias.float()
    elif needs_grad:
        out = F.linear(rows.float(), weight.float(), None if bias is None else bias.float())
    else:
        wide = rows.float()
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, weight.shape[0], _WIDEN_ROWS):
            stop = min(start + _WIDEN_ROWS, weight.shape[0])
            part = None if bias is None else bias[start:stop].float()
            out[:, start:stop] = F.linear(wide, weight[start:stop].float(), part)
    return out.view(*x.shape[:-1], weight.shape[0])


def _cuda_float_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """rows @ weight.T in float32 from cuBLAS; a torch without `mm(..., out_dtype)` on CUDA
    (found at the first call, which is eager: a captured step is warmed up first) rounds to
    the weight's dtype and widens, as the engine did before, and says so once."""
    global _cuda_float_out
    if _cuda_float_out is not False:
        try:
            out = torch.mm(rows, weight.t(), out_dtype=torch.float32)
            _cuda_float_out = True
            return out
        except (RuntimeError, TypeError, NotImplementedError) as error:
            # no such overload (TypeError), no CUDA kernel for it (NotImplementedError), or a
            # kernel refusing these dtypes; anything else (out of memory) is no verdict on torch
            unsupported = (isinstance(error, (TypeError, NotImplementedError))
                           or ("dtype" in str(error) and not isinstance(error, torch.cuda.OutOfMemoryError)))
            if _cuda_float_out or not unsupported:
                raise
            _cuda_float_out = False
            logging.getLogger(__name__).warning(
                "this torch's CUDA mm has no float32 output for %s inputs (%s): logits are rounded to %s",
                weight.dtype, str(error).splitlines()[0][:120], weight.dtype)
    return F.linear(rows, weight).float()
