"""`kivi:key_dot=int8` (int8_keys.py): decode scores of quantised keys with the scaled query
quantised to int8 per (page, head) and exact integer sums.

- The PyTorch statement `int8_key_scores` against the definition written out with Python
  integers, and against exact float scores within the rounding bound it implies.
- The compiled kernel (VNNI path for G % 32 == 0, the generic integer path otherwise)
  against the PyTorch decode attention with the same option, over the kernel's code paths.
- Through the cache: the C++ and PyTorch kernels agree, and the option changes the result
  only by what int8 rounding explains; bad combinations fail naming the parameter.
"""

from __future__ import annotations

import pytest
import torch
from kivi_helpers import step_batch
from test_kivi_cpu_decode_paths import lengths_for, make_case, torch_threads
from test_kivi_options import DIM, HEADS, KV_HEADS, ROTARY, SCHEDULE, make_cache, run_and_check

from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available, kivi_decode_attention_cpu
from kvforge.cache.kivi.int8_keys import int8_key_scores
from kvforge.cache.kivi.quant import unpack_codes
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.errors import ConfigError

needs_kernel = pytest.mark.skipif(not cpu_kivi_kernel_available(),
                                  reason="the CPU KIVI kernel did not build (see the warning)")


def random_pages(bits: int, g: int, dim: int = 64, kv_heads: int = 2, pages: int = 5, seed: int = 0) -> KIVILayerView:
    gen = torch.Generator().manual_seed(seed)
    k_codes = torch.randint(0, 256, (kv_heads, pages, dim, g * bits // 8), generator=gen, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (kv_heads, pages, g, dim * bits // 8), generator=gen, dtype=torch.uint8)
    k_scale = (torch.rand(kv_heads, pages, dim, generator=gen) * 0.5 + 0.01).half()
    k_zero = torch.randn(kv_heads, pages, dim, generator=gen).half()
    v_scale = torch.rand(kv_heads, pages, g, dim // g if dim >= g else 1, generator=gen).half()
    ring = torch.zeros(1, kv_heads, g, dim)
    return KIVILayerView(k_codes, k_scale, k_zero, v_codes, v_scale, v_scale.clone(), ring, ring.clone(), bits)


def definition_scores(q: torch.Tensor, view: KIVILayerView, page: int, head: int) -> list[list[float]]:
    """Scores [group][G] of q [group, D] on one page, from the definition with Python integers."""
    codes = unpack_codes(view.k_codes[head, page], view.bits)  # [D, G]
    scale, zero = view.k_scale[head, page].float(), view.k_zero[head, page].float()
    out = []
    for row in q:
        qsc = row * scale
        top = float(qsc.abs().max())
        inv = torch.tensor(127.0, dtype=torch.float32) / torch.tensor(top, dtype=torch.float32)
        q8 = [int(torch.round(x * inv)) for x in qsc]
        zero_part = float((row * zero).sum())
        step = float(torch.tensor(top, dtype=torch.float32) / 127)
        out.append([zero_part + step * sum(q8[c] * int(codes[c, t]) for c in range(len(q8)))
                    for t in range(codes.shape[1])])
    return out


@pytest.mark.parametrize("bits,g", [(2, 32), (4, 32), (2, 16), (4, 64)])
def test_scores_follow_the_definition(bits, g):
    view = random_pages(bits, g, dim=16, seed=bits + g)
    gen = torch.Generator().manual_seed(3)
    qh = torch.randn(2, 2, 3, 16, generator=gen)  # [H, B, group, D]
    ids = torch.tensor([[4, 1], [0, 2]])  # [B, m]
    got = int8_key_scores(qh, view, ids)  # [H, B, group, m * G]
    for h in range(2):
        for b in range(2):
            for m, page in enumerate(ids[b].tolist()):
                want = torch.tensor(definition_scores(qh[h, b], view, page, h))
                torch.testing.assert_close(got[h, b, :, m * g:(m + 1) * g], want, rtol=1e-5, atol=1e-5)


def test_scores_are_exact_scores_up_to_the_int8_rounding():
    """|int8 - float| <= (step / 2) * sum_c code(t, c) per token (each q8 is off by at most
    half a step), and the rounding does move the scores (the option is not a no-op)."""
    view = random_pages(2, 32, seed=5)
    qh = torch.randn(2, 1, 3, 64, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([[3, 0, 4]])
    got = int8_key_scores(qh, view, ids)
    codes = unpack_codes(view.k_codes.index_select(1, ids[0]), 2).float()  # [H, m, D, G]
    scale, zero = view.k_scale.index_select(1, ids[0]).float(), view.k_zero.index_select(1, ids[0]).float()
    keys = codes * scale[..., None] + zero[..., None]  # [H, m, D, G]
    exact = torch.einsum("hgd,hmdt->hgmt", qh[:, 0], keys).reshape(2, 3, -1)
    step = (qh[:, 0, :, None, :] * scale[:, None]).abs().amax(-1) / 127  # [H, group, m]
    bound = (step[..., None] / 2 * codes.sum(dim=2)[:, None]).reshape(2, 3, -1)  # [H, group, m * G]
    error = (got[:, 0] - exact).abs()
    assert (error <= bound + 1e-5).all()
    assert error.max() > 1e-4


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("g,dim", [(32, 64), (64, 64), (32, 256), (16, 48), (8, 64)],
                         ids=["G32-vnni", "G64-vnni-staged", "G32-D256", "G16-generic", "G8-generic"])
def test_kernel_equals_the_pytorch_path(bits, g, dim):
    r = max(2 * g, 64)
    case = make_case(lengths_for(r, g), g=g, r=r, dim=dim, bits=bits, seed=bits * 7 + g)
    got = kivi_decode_attention_cpu(**case, key_dot="int8")
    want = kivi_decode_attention(**case, tile_pages=2, key_dot="int8")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = kivi_decode_attention_cpu(**case)
    difference = (got - exact).abs().max()
    assert 1e-5 < difference < 0.05 * exact.abs().max()  # int8 rounding shows, and stays small


@needs_kernel
@pytest.mark.parametrize("bits,g,dim,group,seed", [(2, 64, 128, 5, 407), (2, 32, 96, 3, 100), (4, 64, 192, 2, 0)])
def test_kernel_rounds_each_q8_like_the_pytorch_path(bits, g, dim, group, seed):
    """Cases with a scaled query within an ulp of a rounding tie (the first one found by a
    sweep): the PyTorch path must compute 127 / max as the kernel does (one float32
    division; `127 / tensor` in torch is a reciprocal times 127), or a q8 rounds the other
    way and the score moves by a whole step."""
    r = max(2 * g, 64)
    case = make_case(lengths_for(r, g)[-3:], g=g, r=r, dim=dim, bits=bits, group=group, seed=seed)
    torch.testing.assert_close(kivi_decode_attention_cpu(**case, key_dot="int8"),
                               kivi_decode_attention(**case, tile_pages=2, key_dot="int8"), rtol=1e-6, atol=1e-6)


def test_a_vanishing_query_row_scores_only_the_zero_part():
    view = random_pages(2, 32, dim=16)
    qh = torch.full((2, 1, 1, 16), 1e-37)  # 127 / max|q * scale| overflows to inf
    scores = int8_key_scores(qh, view, torch.tensor([[0]]))
    assert torch.isfinite(scores).all()
    zero_part = (qh[:, 0, 0] * view.k_zero[:, 0].float()).sum(-1)  # [H]
    torch.testing.assert_close(scores[:, 0, 0], zero_part[:, None].expand(-1, 32))


@needs_kernel
@pytest.mark.parametrize("group", [1, 3, 9])
@pytest.mark.parametrize("window", [None, 40, 333])
def test_kernel_gqa_groups_and_windows(group, window):
    case = make_case([3, 50, 129, 200, 777], kv_heads=2, group=group, g=32, r=64, window=window, seed=group)
    torch.testing.assert_close(kivi_decode_attention_cpu(**case, key_dot="int8"),
                               kivi_decode_attention(**case, tile_pages=3, key_dot="int8"), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_split_over_threads(threads):
    with torch_threads(threads):
        case = make_case([5000], kv_heads=1, group=4, residual_dtype=torch.bfloat16)
        torch.testing.assert_close(kivi_decode_attention_cpu(**case, key_dot="int8"),
                                   kivi_decode_attention(**case, tile_pages=2, key_dot="int8"), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("options", ["key_dot=int8", "key_dot=int8,key_bits=4,value_bits=2",
                                     "key_dot=int8,sinks=4", "key_dot=int8,rotation=hadamard_keys,bits=4"])
@pytest.mark.parametrize("window", [None, 20])
def test_cache_kernels_agree(options, window):
    """Through the cache (prefill chunks, decode, mixed batches, a sliding layer): the C++
    kernel and the PyTorch path give the same attention with the option, and it differs
    from key_dot=float's only by int8 rounding (run_and_check's definition is float, so
    the int8 run must fail it by a little, not pass it)."""
    outputs = {}
    for kernel in ("cpp", "torch"):
        cache = make_cache(options, window, decode_kernel=kernel)
        outputs[kernel] = collect(cache)
    for a, b in zip(outputs["cpp"], outputs["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    floats = collect(make_cache(options.replace("key_dot=int8", "key_dot=float"), window))
    gaps = [float((a - b).abs().max()) for a, b in zip(outputs["torch"], floats)]
    assert max(gaps) > 1e-5 and max(gaps) < 0.2


def collect(cache) -> list[torch.Tensor]:
    """Outputs of every step of SCHEDULE (the last layer), with the same inputs each call."""
    torch.manual_seed(0)
    outs = []
    for lengths in SCHEDULE:
        ids = list(lengths)
        batch, cached = step_batch(cache, lengths)
        positions = torch.cat([torch.arange(n, n + lengths[s]) for s, n in zip(ids, cached)])
        step_rope = ROTARY.at(positions, torch.float32)
        total = int(sum(lengths.values()))
        q = step_rope.apply(torch.randn(total, HEADS, DIM))
        k, v = torch.randn(total, KV_HEADS, DIM) * 2 + 1, torch.randn(total, KV_HEADS, DIM)
        meta = cache.begin_step(batch)
        for layer in (0, 1):
            cache.write(layer, meta, k, v, step_rope)
            out = cache.attend(layer, meta, q, step_rope)
        cache.end_step(meta)
        outs.append(out)
    return outs


def test_float_is_the_default_and_matches_the_definition():
    cache = make_cache("", None)
    assert cache.config.key_dot == "float"
    assert run_and_check(cache, None, SCHEDULE[:6]) > 10


@pytest.mark.parametrize(("spec", "message"), [
    ("kivi:key_dot=int4", "key_dot.*int4.*one of"),
    ("kivi:key_dot=int8,key_space=pre_rope", "key_dot.*int8.*key_space=post_rope"),
    ("kivi:key_dot=int8,bits=8", "key_dot.*int8.*2- or 4-bit keys"),
    ("kivi:key_dot=int8,decode_kernel=triton", "decode_kernel.*triton.*does not read key_dot=int8"),
])
def test_bad_combinations_fail_clearly(spec, message):
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 64, 0.125)])
    with pytest.raises(ConfigError, match=message):
        create_cache(parse_cache_spec(spec), layout, 1 << 22, torch.float32)
