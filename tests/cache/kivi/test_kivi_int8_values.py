"""`kivi:value_dot=int8` (int8_values.py): decode sums over quantised values with the softmax
weights times value scales quantised to 8 bits per (page, head, value group) and exact
integer sums.

- The PyTorch statement `int8_value_sums` against the definition written out with Python
  integers, and against exact float sums within the rounding bound it implies.
- The compiled kernel (VNNI path for G % 4 == 0, GV % 16 == 0 and D % (128 / bits) == 0,
  the generic integer path otherwise) against the PyTorch decode attention with the same
  option, over the kernel's code paths.
- Through the cache: the C++ and PyTorch kernels agree, and the option changes the result
  only by what 8-bit rounding explains; bad combinations fail naming the parameter.

Kernel and PyTorch path compute the softmax weights each in its own order and with its own
exp, so a weight within an ulp of a rounding tie may round the other way in one of them (a
whole step of that page's w8). `assert_parity` therefore allows a few elements past 1e-5,
each still far inside the int8 rounding error; a wrong mapping of codes, weights or groups
moves almost every element.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_kivi_cpu_decode_paths import lengths_for, make_case, torch_threads
from test_kivi_int8_keys import collect
from test_kivi_options import make_cache

from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available, kivi_decode_attention_cpu
from kvforge.cache.kivi.int8_values import int8_value_sums
from kvforge.cache.kivi.quant import unpack_codes
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.errors import ConfigError

needs_kernel = pytest.mark.skipif(not cpu_kivi_kernel_available(),
                                  reason="the CPU KIVI kernel did not build (see the warning)")


def assert_parity(got: list[torch.Tensor], want: list[torch.Tensor], floats: list[torch.Tensor], gv: int) -> None:
    """Outputs [..., D] of several calls: got equals want (rtol = atol = 1e-5) but in at most
    2% of the (row, value group) blocks, where a near-tie weight may have rounded the other
    way, and the largest difference is at most half the largest effect of the int8 rounding
    itself (want against `floats`): a flipped weight moves one block by one step of one page,
    the rounding moves every block by up to half a step on every token of every page."""
    blocks = flagged = 0
    worst = rounding = 0.0
    for a, b, f in zip(got, want, floats):
        assert torch.isfinite(a).all()
        error = (a - b).abs()
        off = (error > 1e-5 + 1e-5 * b.abs()).reshape(*a.shape[:-1], -1, gv).any(dim=-1)
        blocks, flagged = blocks + off.numel(), flagged + int(off.sum())
        worst, rounding = max(worst, float(error.max())), max(rounding, float((b - f).abs().max()))
    assert flagged <= 0.02 * blocks, f"{flagged} of {blocks} (row, value group) blocks differ"
    assert worst <= max(1e-5, 0.5 * rounding), f"largest difference {worst} against the rounding's {rounding}"


def random_value_pages(bits: int, g: int, dim: int, gv: int, kv_heads: int = 2, pages: int = 4,
                       seed: int = 0) -> KIVILayerView:
    gen = torch.Generator().manual_seed(seed)
    k_codes = torch.zeros(kv_heads, pages, dim, g * bits // 8, dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (kv_heads, pages, g, dim * bits // 8), generator=gen, dtype=torch.uint8)
    k_params = torch.zeros(kv_heads, pages, dim).half()
    v_scale = (torch.rand(kv_heads, pages, g, dim // gv, generator=gen) * 0.5 + 0.01).half()
    v_zero = torch.randn(kv_heads, pages, g, dim // gv, generator=gen).half()
    ring = torch.zeros(1, kv_heads, g, dim)
    return KIVILayerView(k_codes, k_params, k_params, v_codes, v_scale, v_zero, ring, ring.clone(), bits)


def definition_sums(p: torch.Tensor, view: KIVILayerView, page: int, head: int, read: list[bool]) -> list[float]:
    """sum_t p_t v_hat(t, c) [D] of one page for one query row p [G], from the definition
    with Python integers: w8 = round(w * 255 / max w) per value group."""
    codes = unpack_codes(view.v_codes[head, page], view.vbits)  # [G, D]
    scale, zero = view.v_scale[head, page].float(), view.v_zero[head, page].float()  # [G, groups]
    g, dim = codes.shape
    gv = dim // scale.shape[1]
    out = []
    for c in range(dim):
        group = c // gv
        w = [float(p[t] * scale[t, group]) if read[t] else 0.0 for t in range(g)]
        top = torch.tensor(max(w), dtype=torch.float32)
        inv = torch.tensor(255.0, dtype=torch.float32) / top
        w8 = [int(torch.round(torch.tensor(x, dtype=torch.float32) * inv)) for x in w]
        step = float(top / 255)
        zero_part = sum(float(p[t] * zero[t, group]) for t in range(g) if read[t])
        out.append(step * sum(w8[t] * int(codes[t, c]) for t in range(g)) + zero_part)
    return out


@pytest.mark.parametrize("bits,g,dim,gv", [(2, 32, 64, 32), (4, 32, 64, 32), (2, 16, 32, 16), (4, 8, 32, 32)])
def test_sums_follow_the_definition(bits, g, dim, gv):
    view = random_value_pages(bits, g, dim, gv, seed=bits + g)
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([[3, 1], [0, 2]])  # [B, m]
    probs = torch.rand(2, 2, 3, 2 * g, generator=gen)  # [H, B, group, m * G]
    quantised = torch.rand(2, 2 * g, generator=gen) > 0.2  # [B, m * G]
    got = int8_value_sums(probs, view, ids, quantised)  # [H, B, group, D]
    for h in range(2):
        for b in range(2):
            for row in range(3):
                want = torch.zeros(dim)
                for m, page in enumerate(ids[b].tolist()):
                    span = slice(m * g, (m + 1) * g)
                    want += torch.tensor(definition_sums(probs[h, b, row, span], view, page, h,
                                                         quantised[b, span].tolist()))
                torch.testing.assert_close(got[h, b, row], want, rtol=1e-5, atol=1e-5)


def test_sums_are_exact_sums_up_to_the_rounding():
    """|int8 - float| <= sum over pages of (step / 2) * sum_t code(t, c) (each w8 is off by
    at most half a step), and the rounding does move the sums (the option is not a no-op)."""
    g, dim = 32, 64
    view = random_value_pages(2, g, dim, 32, seed=5)
    ids = torch.tensor([[2, 0, 3]])
    probs = torch.rand(2, 1, 3, 3 * g, generator=torch.Generator().manual_seed(6))
    quantised = torch.ones(1, 3 * g, dtype=torch.bool)
    got = int8_value_sums(probs, view, ids, quantised)[:, 0]  # [H, group, D]
    codes = unpack_codes(view.v_codes.index_select(1, ids[0]), 2).float()  # [H, m, G, D]
    scale = view.v_scale.index_select(1, ids[0]).float()  # [H, m, G, groups]
    zero = view.v_zero.index_select(1, ids[0]).float()
    values = (codes.view(2, 3, g, 2, 32) * scale[..., None] + zero[..., None]).reshape(2, 3 * g, dim)
    exact = torch.einsum("hqt,htd->hqd", probs[:, 0], values)
    w = probs[:, 0].view(2, 3, 3, g, 1) * scale[:, None]  # [H, group, m, G, groups]
    step = w.amax(dim=-2) / 255  # [H, group, m, groups]
    per_channel = codes.view(2, 3, g, 2, 32).sum(dim=2)  # [H, m, groups, GV]
    bound = (step[..., None] / 2 * per_channel[:, None]).sum(dim=2).reshape(2, 3, dim)
    error = (got - exact).abs()
    assert (error <= bound + 1e-5).all()
    assert error.max() > 1e-5


def test_a_page_with_no_weight_adds_nothing_and_no_nan():
    view = random_value_pages(2, 32, 64, 32)
    view.v_scale[:, 1] = float("nan")  # a page never written
    view.v_zero[:, 1] = float("nan")
    probs = torch.rand(2, 1, 1, 64)
    quantised = torch.tensor([[True] * 32 + [False] * 32])
    got = int8_value_sums(probs, view, torch.tensor([[0, 1]]), quantised)
    want = int8_value_sums(probs[..., :32], view, torch.tensor([[0]]), quantised[:, :32])
    torch.testing.assert_close(got, want)
    tiny = int8_value_sums(torch.full((2, 1, 1, 32), 1e-38), view, torch.tensor([[0]]), quantised[:, :32])
    assert torch.isfinite(tiny).all()  # 255 / max overflows: the page counts as zero weight


def with_value_group(case: dict, gv: int, seed: int = 0) -> dict:
    """The case with value scales and zeros over groups of gv channels (the ones the case
    poisoned with NaN stay NaN)."""
    view: KIVILayerView = case["view"]
    heads, pages, g, groups = view.v_scale.shape
    dim = view.v_codes.shape[-1] * 8 // view.vbits
    gen = torch.Generator().manual_seed(seed)
    poisoned = view.v_scale.isnan().any(dim=-1, keepdim=True).expand(heads, pages, g, dim // gv)
    scale = ((torch.rand(heads, pages, g, dim // gv, generator=gen) * 0.3 + 0.02) * 3 / ((1 << view.vbits) - 1)).half()
    zero = (torch.randn(heads, pages, g, dim // gv, generator=gen) * 0.5).half()
    nan = torch.tensor(float("nan")).half()
    return {**case, "view": dataclasses.replace(view, v_scale=torch.where(poisoned, nan, scale),
                                                v_zero=torch.where(poisoned, nan, zero))}


def kernel_against_pytorch(case: dict, key_dot: str = "float") -> None:
    got = kivi_decode_attention_cpu(**case, key_dot=key_dot, value_dot="int8")
    want = kivi_decode_attention(**case, tile_pages=2, key_dot=key_dot, value_dot="int8")
    floats = kivi_decode_attention(**case, tile_pages=2, key_dot=key_dot)
    view: KIVILayerView = case["view"]
    assert_parity([got], [want], [floats], gv=view.value_group)
    exact = kivi_decode_attention_cpu(**case, key_dot=key_dot)
    difference = (got - exact).abs().max()
    assert 1e-5 < difference < 0.05 * exact.abs().max()  # the rounding shows, and stays small


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("g,dim", [(32, 64), (64, 64), (32, 256), (32, 128), (32, 32), (16, 48), (8, 64)],
                         ids=["G32-vnni", "G64-vnni", "G32-D256-assembled", "G32-D128", "G32-D32", "D48-generic",
                              "G8-generic"])
def test_kernel_equals_the_pytorch_path(bits, g, dim):
    r = max(2 * g, 64)
    kernel_against_pytorch(make_case(lengths_for(r, g), g=g, r=r, dim=dim, bits=bits, seed=bits * 7 + g))


@needs_kernel
@pytest.mark.parametrize("gv", [16, 64])
@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_value_groups(gv, bits):
    """GV = 16 (four groups a head: scalar regrouping of the scales, VNNI sums) and GV = D
    (one group); keys keep their G = 32."""
    case = make_case(lengths_for(64, 32), bits=bits, seed=gv)
    kernel_against_pytorch(with_value_group(case, gv, seed=gv))


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4])
def test_kernel_vnni_sums_with_scalar_weights(bits):
    """Pages of 8 tokens with value groups of 32 channels: the weights take the scalar path
    (G % 16 != 0), the sums the VNNI one (G % 4 == 0, GV % 16 == 0)."""
    case = make_case(lengths_for(16, 8), g=8, r=16, bits=bits, seed=bits + 40)
    kernel_against_pytorch(with_value_group(case, 32, seed=bits))


@needs_kernel
@pytest.mark.parametrize("group", [1, 3, 9])
@pytest.mark.parametrize("window", [None, 100, 333])  # windows past the R = 64 ring: some values quantised
def test_kernel_gqa_groups_and_windows(group, window):
    case = make_case([3, 50, 129, 200, 777], kv_heads=2, group=group, g=32, r=64, window=window, seed=group)
    kernel_against_pytorch(case)


@needs_kernel
def test_kernel_with_int8_keys_too():
    kernel_against_pytorch(make_case(lengths_for(64, 32), seed=11), key_dot="int8")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_split_over_threads(threads):
    with torch_threads(threads):
        kernel_against_pytorch(make_case([5000], kv_heads=1, group=4, residual_dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("options", ["value_dot=int8", "value_dot=int8,key_dot=int8",
                                     "value_dot=int8,key_bits=4,value_bits=2", "value_dot=int8,sinks=4",
                                     "value_dot=int8,rotation=hadamard_values,bits=4", "value_dot=int8,value_group=16"])
@pytest.mark.parametrize("window", [None, 45])
def test_cache_kernels_agree(options, window):
    """Through the cache (prefill chunks, decode, mixed batches, a sliding layer whose window
    reaches past the R = 32 ring): the C++ kernel and the PyTorch path give the same
    attention with the option, and it differs from value_dot=float's only by the rounding."""
    outputs = {kernel: collect(make_cache(options, window, decode_kernel=kernel)) for kernel in ("cpp", "torch")}
    floats = collect(make_cache(options.replace("value_dot=int8", "value_dot=float"), window))
    cache = make_cache(options, window)
    assert_parity(outputs["cpp"], outputs["torch"], floats, gv=cache.config.value_channels)
    gaps = [float((a - b).abs().max()) for a, b in zip(outputs["torch"], floats)]
    assert max(gaps) > 1e-5 and max(gaps) < 0.2


@pytest.mark.parametrize(("spec", "message"), [
    ("kivi:value_dot=int4", "value_dot.*int4.*one of"),
    ("kivi:value_dot=int8,bits=8", "value_dot.*int8.*2- or 4-bit values"),
    ("kivi:value_dot=int8,key_bits=8,value_bits=8", "value_dot.*int8.*2- or 4-bit values"),
    ("kivi:value_dot=int8,group=8192,residual=8192,prefill_tile_tokens=8192,decode_tile_tokens=8192",
     "value_dot.*int8.*4096 tokens"),
    ("kivi:value_dot=int8,decode_kernel=triton", "decode_kernel.*triton.*does not read value_dot=int8"),
])
def test_bad_combinations_fail_clearly(spec, message):
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 64, 0.125)])
    with pytest.raises(ConfigError, match=message):
        create_cache(parse_cache_spec(spec), layout, 1 << 22, torch.float32)


def on(device: str, case: dict) -> dict:
    """The case with every tensor (the view's too) on `device`."""
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    view: KIVILayerView = case["view"]
    fields = {f.name: getattr(view, f.name) for f in dataclasses.fields(view)}
    moved["view"] = dataclasses.replace(view, **{k: v.to(device) for k, v in fields.items()
                                                 if isinstance(v, torch.Tensor)})
    return moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("key_dot,value_dot", [("int8", "float"), ("float", "int8"), ("int8", "int8")])
def test_cuda_pytorch_path_matches_the_cpu(key_dot, value_dot):
    """On CUDA the int8 options take the PyTorch path (Triton reads neither): the same
    definition as on the CPU, up to near-tie roundings and cuBLAS's summation order."""
    case = make_case(lengths_for(64, 32), seed=21)
    want = kivi_decode_attention(**case, tile_pages=2, key_dot=key_dot, value_dot=value_dot)
    floats = kivi_decode_attention(**case, tile_pages=2)
    got = kivi_decode_attention(**on("cuda", case), tile_pages=2, key_dot=key_dot, value_dot=value_dot).cpu()
    assert_parity([got], [want], [floats], gv=32)
