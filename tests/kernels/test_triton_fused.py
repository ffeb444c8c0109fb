"""The Triton RMSNorm (alone and after the residual add), RoPE and SiLU-gate ops (kernels/triton_fused.py) against the PyTorch
paths of the layers, and their dispatch (kernels/cuda_fused.py): on CUDA, or in Triton's CPU
interpreter, which tests/conftest.py turns on without a GPU; skipped, with the reason,
without the `triton` package."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_helpers import kernel_device

from kvforge.kernels import cuda_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.layers import GatedMLP, GemmaRMSNorm, RMSNorm
from kvforge.rope import PositionedRope, rotate_half

DTYPES = [torch.float32, torch.bfloat16]




@pytest.fixture
def device(monkeypatch) -> str:
    """The test device, with the CPU ops off (so the modules' fallbacks are the PyTorch
    expressions) and the Triton ops serving that device."""
    found = kernel_device()
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", found)
    return found


def tolerance(dtype: torch.dtype) -> dict:
    # float32: summation order; bfloat16: a rounding of the normalised row may fall the other
    # way (another rsqrt), and the product's rounding after it: two units in the last place
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)


def reference(module: torch.nn.Module, *args, monkeypatch) -> torch.Tensor:
    """The module's PyTorch path: the Triton ops refused by their switch."""
    with monkeypatch.context() as patch:
        patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
        return module(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("hidden", [64, 96, 13])
def test_rms_norms_match_their_pytorch_path(device, dtype, cls, hidden, monkeypatch):
    gen = torch.Generator().manual_seed(hidden)
    norm = cls(hidden, 1e-5, dtype=dtype, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0 if cls is GemmaRMSNorm else 1))
        x = (torch.randn(3, 5, hidden, generator=gen) * 3).to(dtype).to(device)
        calls = []
        kernel = cuda_fused._kernels().rms_norm_triton
        monkeypatch.setattr(cuda_fused._kernels(), "rms_norm_triton",
                            lambda *a, **k: calls.append(1) or kernel(*a, **k))
        out = norm(x)
        ref = reference(norm, x, monkeypatch=monkeypatch)
    assert calls and out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("hidden", [64, 13])
def test_residual_add_with_its_norm_matches_the_two_ops_apart(device, dtype, cls, hidden, monkeypatch):
    gen = torch.Generator().manual_seed(hidden + 1)
    norm = cls(hidden, 1e-5, dtype=dtype, device=device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen) * 0.5 + (0 if cls is GemmaRMSNorm else 1))
        # a residual and a layer's output of unlike sizes: the sum's rounding matters in bfloat16
        x = (torch.randn(3, 5, hidden, generator=gen) * 8).to(dtype).to(device)
        delta = (torch.randn(3, 5, hidden, generator=gen) * 0.3).to(dtype).to(device)
        before = x.clone()
        calls = []
        kernel = cuda_fused._kernels().add_rms_norm_triton
        monkeypatch.setattr(cuda_fused._kernels(), "add_rms_norm_triton",
                            lambda *a, **k: calls.append(1) or kernel(*a, **k))
        total, normed = norm.add_and_norm(x, delta)
        with monkeypatch.context() as patch:
            patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
            ref_total, ref_normed = norm.add_and_norm(x, delta)
        alone = cuda_fused._kernels().rms_norm_triton(total, norm.weight, norm.eps, cls is GemmaRMSNorm)
    assert calls and total.dtype == normed.dtype == dtype and total.shape == normed.shape == x.shape
    torch.testing.assert_close(x, before, atol=0, rtol=0)  # the residual is not written in place
    torch.testing.assert_close(ref_total, x + delta, atol=0, rtol=0)  # the reference is the expression
    if dtype == torch.bfloat16 and device == "cpu":
        # Triton's interpreter rounds float32 to bfloat16 by truncation (CUDA and torch: to
        # nearest even), so here the sum is held to one unit in the last place; bitwise on a GPU
        assert ((total.float() - ref_total.float()).abs() <= ref_total.float().abs() * 2 ** -7).all()
    else:
        torch.testing.assert_close(total, ref_total, atol=0, rtol=0)  # the sum rounded as `x + delta` is
    # the norm of the rounded sum: the lone norm kernel's code, bitwise; the PyTorch norm within its tolerance
    torch.testing.assert_close(normed, alone, atol=0, rtol=0)
    torch.testing.assert_close(normed.float(), ref_normed.float(), **tolerance(dtype))


def test_residual_add_with_its_norm_refuses_what_it_cannot_take(device):
    x, w = torch.randn(4, 8, device=device), torch.ones(8, device=device)
    assert cuda_fused.add_rms_norm(x, torch.randn(4, 8, device=device), w, 1e-6, gemma=False) is not None
    assert cuda_fused.add_rms_norm(x, torch.randn(1, 8, device=device), w, 1e-6, gemma=False) is None  # broadcast
    assert cuda_fused.add_rms_norm(x, torch.randn(8, 4, device=device).t(), w, 1e-6, gemma=False) is None  # strided
    assert cuda_fused.add_rms_norm(x, x.to(torch.bfloat16), w, 1e-6, gemma=False) is None  # mixed dtypes
    assert cuda_fused.add_rms_norm(x, x.clone().requires_grad_(), w, 1e-6, gemma=False) is None  # autograd
    with pytest.raises(ValueError, match="not shaped as x"):
        cuda_fused._kernels().add_rms_norm_triton(x, torch.randn(2, 8, device=device), w, 1e-6, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(4, 32), (3, 48), (1, 8)])
def test_rope_matches_its_pytorch_path(device, dtype, heads, dim, monkeypatch):
    gen = torch.Generator().manual_seed(dim)
    rows = 7
    x = torch.randn(rows, heads, dim, generator=gen).to(dtype).to(device)
    angles = torch.rand(rows, dim // 2, generator=gen) * 100
    angles = torch.cat((angles, angles), dim=-1)
    rope = PositionedRope(cos=angles.cos().to(dtype).to(device), sin=angles.sin().to(dtype).to(device), rotary=None)
    out = rope.apply(x)
    with monkeypatch.context() as patch:
        patch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
        ref = rope.apply(x)
    assert cuda_fused.rope_rotate(x, rope.cos, rope.sin) is not None
    expected = x * rope.cos[:, None] + rotate_half(x) * rope.sin[:, None]
    torch.testing.assert_close(ref, expected, atol=0, rtol=0)  # the reference is the expression
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_mlp_matches_its_pytorch_path(device, dtype, monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(32, 1500, "silu", bias=False, dtype=dtype, device=device)  # > one SILU_BLOCK per row
    x = torch.randn(3, 32).to(dtype).to(device)
    with torch.no_grad():
        gate, up = F.linear(x, mlp.gate_proj.weight), F.linear(x, mlp.up_proj.weight)
        fused = cuda_fused.silu_mul(gate, up)
        assert fused is not None
        torch.testing.assert_close(fused.float(), (F.silu(gate) * up).float(), **tolerance(dtype))
        torch.testing.assert_close(mlp(x).float(), reference(mlp, x, monkeypatch=monkeypatch).float(),
                                   **tolerance(dtype))


def test_dispatch_refuses_what_it_cannot_take(device, monkeypatch):
    x = torch.randn(4, 8, device=device)
    w = torch.ones(8, device=device)
    assert cuda_fused.rms_norm(x, w, 1e-6, gemma=False) is not None
    assert cuda_fused.rms_norm(x.double(), w.double(), 1e-6, gemma=False) is None  # float64
    assert cuda_fused.rms_norm(x, w.to(torch.bfloat16), 1e-6, gemma=False) is None  # mixed dtypes
    assert cuda_fused.rms_norm(x.t(), torch.ones(4, device=device), 1e-6, gemma=False) is None  # strided
    assert cuda_fused.silu_mul(x.requires_grad_(), x) is None  # autograd
    assert cuda_fused.rope_rotate(torch.randn(2, 1, 5, device=device), torch.ones(2, 5), torch.ones(2, 5)) is None
    monkeypatch.setattr(cuda_fused, "triton_installed", lambda: False)
    assert cuda_fused.silu_mul(x.detach(), x.detach()) is None
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", "cuda")
    if device == "cpu":  # CPU tensors never reach the Triton ops outside the tests
        assert cuda_fused.silu_mul(x.detach(), x.detach()) is None


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3_hybrid"])
def test_model_logits_with_every_triton_op(device, name, monkeypatch):
    """The GPU layer path end to end (Triton norms, the residual add with its norm, RoPE,
    SiLU-gate and paged decode attention) gives the PyTorch path's logits through prefill and batched decode."""
    if device != "cpu":
        pytest.skip("runs the interpreter on the CPU")
    from conftest import decode_logits, make_pair, make_runner

    kernels = cuda_fused._kernels()
    used: set[str] = set()

    def counted(op: str):
        kernel = getattr(kernels, op)
        return lambda *args, **kwargs: used.add(op) or kernel(*args, **kwargs)

    for op in ("rms_norm_triton", "add_rms_norm_triton", "rope_rotate_triton", "silu_mul_triton"):
        monkeypatch.setattr(kernels, op, counted(op))
    _, model = make_pair(name)
    prompts = [list(range(3, 20)), [7, 8, 9]]
    fused = decode_logits(make_runner(model, cache="full:block_size=4,decode_kernel=triton"), prompts, steps=3)
    gated = {"silu_mul_triton"} if name == "llama_gqa" else set()  # gemma3's MLP is GELU-gated
    assert used == {"rms_norm_triton", "add_rms_norm_triton", "rope_rotate_triton"} | gated
    monkeypatch.setenv(cuda_fused.DISABLE_TRITON_FUSED_ENV, "1")
    plain = decode_logits(make_runner(model, cache="full:block_size=4,decode_kernel=torch"), prompts, steps=3)
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
