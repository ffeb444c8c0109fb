"""RoPE and SiLU-gate read the slices of a packed projection's output in place: rows that sit
apart in memory (each row contiguous). Both the C++ CPU ops and the Triton ops (on CUDA, or
in Triton's interpreter) must give, bitwise, what they give on a contiguous copy of the
same slice; a layout whose rows are not contiguous still falls back (None)."""

from __future__ import annotations

import pytest
import torch
from triton_helpers import kernel_device

from kvforge.kernels import cpu_fused, cuda_fused
from kvforge.kernels.build import DISABLE_ENV
from kvforge.kernels.row_layout import rows_contiguous

DTYPES = [torch.float32, torch.bfloat16]
HEADS, KV_HEADS, DIM, ROWS = 4, 2, 16, 5


def packed_qkv(dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype).to(device)


def tables(dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    angles = torch.rand(ROWS, DIM // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def slices(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a packed [rows, (heads + 2 kv_heads) x dim] output, as the layer views them."""
    q, k, _ = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    return q.view(ROWS, HEADS, DIM), k.view(ROWS, KV_HEADS, DIM)


def test_rows_contiguous_is_every_dimension_but_the_first():
    q, k = slices(packed_qkv(torch.float32, "cpu"))
    assert not q.is_contiguous() and rows_contiguous(q) and rows_contiguous(k)
    assert rows_contiguous(torch.randn(3, 4)) and rows_contiguous(torch.randn(1, 4)[:, :2])
    assert not rows_contiguous(torch.randn(4, 3).t())  # a row's elements apart
    assert not rows_contiguous(torch.randn(3, 4, 5).transpose(0, 1))  # heads apart within a row
    assert not rows_contiguous(torch.randn(6)[::2])  # one dimension: no rows to hold apart


def ops(kind: str, monkeypatch) -> tuple[str, object]:
    """(device, module) of the ops under test: the C++ CPU ops or the Triton ones."""
    if kind == "cpu":
        if not cpu_fused.fused_ops_available():
            pytest.skip("the fused CPU ops could not be built or are disabled")
        return "cpu", cpu_fused
    found = kernel_device()
    monkeypatch.setenv(DISABLE_ENV, "1")
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", found)
    return found, cuda_fused


@pytest.mark.parametrize("kind", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_of_a_packed_slice_is_rope_of_its_copy(kind, dtype, monkeypatch):
    device, module = ops(kind, monkeypatch)
    cos, sin = tables(dtype, device)
    for x in slices(packed_qkv(dtype, device)):
        out = module.rope_rotate(x, cos, sin)
        assert out is not None and out.is_contiguous()
        assert torch.equal(out, module.rope_rotate(x.contiguous(), cos, sin))
    heads_apart = torch.randn(HEADS, ROWS, DIM).to(dtype).to(device).transpose(0, 1)
    assert module.rope_rotate(heads_apart, cos, sin) is None  # the PyTorch expression then


@pytest.mark.parametrize("kind", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [40, 1100])  # 1100: more than one Triton block per row
def test_silu_mul_of_packed_halves_is_silu_mul_of_their_copies(kind, dtype, features, monkeypatch):
    device, module = ops(kind, monkeypatch)
    gen = torch.Generator().manual_seed(features)
    gate_up = (torch.randn(ROWS, 2 * features, generator=gen) * 3).to(dtype).to(device)
    gate, up = gate_up.split(features, dim=-1)
    out = module.silu_mul(gate, up)
    assert out is not None and out.is_contiguous() and out.shape == (ROWS, features)
    assert torch.equal(out, module.silu_mul(gate.contiguous(), up.contiguous()))
    # gate and up at different row strides: each half read at its own
    other = (torch.randn(ROWS, 3 * features, generator=gen)).to(dtype).to(device)[:, features:2 * features]
    assert torch.equal(module.silu_mul(gate, other), module.silu_mul(gate.contiguous(), other.contiguous()))
    assert module.silu_mul(gate.t().contiguous().t(), up) is None  # a row's elements apart


@pytest.mark.parametrize("kind", ["cpu", "triton"])
def test_silu_mul_of_more_than_two_dims_still_needs_contiguous_inputs(kind, monkeypatch):
    device, module = ops(kind, monkeypatch)
    both = torch.randn(2, 3, 16).to(device)
    gate, up = both[..., :8], both[..., 8:]
    assert module.silu_mul(gate, up) is None
    out = module.silu_mul(gate.contiguous(), up.contiguous())
    assert out is not None and out.shape == (2, 3, 8)
