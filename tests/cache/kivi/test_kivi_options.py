"""KIVI options beyond the paper (key_space, sinks, key_group/value_group, rotation):
attention equals the reference over storage built from each option's *definition* (not
read back from the cache), in fp32 at 1e-5, through prefill chunks, decode batches and
mixed batches, GQA and a sliding-window layer; 8-bit pre-RoPE keys stay within 8-bit error
of the full cache on models; byte accounting; bad combinations refused."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from kivi_helpers import step_batch

from kvforge.cache.attention import reference_attention
from kvforge.cache.kivi.method import KIVICache
from kvforge.cache.kivi.quant import dequantize, quantize
from kvforge.cache.kivi.rotation import hadamard_matrix
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.config import RopeConfig
from kvforge.errors import ConfigError
from kvforge.rope import RotaryEmbedding

HEADS, KV_HEADS, DIM, G, R = 6, 2, 16, 8, 32
ROTARY = RotaryEmbedding(DIM, RopeConfig(theta=100.0))  # fast rotation: positions matter


def make_cache(options: str, window: int | None, decode_kernel: str = "torch") -> KIVICache:
    specs = [CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5), CacheLayerSpec(KV_HEADS, DIM, DIM ** -0.5, window)]
    spec = (f"kivi:group={G},residual={R},residual_dtype=float32,decode_kernel={decode_kernel},"
            f"prefill_tile_tokens=16,decode_tile_tokens=16,{options}")
    cache = create_cache(spec, CacheLayout.one_per_layer(specs), 1 << 22, torch.float32)
    assert isinstance(cache, KIVICache)
    return cache


class Definition:
    """What a sequence stores under the options, computed from exact pre-RoPE keys and values
    [n, H, D] by the definitions (README / docs/cache-methods.md), as attention reads it."""

    def __init__(self, cache: KIVICache) -> None:
        c = cache.config
        self.kbits, self.vbits, self.kg, self.vg, self.sinks = c.kbits, c.vbits, c.key_tokens, c.value_channels, c.sinks
        self.pre = c.key_space == "pre_rope"
        h = hadamard_matrix(DIM)
        self.k_rot = h if c.rotates_keys else torch.eye(DIM)
        self.v_rot = h if c.rotates_values else torch.eye(DIM)

    def past(self, k_pre: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k_pre.shape[0]
        pos = torch.arange(n)
        post = rope(k_pre, pos)
        stored_k = (k_pre if self.pre else post) @ self.k_rot
        stored_v = v @ self.v_rot
        nk, nv = (n // R) * R, max(0, n - R)
        k_hat, v_hat = stored_k.clone(), stored_v.clone()
        if nk:
            ranged = stored_k[:nk].clone()
            first_page_end = (self.sinks // self.kg + 1) * self.kg
            if self.sinks % self.kg and first_page_end <= nk:  # sinks share a page with later tokens
                ranged[self.sinks // self.kg * self.kg:self.sinks] = stored_k[self.sinks]
            pages = ranged.reshape(nk // self.kg, self.kg, KV_HEADS, DIM).permute(0, 2, 3, 1)
            deq = dequantize(quantize(pages, self.kbits, self.kg)).permute(0, 3, 1, 2).reshape(nk, KV_HEADS, DIM)
            k_hat[:nk] = deq
        if nv:
            v_hat[:nv] = dequantize(quantize(stored_v[:nv], self.vbits, self.vg))
        s = min(self.sinks, n)
        k_hat[:s], v_hat[:s] = stored_k[:s], stored_v[:s]  # exact
        keys = k_hat @ self.k_rot.T
        keys = rope(keys, pos) if self.pre else keys
        return keys, v_hat @ self.v_rot.T


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return ROTARY.at(positions, torch.float32).apply(x)


def run_and_check(cache: KIVICache, window: int | None, schedule: list[dict[int, int]]) -> int:
    """Run the schedule through both layers; check the sliding layer (1) against the
    definition. Returns the number of sequences checked."""
    torch.manual_seed(0)
    definition = Definition(cache)
    history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    checked = 0
    for lengths in schedule:
        ids = list(lengths)
        work = {s: (torch.randn(m, HEADS, DIM), torch.randn(m, KV_HEADS, DIM) * 2 + 1, torch.randn(m, KV_HEADS, DIM))
                for s, m in lengths.items()}
        batch, cached = step_batch(cache, lengths)
        positions = torch.cat([torch.arange(n, n + lengths[s]) for s, n in zip(ids, cached)])
        step_rope = ROTARY.at(positions, torch.float32)
        q = step_rope.apply(torch.cat([work[s][0] for s in ids]))
        k = torch.cat([work[s][1] for s in ids])
        v = torch.cat([work[s][2] for s in ids])
        meta = cache.begin_step(batch)
        for layer in (0, 1):
            cache.write(layer, meta, k, v, step_rope)
            out = cache.attend(layer, meta, q, step_rope)
        cache.end_step(meta)
        for seq, n, span in zip(ids, cached, batch.spans):
            q_s, k_s, v_s = work[seq]
            old_k, old_v = history.get(seq, (torch.empty(0, KV_HEADS, DIM), torch.empty(0, KV_HEADS, DIM)))
            past_k, past_v = definition.past(old_k, old_v)
            pos = torch.arange(n, n + k_s.shape[0])
            keys = torch.cat((past_k, rope(k_s, pos)))
            vals = torch.cat((past_v, v_s))
            want = reference_attention(rope(q_s, pos), keys, vals, pos, torch.arange(keys.shape[0]), DIM ** -0.5,
                                       window)
            torch.testing.assert_close(out[span.query_start:span.query_end], want, rtol=1e-5, atol=1e-5)
            history[seq] = (torch.cat((old_k, k_s)), torch.cat((old_v, v_s)))
            checked += 1
    return checked


SCHEDULE = ([{0: 50, 1: 9}, {0: 1, 1: 1}, {0: 1, 1: 30, 2: 70}, {0: 1, 1: 1, 2: 1}]
            + [{0: 1, 1: 1, 2: 1}] * 25 + [{0: 45, 1: 1, 2: 1}, {0: 1, 1: 1, 2: 1}])
OPTIONS = [
    "sinks=4",  # sinks share the first key page with later tokens
    "sinks=12",  # a whole page of sinks and part of the next
    "key_space=pre_rope",
    "rotation=hadamard",
    "rotation=hadamard_keys",
    "rotation=hadamard_values",
    "key_group=16,value_group=4",
    "key_bits=4,value_bits=2",
    "key_bits=2,value_bits=8",
    "key_space=pre_rope,rotation=hadamard,sinks=4,key_group=16,value_group=4,bits=4",
]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("window", [None, 20])
def test_options_equal_attention_over_their_own_dequantised_storage(options, window):
    cache = make_cache(options, window)
    assert run_and_check(cache, window, SCHEDULE) > 80
    assert min(cache.num_cached_tokens(s) for s in range(3)) > 2 * R  # past flushes and slides


@pytest.mark.parametrize("options", ["rotation=hadamard", "rotation=hadamard_values", "sinks=4", "sinks=12",
                                     "key_group=16,value_group=4,sinks=3,rotation=hadamard,bits=4",
                                     "key_bits=4,value_bits=2,sinks=4,value_group=16",
                                     "key_space=pre_rope", "key_space=pre_rope,sinks=12,bits=4",
                                     "key_space=pre_rope,key_bits=4,value_bits=2,sinks=4,rotation=hadamard_values"])
@pytest.mark.parametrize("window", [None, 20])
def test_options_on_the_compiled_cpu_kernel(options, window):
    """The C++ decode kernel reads sinks, separate value groups and pre-RoPE keys (rotated
    in registers) itself; rotations live in the method (q, k, v rotated around the kernel):
    same attention as the definition."""
    from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available

    if not cpu_kivi_kernel_available():
        pytest.skip("the C++ KIVI kernel did not build here")
    cache = make_cache(options, window, decode_kernel="cpp")
    assert run_and_check(cache, window, SCHEDULE) > 80


def test_the_definition_is_lossy_so_the_parity_is_not_vacuous():
    """Each option changes what is stored: 2-bit attention over the definition differs from
    exact attention, and the options differ from the paper's setting."""
    torch.manual_seed(1)
    k, v = torch.randn(100, KV_HEADS, DIM) * 2 + 1, torch.randn(100, KV_HEADS, DIM)
    exact = rope(k, torch.arange(100))
    paper = Definition(make_cache("bits=2", None)).past(k, v)
    assert (paper[0] - exact).abs().max() > 0.1
    for options in OPTIONS:
        keys, values = Definition(make_cache(options, None)).past(k, v)
        assert (keys - paper[0]).abs().max() > 1e-3 or (values - paper[1]).abs().max() > 1e-3, options


def test_sinks_are_exact_and_excluded_from_their_page_range():
    torch.manual_seed(2)
    k, v = torch.randn(64, KV_HEADS, DIM), torch.randn(64, KV_HEADS, DIM)
    k[:2] *= 50  # outlier sinks: left in the page's range they would flatten its codes
    with_sinks = Definition(make_cache("sinks=2", None)).past(k, v)
    without = Definition(make_cache("bits=2", None)).past(k, v)
    exact = rope(k, torch.arange(64))
    torch.testing.assert_close(with_sinks[0][:2], exact[:2])
    err_with = (with_sinks[0][2:G] - exact[2:G]).abs().max()
    err_without = (without[0][2:G] - exact[2:G]).abs().max()
    assert err_with < err_without / 5


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_pre_rope_8bit_decode_matches_full_cache(arch):
    """Models end to end: 8-bit pre-RoPE keys (with sinks, separate groups and a rotation)
    stay within 8-bit error of the full cache, past sliding windows and several flushes."""
    _, model = make_pair(arch)
    prompts = [list(range(3, 40)), list(range(5, 12)), list(range(1, 60))]
    spec = "kivi:bits=8,group=8,residual=16,key_space=pre_rope,sinks=3,value_group=4,rotation=hadamard"
    full = decode_logits(make_runner(model), prompts, 40)
    kivi = decode_logits(make_runner(model, cache=spec), prompts, 40)
    assert torch.isfinite(kivi).all()
    assert (full - kivi).abs().max() < 0.02 * full.abs().max()
    two_bit = decode_logits(make_runner(model, cache=spec.replace("bits=8", "bits=2")), prompts, 40)
    assert (full - two_bit).abs().max() > (full - kivi).abs().max()


def test_bytes_count_sinks_and_value_groups():
    layout = CacheLayout.one_per_layer([CacheLayerSpec(KV_HEADS, DIM, 0.25)] * 3)
    base = create_cache(f"kivi:group={G},residual={R},residual_dtype=float16", layout, 1 << 22, torch.float32)
    sinks = create_cache(f"kivi:group={G},residual={R},residual_dtype=float16,sinks=8", layout, 1 << 22,
                         torch.float32)
    assert isinstance(base, KIVICache) and isinstance(sinks, KIVICache)
    assert sinks.residual_bytes - base.residual_bytes == 2 * 3 * KV_HEADS * 8 * DIM * 2
    fine = create_cache(f"kivi:group={G},residual={R},value_group=4", layout, 1 << 22, torch.float32)
    assert isinstance(fine, KIVICache)
    # per page and layer and head: codes 2 * G * D * 2 / 8, key params 2 * D * 2, value params 2 * G * D/4 * 2
    assert fine.page_bytes == 3 * KV_HEADS * (2 * G * DIM * 2 // 8 + 2 * DIM * 2 + 2 * G * (DIM // 4) * 2)
    assert fine.page_bytes > base.page_bytes
    mixed = create_cache(f"kivi:group={G},residual={R},key_bits=4,value_bits=2", layout, 1 << 22, torch.float32)
    assert isinstance(mixed, KIVICache)
    assert mixed.page_bytes == 3 * KV_HEADS * (G * DIM * (4 + 2) // 8 + 2 * DIM * 2 + 2 * G * (DIM // G) * 2)
    assert sinks.memory.capacity["fast"] <= 1 << 22


@pytest.mark.parametrize(("spec", "message"), [
    ("kivi:sinks=-1", "sinks.*-1.*>= 0"),
    ("kivi:key_space=rope", "key_space.*rope.*one of"),
    ("kivi:rotation=random", "rotation.*random.*one of"),
    ("kivi:key_group=20", "residual.*128.*multiple of key_group=20"),
    ("kivi:key_group=3", "key_group.*3.*whole bytes"),
    ("kivi:preset=best", "preset.*best.*one of"),
    ("kivi:preset=paper2,bits=4", "bits.*4.*set by preset=paper2"),
    ("kivi:preset=quality2,bits=4", "bits.*4.*no effect under preset=quality2, which sets key_bits and value_bits"),
    ("kivi:preset=quality3,group=64", "group.*64.*no effect under preset=quality3"),
    ("kivi:preset=paper2,key_bits=4,value_bits=4", "key_bits.*4.*preset=paper2 \\(which sets bits\\) has no effect"),
    ("kivi:decode_kernel=triton,sinks=4", "decode_kernel.*triton.*does not read sinks"),
    ("kivi:decode_kernel=cpp,key_bits=2,value_bits=4", "decode_kernel.*cpp.*key_bits=2,value_bits=4"),
    ("kivi:key_bits=3", "key_bits.*3.*one of"),
    ("kivi:decode_kernel=cpp,key_space=pre_rope,rotation=hadamard_keys",
     "decode_kernel.*cpp.*key_space=pre_rope with a key rotation"),
])
def test_bad_option_combinations_fail_clearly(spec, message):
    layout = CacheLayout.one_per_layer([CacheLayerSpec(KV_HEADS, 64, 0.125)])
    with pytest.raises(ConfigError, match=message):
        create_cache(parse_cache_spec(spec), layout, 1 << 22, torch.float32)


def test_options_that_need_the_model_fail_when_the_cache_is_built():
    odd = CacheLayout.one_per_layer([CacheLayerSpec(KV_HEADS, 48, 0.25)])
    with pytest.raises(ConfigError, match="rotation.*power of two.*head_dim=48"):
        create_cache("kivi:group=16,rotation=hadamard", odd, 1 << 22, torch.float32)
    with pytest.raises(ConfigError, match="value_group.*32.*divide head_dim=48"):
        create_cache("kivi:group=16,value_group=32", odd, 1 << 22, torch.float32)
