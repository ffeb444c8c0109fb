"""The bf16 causal attention kernel (kernels/cpu_causal_attention) against a float64
definition, side by side with ATen's bf16 attention on the same inputs: whole prompts and
chunks that are the last n of m keys, grouped-query heads, head dims 64..256, row and key
counts off the kernel's 64-blocks, large scores (the online rescale), its log-sum-exp,
thread-count independence and strided inputs; and where it must decline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from causal_reference import definition
from causal_reference import inputs as seeded_inputs

from kvforge.kernels import cpu_causal_attention as kernel_module
from kvforge.kernels.cpu_causal_attention import causal_attention, causal_attention_available

pytestmark = pytest.mark.skipif(not causal_attention_available(),
                                reason="needs the C++ kernel on a CPU with AVX512-BF16")


def inputs(n: int, m: int, heads: int, kv_heads: int, dim: int, seed: int, q_scale: float = 1.0):
    return seeded_inputs(n, m, heads, kv_heads, dim, seed, torch.bfloat16, q_scale)


def aten(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """ATen's bf16 attention on the same inputs: the precision the kernel must match."""
    n, heads, _ = q.shape
    group = heads // k.shape[0]
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(n)[:, None] + (k.shape[1] - n)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None], attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)


SHAPES = [  # (n, m, heads, kv_heads, dim)
    (1, 1, 2, 1, 64),  # one token
    (64, 64, 4, 4, 64),  # exactly one block, no GQA
    (130, 130, 9, 3, 64),  # smollm2's heads; blocks and row tiles with remainders
    (5, 70, 6, 2, 128),  # a short chunk after 65 keys: its rows see two key blocks
    (100, 357, 8, 2, 256),  # gemma3's head dim; the offset is not a multiple of 64
    (333, 333, 3, 1, 192),
]


@pytest.mark.parametrize(("n", "m", "heads", "kv_heads", "dim"), SHAPES)
def test_matches_the_definition_as_closely_as_aten(n, m, heads, kv_heads, dim):
    q, k, v = inputs(n, m, heads, kv_heads, dim, seed=n + m + dim)
    scale = dim ** -0.5
    result = causal_attention(q, k, v, scale)
    assert result is not None
    out, lse = result
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads, dim) and lse.shape == (heads, n)
    want, want_lse = definition(q, k, v, scale)
    ours = (out.double() - want).abs().max().item()
    theirs = (aten(q, k, v, scale).double() - want).abs().max().item()
    # both round the output to bf16 (and the weights into the value product): no worse than ATen
    assert ours <= 1.25 * theirs + 1e-3, (ours, theirs)
    assert ours < 2e-2
    # l sums the bf16 weights: within a few units of their rounding of the float64 lse
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=4e-3)


def test_large_scores_rescale_the_running_sums():
    """Queries x8 and keys growing with position: later blocks raise the running max again
    and again, so the rescale of the accumulator and the sum is exercised on every block."""
    q, k, v = inputs(200, 260, 4, 2, 64, seed=1, q_scale=8.0)
    k = (k.float() + torch.linspace(0, 3, 260)[None, :, None] * q.float().mean((0, 1))[None, None]).bfloat16()
    out, lse = causal_attention(q, k, v, 0.125)
    want, want_lse = definition(q, k, v, 0.125)
    theirs = (aten(q, k, v, 0.125).double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= 1.25 * theirs + 1e-3
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-3, atol=4e-3)


def test_the_thread_count_does_not_change_the_result():
    q, k, v = inputs(300, 300, 6, 3, 64, seed=2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = causal_attention(q, k, v, 0.125)
        torch.set_num_threads(2)
        two = causal_attention(q, k, v, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_strided_inputs_give_the_contiguous_result():
    """Token-major K/V seen head-major (as KIVI's prefill passes them) and a sliced q."""
    q, k, v = inputs(90, 90, 9, 3, 64, seed=3)
    token_major_k, token_major_v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    wide_q = torch.cat((q, q), dim=1)[:, :9]  # strided rows
    got = causal_attention(wide_q, token_major_k.transpose(0, 1), token_major_v.transpose(0, 1), 0.125)
    want = causal_attention(q, k, v, 0.125)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("case", ["float16", "dim 32", "more queries than keys", "grad", "disabled"])
def test_declines_what_it_does_not_cover(case, monkeypatch):
    q, k, v = inputs(8, 8, 2, 1, 64, seed=4)
    if case == "float16":  # float32 has its own kernel (test_cpu_causal_attention_float32.py)
        q, k, v = q.half(), k.half(), v.half()
    elif case == "dim 32":
        q, k, v = q[..., :32], k[..., :32], v[..., :32]
    elif case == "more queries than keys":
        k, v = k[:, :4], v[:, :4]
    elif case == "grad":
        q = q.clone().requires_grad_()
    else:
        monkeypatch.setenv("KVFORGE_DISABLE_CPU_KERNELS", "1")
    assert causal_attention(q, k, v, 0.125) is None


def test_the_op_rejects_bad_arguments_by_name():
    q, k, v = inputs(8, 8, 2, 1, 64, seed=5)
    op = torch.ops.kvforge_cpu_causal.causal_attention
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(q.float(), k, v, 0.1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        op(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(), 0.1)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        op(q[:, :1].contiguous(), torch.cat((k, k)), torch.cat((v, v)), 0.1)
    with pytest.raises(RuntimeError, match="1 <= n <= m"):
        op(q, k[:, :4].contiguous(), v[:, :4].contiguous(), 0.1)
    assert kernel_module.HEAD_DIM_MULTIPLE == 64


def test_the_softmax_exponential_is_within_two_float_ulps_of_exp2():
    """The kernel's weights are 2^(c s - c m): its base-2 exponential, alone, against float64
    over the range a softmax uses (down to its clamp) and a hair above 0 (a rounded shift)."""
    y = torch.cat((torch.linspace(-126.0, 0.0, 200_003), torch.tensor([0.0, -0.5, -1.5, 1e-6, -126.0])))
    got = torch.ops.kvforge_cpu_causal.exp2_nonpositive(y).double()
    want = torch.exp2(y.double())
    assert (got - want).abs().div(want).max().item() < 2.5e-7
    assert got[-5].item() == 1.0  # 2^0 is exactly 1: the row's largest score gets weight 1
    below = torch.ops.kvforge_cpu_causal.exp2_nonpositive(torch.tensor([-200.0, float("-inf")]))
    assert below.tolist() == [2.0 ** -126] * 2  # clamped to the smallest normal, never 0 or NaN


def test_block_boundaries_mask_exactly_the_future_keys():
    """A chunk of rows whose own keys fall inside a 64-key block (the masked, partly visible
    blocks) next to fully visible ones: rows 8 at a time must each stop at their own key."""
    q, k, v = inputs(77, 141, 4, 2, 64, seed=6)
    out, lse = causal_attention(q, k, v, 0.125)
    want, want_lse = definition(q, k, v, 0.125)
    theirs = (aten(q, k, v, 0.125).double() - want).abs().max().item()
    assert (out.double() - want).abs().max().item() <= 1.25 * theirs + 1e-3
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=4e-3)
