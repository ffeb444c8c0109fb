"""The fused RMSNorm and RoPE ops against their PyTorch definitions, their row independence,
and the dispatch rules (the PyTorch expression runs whenever the op is not eligible)."""

from __future__ import annotations

import pytest
import torch

from kvforge.kernels import cpu_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.layers import GemmaRMSNorm, RMSNorm
from kvforge.rope import rotate_half

requires_kernel = pytest.mark.skipif(not cpu_fused.fused_ops_available(),
                                     reason="the fused CPU ops could not be built or are disabled")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The definitions, in float64 up to each rounding the models make."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.double())).to(x.dtype)
    return (weight.double() * normed.to(x.dtype).double()).to(x.dtype)


def ulp_tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]


def operands(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.5 + 1).to(dtype)
    return x, weight


@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("hidden", [576, 640, 13, 1])
def test_rms_norm_matches_its_definition(dtype, gemma, hidden):
    x, weight = operands(37, hidden, dtype)
    out = cpu_fused.rms_norm(x, weight, 1e-5, gemma)
    ref = reference_norm(x, weight, 1e-5, gemma)
    assert out.dtype == dtype and out.shape == x.shape
    # one rounding of a float32 result: within one unit in the last place of the dtype
    torch.testing.assert_close(out.double(), ref.double(), rtol=2 * ulp_tolerance(dtype), atol=1e-6)


@requires_kernel
@pytest.mark.parametrize("cls,gemma", [(RMSNorm, False), (GemmaRMSNorm, True)])
def test_modules_use_the_op_and_match_their_pytorch_path(cls, gemma, monkeypatch):
    x, weight = operands(5, 64, torch.float32, seed=3)
    norm = cls(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(weight)
        fused = norm(x.view(5, 1, 64))  # leading dims of any shape
        monkeypatch.setenv(DISABLE_ENV, "1")
        reference = norm(x.view(5, 1, 64))
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)
    # the weight really is applied, as (1 + w) for Gemma and w for Llama
    scale = (1 + weight) if gemma else weight
    unit = reference_norm(x, torch.zeros(64) if gemma else torch.ones(64), 1e-6, gemma)
    torch.testing.assert_close(fused.view(5, 64), unit * scale, rtol=1e-5, atol=1e-5)


@requires_kernel
def test_rms_norm_rows_are_independent():
    x, weight = operands(33, 576, torch.bfloat16, seed=1)
    full = cpu_fused.rms_norm(x, weight, 1e-5, False)
    for i in (0, 7, 32):
        assert torch.equal(cpu_fused.rms_norm(x[i:i + 1], weight, 1e-5, False)[0], full[i])


def rope_operands(rows: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


@requires_kernel
@pytest.mark.parametrize("heads,dim", [(9, 64), (1, 256), (3, 2)])
def test_rope_float32_is_pytorchs_expression_bitwise(heads, dim):
    x, cos, sin = rope_operands(11, heads, dim, torch.float32)
    expected = x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]
    assert torch.equal(cpu_fused.rope_rotate(x, cos, sin), expected)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_low_precision_rounds_once(dtype):
    x, cos, sin = rope_operands(11, 4, 64, dtype, seed=2)
    x64, c64, s64 = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    exact = x64 * c64 + rotate_half(x64) * s64
    out = cpu_fused.rope_rotate(x, cos, sin)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), exact.to(dtype).double(), rtol=2 * ulp_tolerance(dtype), atol=1e-3)


@requires_kernel
def test_rope_cos_and_sin_halves_are_used_as_given():
    """Per-element tables: halves that differ (not built by RotaryEmbedding) still follow the formula."""
    gen = torch.Generator().manual_seed(4)
    x, cos, sin = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    assert torch.equal(cpu_fused.rope_rotate(x, cos, sin), x * cos[:, None] + rotate_half(x) * sin[:, None])


@pytest.mark.parametrize("case", ["grad", "float64", "strided", "disabled", "shape"])
def test_ineligible_calls_return_none(case, monkeypatch):
    x, weight = operands(4, 8, torch.float32)
    rx, cos, sin = rope_operands(4, 2, 8, torch.float32)
    if case == "grad":
        weight.requires_grad_(True)
        rx.requires_grad_(True)
    elif case == "float64":
        x, weight, rx, cos, sin = x.double(), weight.double(), rx.double(), cos.double(), sin.double()
    elif case == "strided":
        x, rx = x.T.contiguous().T, rx.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "disabled":
        monkeypatch.setenv(DISABLE_ENV, "1")
    elif case == "shape":
        weight, cos = weight[:4], cos[:, :4]
    assert cpu_fused.rms_norm(x, weight, 1e-5, False) is None
    assert cpu_fused.rope_rotate(rx, cos, sin) is None


def test_modules_keep_autograd_through_the_pytorch_path():
    norm = RMSNorm(8, 1e-5)
    x = torch.randn(3, 8, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


@pytest.mark.parametrize("value,disabled", [("1", True), ("yes", True), ("0", False), ("", False), (" 0 ", False)])
def test_disable_env_is_read_on_every_call(value, disabled, monkeypatch):
    from kvforge.kernels.build import kernels_disabled

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert not kernels_disabled()
    monkeypatch.setenv(DISABLE_ENV, value)
    assert kernels_disabled() is disabled
    monkeypatch.delenv(DISABLE_ENV)
    assert not kernels_disabled()


# -- argmax_rows: the sampler's greedy choice --------------------------------------------------
@requires_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000, 49152])
def test_argmax_rows_is_torch_argmax(dtype, vocab):
    """Ties go to the first maximum, NaN (argmax's largest) to the first NaN, all -inf to 0,
    inside and across the op's 64-element blocks."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(8, vocab, generator=gen).to(dtype)
    x[1] = 0.0
    x[2, -1] = float("nan")
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    if vocab > 70:
        x[5, 66], x[5, 3], x[5, 70] = 9.0, 9.0, 9.0  # equal maxima in two blocks: the earliest wins
        x[6, 65], x[6, 2] = float("nan"), float("nan")
        x[7, 64] = 9.0
    assert torch.equal(cpu_fused.argmax_rows(x), torch.argmax(x, dim=-1))
    if vocab > 70:
        assert cpu_fused.argmax_rows(x)[5:8].tolist() == [3, 2, 64]


@requires_kernel
def test_greedy_sampling_takes_argmax_rows_without_a_float_copy(monkeypatch):
    from kvforge.engine import sampling
    from kvforge.engine.sampling import SamplingParams

    seen = []
    monkeypatch.setattr(sampling, "argmax_rows", lambda x: seen.append(x.dtype) or cpu_fused.argmax_rows(x))
    logits = torch.randn(5, 300).bfloat16()
    greedy = [SamplingParams(temperature=0)] * 5
    assert sampling.sample(logits, greedy).token_ids == torch.argmax(logits.float(), -1).tolist()
    assert seen == [torch.bfloat16]
    # a banned id, or a sampled row, takes the float32 path (the op is not asked)
    top = int(torch.argmax(logits[0].float()))
    out = sampling.sample(logits, greedy, banned=[[top]] + [None] * 4)
    assert out.token_ids[0] != top and len(seen) == 1


def _silu_mul_definition(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up with the eager expression's roundings, silu in float64."""
    s = (gate.double() * torch.sigmoid(gate.double())).to(gate.dtype)
    return (s.double() * up.double()).to(gate.dtype)


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("features", [1536, 37])  # 37: a masked last step in every row
def test_silu_mul_matches_its_definition(dtype, features):
    """Each element is T(T(silu(g)) * u): bf16 and f16 outputs equal the definition's (silu
    exact, then the same two roundings) but where silu's last float bit decides a rounding;
    float32 is within a few ulp. Large |g| included: silu(-90) is below float's normal
    range and comes out as 0 (F.silu gives -0 there), silu(90) is 90."""
    gen = torch.Generator().manual_seed(features)
    gate = torch.randn(16, features, generator=gen) * 4
    gate[0, :6] = torch.tensor([90.0, -90.0, 0.0, -0.0, 20.0, -20.0])
    gate, up = gate.to(dtype), torch.randn(16, features, generator=gen).to(dtype)
    out = cpu_fused.silu_mul(gate, up)
    expected = _silu_mul_definition(gate, up)
    assert out is not None and out.dtype == dtype and out.shape == gate.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=4e-7, atol=1e-30)
    else:
        assert (out == expected).float().mean().item() > 0.995
        torch.testing.assert_close(out.double(), expected.double(), rtol=2 ** -7, atol=1e-30)
    assert out[0, 1].item() == 0.0 and out[0, 0].item() == pytest.approx(90 * float(up[0, 0]), rel=1e-2)


@requires_kernel
def test_silu_mul_rounds_silu_before_the_product():
    """bf16: silu(g) is rounded to bf16 before it multiplies u, as F.silu(g) * u does. A
    single rounding of the float product would differ in many elements."""
    gen = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(16, 1536, generator=gen).to(torch.bfloat16) for _ in range(2))
    out = cpu_fused.silu_mul(gate, up)
    once = (gate.double() * torch.sigmoid(gate.double()) * up.double()).to(torch.bfloat16)
    assert (out != once).float().mean().item() > 0.05
    assert (out == _silu_mul_definition(gate, up)).float().mean().item() > 0.995


@requires_kernel
def test_silu_mul_rows_are_independent():
    """A row's result does not depend on the rows beside it (rows split over threads whole)."""
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(40, 1000, generator=gen).to(torch.bfloat16) for _ in range(2))
    full = cpu_fused.silu_mul(gate, up)
    for r in (0, 17, 39):
        assert torch.equal(cpu_fused.silu_mul(gate[r:r + 1], up[r:r + 1])[0], full[r])


@requires_kernel
def test_gated_mlp_uses_silu_mul_and_keeps_the_pytorch_path_for_others(monkeypatch):
    from kvforge.models.layers import GatedMLP
    calls = []
    real = cpu_fused.silu_mul
    monkeypatch.setattr("kvforge.models.layers.silu_mul", lambda g, u: calls.append(1) or real(g, u))
    torch.manual_seed(0)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        silu_mlp = GatedMLP(64, 96, "silu", bias=False, dtype=torch.bfloat16)
        out = silu_mlp(x)
        assert calls == [1]
        gate = x @ silu_mlp.gate_proj.weight.T
        up = x @ silu_mlp.up_proj.weight.T
        torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up) @ silu_mlp.down_proj.weight.T,
                                   rtol=2e-2, atol=2e-2)
        GatedMLP(64, 96, "gelu_pytorch_tanh", bias=False, dtype=torch.bfloat16)(x)
        assert calls == [1]  # gelu: the PyTorch expression


@requires_kernel
def test_silu_mul_rejects_mismatched_shapes():
    gate = torch.randn(2, 8)
    assert cpu_fused.silu_mul(gate, torch.randn(2, 9)) is None
    with pytest.raises(RuntimeError, match="silu_mul: gate and up must have one shape"):
        torch.ops.kvforge_cpu_fused.silu_mul(gate, torch.randn(2, 9))
