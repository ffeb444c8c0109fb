"""Building blocks shared by the decoders. Module and parameter names mirror Hugging Face
checkpoints (q_proj, k_proj, ..., gate_proj, input_layernorm) so weights load by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.kernels import cuda_fused
from kvforge.kernels.cpu_fused import rms_norm, silu_mul
from kvforge.kernels.cpu_linear import linear, linear_float32, linear_from, widened_input
from kvforge.models.packed_projections import PackedLinear, pack_linears, still_packed
from kvforge.rope import PositionedRope


def hooks_would_run(module: nn.Module) -> bool:
    """Calling `module` would run a hook (its own or a global one, forward or backward): a
    fused op that computes its output without calling it must then call it instead."""
    own = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks)
    glob = torch.nn.modules.module
    return any(own) or any((glob._global_forward_hooks, glob._global_forward_pre_hooks,
                            glob._global_backward_hooks, glob._global_backward_pre_hooks))


class ResidualAddNorm(nn.Module):
    """The RMSNorms of the decoders (`RMSNorm`, `GemmaRMSNorm`: `gemma` picks the weight's
    form, `_reference` is the PyTorch expression), and a decoder layer's residual adds with
    the norms beside them (vLLM fuses the same pairs).

    Each is one fused op where it applies: the norm alone in C++ on CPU (no autograd,
    kernels/cpu_fused.py) or one Triton launch on CUDA (kernels/cuda_fused.py), the residual
    forms one Triton launch on CUDA; elsewhere the ops apart, which stay the reference. Both
    give the same sums (rounded to the dtype once) and, within the fused norm's tolerance,
    the same norms."""

    gemma: bool
    initial_weight: float

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), self.initial_weight, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = rms_norm(x, self.weight, self.eps, gemma=self.gemma)
        if fused is None:
            fused = cuda_fused.rms_norm(x, self.weight, self.eps, gemma=self.gemma)
        return fused if fused is not None else self._reference(x)

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_and_norm(self, x: torch.Tensor, delta: torch.Tensor,
                     delta_norm: ResidualAddNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + d, this norm of it), d = delta or `delta_norm(delta)` (Gemma's sandwich: the
        post-attention norm, the add, the pre-feedforward norm). A norm a hook would see is
        called, apart."""
        fused = None
        hooked = hooks_would_run(self) or (delta_norm is not None and hooks_would_run(delta_norm))
        if not hooked and delta_norm is None:
            fused = cuda_fused.add_rms_norm(x, delta, self.weight, self.eps, self.gemma)
        elif not hooked and delta_norm.gemma == self.gemma:
            fused = cuda_fused.add_rms_norm(x, delta, self.weight, self.eps, self.gemma, delta_norm.weight,
                                            delta_norm.eps)
        if fused is not None:
            return fused
        total = x + (delta if delta_norm is None else delta_norm(delta))
        return total, self(total)

    def add_norm_of(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x + this norm of delta (Gemma's post-feedforward norm and the residual add)."""
        fused = None if hooks_would_run(self) else cuda_fused.add_norm_of(x, delta, self.weight, self.eps, self.gemma)
        return fused if fused is not None else x + self(delta)


class RMSNorm(ResidualAddNorm):
    """Llama-style RMSNorm: normalise in float32, scale by w in the input dtype."""

    gemma = False
    initial_weight = 1.0

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class GemmaRMSNorm(ResidualAddNorm):
    """Gemma RMSNorm: scale by (1 + w), all in float32, then back to the input dtype."""

    gemma = True
    initial_weight = 0.0

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": _gelu_tanh}
# the activation and the gate's product in one Triton launch on CUDA (kernels/cuda_fused.py)
_CUDA_GATES = {F.silu: cuda_fused.silu_mul, _gelu_tanh: cuda_fused.gelu_tanh_mul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)).

    The projections stay nn.Linear modules (HF parameter names) but are applied through
    `kvforge.kernels.cpu_linear.linear`: the small-M CPU kernel for decode-sized fp32
    steps, F.linear otherwise."""

    def __init__(self, hidden: int, intermediate: int, activation: str, bias: bool,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, dtype=dtype, device=device)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, dtype=dtype, device=device)
        self.activation = _ACTIVATIONS[activation]
        self.packed_gate_up: PackedLinear | None = None  # see pack()

    def pack(self) -> int:
        """gate and up as one GEMM from now on (models/packed_projections.py); 1 if it packed."""
        if still_packed(self.packed_gate_up) is not None:
            return 0
        self.packed_gate_up = pack_linears((self.gate_proj, self.up_proj))
        return int(self.packed_gate_up is not None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> GatedMLP:
        out = super()._apply(fn, recurse)
        self.packed_gate_up = still_packed(self.packed_gate_up)  # a move or cast: dropped, the old storage freed
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._added(None, x)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x). On CUDA the down projection adds itself into `residual` in
        place (`cuda_fused.linear_into`: one GEMM where the add is another launch), so
        `residual` must be the caller's own intermediate, read by nobody after; elsewhere,
        or where a hook would see the module's call, the add runs apart, out of place."""
        return residual + self(x) if hooks_would_run(self) else self._added(residual, x)

    def _added(self, residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        wide = self._float32_prefill(x)
        if wide is not None:
            return wide if residual is None else residual + wide
        gated = self._gated(x)
        if residual is not None:
            fused = cuda_fused.linear_into(residual, gated, self.down_proj.weight, self.down_proj.bias)
            if fused is not None:
                return fused
        out = linear(gated, self.down_proj.weight, self.down_proj.bias)
        return out if residual is None else residual + out

    def _gated(self, x: torch.Tensor) -> torch.Tensor:
        """act(gate(x)) * up(x)."""
        packed = self.packed_gate_up
        if packed is not None and packed.usable():
            # one GEMM; gate and up are its two halves, read in place by the fused SiLU-gate
            gate, up = packed.split(linear(x, packed.weight, packed.bias))
        else:
            gate = linear(x, self.gate_proj.weight, self.gate_proj.bias)
            up = linear(x, self.up_proj.weight, self.up_proj.bias)
        # SiLU through the fused CPU op when it applies: the fused decode layer calls the
        # same op, so the two paths stay bitwise equal; on CUDA one Triton launch (SiLU or GELU)
        gated = silu_mul(gate, up) if self.activation is F.silu else None
        cuda_gate = _CUDA_GATES.get(self.activation)
        if gated is None and cuda_gate is not None:
            gated = cuda_gate(gate, up)
        if gated is None:
            gated = self.activation(gate) * up
        return gated

    def _float32_prefill(self, x: torch.Tensor) -> torch.Tensor | None:
        """The prompt-sized MLP of a bf16 model whose products run widened on this CPU
        (kernels/bf16_products.py): gate, up, the activation and down all in float32, the
        result rounded to x's dtype once. The intermediate activations are not rounded to
        bf16 between the products (only more precise than the bf16 chain), and two
        [rows, intermediate] conversions fewer each way. None when any weight has no
        widened copy (then the bf16 chain below runs)."""
        wide = widened_input(x, self.gate_proj.weight)
        gate = linear_float32(wide, self.gate_proj.weight, self.gate_proj.bias)
        if gate is None:
            return None
        up = linear_float32(wide, self.up_proj.weight, self.up_proj.bias)
        if up is None:
            return None
        gated = silu_mul(gate, up) if self.activation is F.silu else None
        if gated is None:
            gated = self.activation(gate) * up
        out = linear_float32(gated, self.down_proj.weight, self.down_proj.bias)
        return None if out is None else out.to(x.dtype)


class CachedAttention(nn.Module):
    """Projections + optional QK-norm + RoPE; storage and the attention itself belong to
    the cache method, reached through `cache_layer`. The projections are nn.Linear modules
    applied through `kvforge.kernels.cpu_linear.linear` (see GatedMLP)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool,
                 out_bias: bool, cache_layer: int, qk_norm_eps: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cache_layer = cache_layer
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=qkv_bias, **kw)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=out_bias, **kw)
        if qk_norm_eps is not None:
            self.q_norm = GemmaRMSNorm(head_dim, qk_norm_eps, **kw)
            self.k_norm = GemmaRMSNorm(head_dim, qk_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        self.packed_qkv: PackedLinear | None = None  # see pack()

    def pack(self) -> int:
        """q, k and v as one GEMM from now on (models/packed_projections.py); 1 if it packed.
        Not with QK-norm, whose RMSNorm over a slice's heads would need a copy of the slice."""
        if self.q_norm is not None or still_packed(self.packed_qkv) is not None:
            return 0
        self.packed_qkv = pack_linears((self.q_proj, self.k_proj, self.v_proj))
        return int(self.packed_qkv is not None)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CachedAttention:
        out = super()._apply(fn, recurse)
        self.packed_qkv = still_packed(self.packed_qkv)  # a move or cast: dropped, the old storage freed
        return out

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of x, [rows, heads, head_dim] each: views of one packed GEMM's output
        when the layer is packed (the fused RoPE and the cache writes read them in place),
        else three GEMMs."""
        packed = self.packed_qkv
        if packed is not None and packed.usable():
            q, k, v = packed.split(linear(x, packed.weight, packed.bias))
        else:
            wide = widened_input(x, self.q_proj.weight)  # widened once for q, k and v where they run widened
            q = linear_from(x, wide, self.q_proj.weight, self.q_proj.bias)
            k = linear_from(x, wide, self.k_proj.weight, self.k_proj.bias)
            v = linear_from(x, wide, self.v_proj.weight, self.v_proj.bias)
        rows = x.shape[0]
        return (q.view(rows, self.num_heads, self.head_dim), k.view(rows, self.num_kv_heads, self.head_dim),
                v.view(rows, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, cache: CacheMethod, meta: StepMetadata, rope: PositionedRope) -> torch.Tensor:
        rows = x.shape[0]
        q, k, v = self._project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cache.write(self.cache_layer, meta, k, v, rope)
        out = cache.attend(self.cache_layer, meta, rope.apply(q), rope)
        return linear(out.reshape(rows, self.num_heads * self.head_dim), self.o_proj.weight, self.o_proj.bias)


def pack_projections(model: nn.Module) -> int:
    """Pack the q/k/v and gate/up projections of every layer that can (`CachedAttention.pack`,
    `GatedMLP.pack`; models/packed_projections.py); returns how many packs were made."""
    return sum(module.pack() for module in model.modules() if isinstance(module, (CachedAttention, GatedMLP)))
