"""The vocabulary projection keeps a 2-byte model's logits in float32, unrounded: every form
(the small-M kernel's float output, the widened product in vocabulary slices, CUDA's float32
GEMM output) equals the exact float32 product of the bf16 values, and a near tie that bf16
would round into a tie keeps its order."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair

from kvforge.kernels import vocab_logits as vocab_logits_module
from kvforge.kernels.cpu_linear import linear, small_m_linear_available
from kvforge.kernels.vocab_logits import vocab_logits


def _operands(rows: int, vocab: int = 300, hidden: int = 72, bias: bool = True, device: str = "cpu"):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=generator).to(device=device, dtype=torch.bfloat16)
    weight = (torch.randn(vocab, hidden, generator=generator) / 8).to(device=device, dtype=torch.bfloat16)
    b = torch.randn(vocab, generator=generator).to(device=device, dtype=torch.bfloat16) if bias else None
    return x, weight, b


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 70])  # the kernel's rows, and the widened product's
@pytest.mark.parametrize("bias", [False, True])
def test_logits_are_the_float32_product_of_the_bf16_values(rows, bias, monkeypatch):
    monkeypatch.setattr(vocab_logits_module, "_WIDEN_ROWS", 128)  # 300 rows: three slices, the last short
    x, weight, b = _operands(rows, bias=bias)
    got = vocab_logits(x, weight, b)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    torch.testing.assert_close(got, _exact(x, weight, b), atol=2e-5, rtol=1e-5)
    # further from it than the float32 sums are: the same product rounded to bf16
    assert (linear(x, weight, b).float() - _exact(x, weight, b)).abs().max() > 1e-3


def test_a_gap_below_bf16_resolution_keeps_its_order():
    """Two candidates at 25.30 and 25.27 round to one bf16 value (25.25), where argmax would
    take the lower id; the float32 logits keep the higher one first."""
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    weight = torch.zeros(2, 64, dtype=torch.bfloat16)
    weight[0, :1], weight[1, :1] = 25.25, 25.25  # exactly representable
    weight[0, 1], weight[1, 1] = 0.01953125, 0.05078125  # 2^-6 * 1.25 and 2^-5 * 1.625: exact too
    rounded = linear(x, weight)
    assert rounded[0, 0] == rounded[0, 1]  # the bf16 product ties
    got = vocab_logits(x, weight)
    assert got[0, 1] > got[0, 0] and got.argmax(-1).item() == 1
    wide = vocab_logits(x.expand(40, 64).contiguous(), weight)  # the widened product, more rows
    assert (wide.argmax(-1) == 1).all()


@pytest.mark.skipif(not small_m_linear_available(), reason="the small-M kernel did not build")
def test_kernel_rows_do_not_depend_on_the_batch():
    x, weight, b = _operands(17)
    batch = vocab_logits(x, weight, b)
    for row in (0, 9, 16):
        assert torch.equal(vocab_logits(x[row:row + 1], weight, b)[0], batch[row])


def test_autograd_flows_through_the_float32_logits():
    x, weight, b = _operands(3, bias=True)
    weight.requires_grad_(True)
    out = vocab_logits(x, weight, b)
    assert out.dtype == torch.float32 and out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(weight.grad.float(), x.float().sum(0).expand(300, -1), atol=0.05, rtol=0.01)


def test_float_weights_multiply_as_they_are():
    x, weight, b = _operands(4)
    for dtype in (torch.float32, torch.float64):
        args = (x.to(dtype), weight.to(dtype), b.to(dtype))
        assert vocab_logits(*args).dtype == dtype
        torch.testing.assert_close(vocab_logits(*args), torch.nn.functional.linear(*args))


def test_a_bf16_models_logits_are_float32():
    model = make_pair("llama_gqa")[1].to(torch.bfloat16)
    hidden = torch.randn(3, model.config.hidden_size).to(torch.bfloat16)
    logits = model.logits(hidden)
    assert logits.dtype == torch.float32
    normed = model.model.norm(hidden)
    torch.testing.assert_close(logits, _exact(normed, model.lm_head.weight, None), atol=2e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_are_the_float32_product():
    for rows in (1, 16, 70):
        x, weight, b = _operands(rows, device="cuda")
        got = vocab_logits(x, weight, b)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, _exact(x, weight, b), atol=1e-4, rtol=1e-4)


def _mm_raising(error: Exception, tried: list[int]):
    def mm(*args, **kwargs):
        tried.append(1)
        raise error
    return mm


def test_a_torch_without_float_output_on_cuda_falls_back_once_and_says_so(monkeypatch, caplog):
    """A torch whose mm has no float32 output (played by a stand-in raising as torch does):
    the first call finds that, warns, and rounds as before; later calls do not try again."""
    monkeypatch.setattr(vocab_logits_module, "_cuda_float_out", None)
    x, weight, _ = _operands(3, bias=False)
    tried: list[int] = []
    monkeypatch.setattr(torch, "mm", _mm_raising(NotImplementedError("Could not run 'aten::mm.dtype'"), tried))
    with caplog.at_level("WARNING", logger=vocab_logits_module.__name__):
        out = vocab_logits_module._cuda_float_product(x, weight)
    assert vocab_logits_module._cuda_float_out is False and "no float32 output" in caplog.text
    assert out.dtype == torch.float32 and torch.equal(out, torch.nn.functional.linear(x, weight).float())
    vocab_logits_module._cuda_float_product(x, weight)
    assert tried == [1]


def test_another_cuda_error_is_raised_not_taken_for_a_missing_feature(monkeypatch):
    monkeypatch.setattr(vocab_logits_module, "_cuda_float_out", None)
    x, weight, _ = _operands(3, bias=False)
    monkeypatch.setattr(torch, "mm", _mm_raising(RuntimeError("CUDA error: an illegal memory access"), []))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        vocab_logits_module._cuda_float_product(x, weight)
    assert vocab_logits_module._cuda_float_out is None  # still untried: the next call tries again
