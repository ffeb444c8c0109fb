"""A bf16 model's prefill products widened to float32 (kvforge/kernels/bf16_products.py): the
verdict (override, measured rule, cached once), and the widened forms of the packed linear and
the causal attention kernel, each against its definition: the bf16 operands widened exactly,
multiplied in float32, the result rounded to bf16 once."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import make_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.errors import ConfigError
from kvforge.kernels import bf16_products as products_module
from kvforge.kernels.bf16_products import (
    ENV,
    WIDEN_MARGIN,
    Bf16Products,
    bf16_products,
    measure_bf16_products,
)
from kvforge.kernels.cpu_causal_attention import causal_attention_available
from kvforge.kernels.cpu_prepack import (
    drop_packed,
    onednn_packs,
    packed_linear,
    prepack_available,
    prepack_weights,
)
from kvforge.kernels.prefill_attention import causal_attention

PLENTY = 1 << 40
needs_prepack = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN packed linear ops")
needs_kernel = pytest.mark.skipif(
    not (causal_attention_available(torch.bfloat16) and causal_attention_available(torch.float32)),
    reason="the causal attention kernel needs AVX512-BF16 and AVX-512F")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An unmeasured process on a machine with nothing remembered: the cached verdict cleared,
    the suite's pin lifted, the verdict file in a scratch directory."""
    monkeypatch.setattr(products_module, "_cached", None)
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(products_module, "verdict_path", lambda: tmp_path / products_module.VERDICT_FILE)
    return monkeypatch


def _stub_timings(monkeypatch, linear: tuple[float, float], attention: tuple[float, float]) -> list[str]:
    """Stands in for both timings; returns the list each timing appends its name to."""
    timed: list[str] = []
    monkeypatch.setattr(products_module, "_linear_seconds", lambda: timed.append("linear") or linear)
    monkeypatch.setattr(products_module, "_attention_seconds", lambda: timed.append("attention") or attention)
    return timed


def test_a_machines_first_verdict_is_taken_by_every_later_process(fresh):
    """A later process (the per-process cache cleared) takes the remembered verdict even where
    its own timing would decide otherwise, so one command prints the same text run after run."""
    timed = _stub_timings(fresh, (1.0, 0.5), (1.0, 0.99))
    first = bf16_products()
    assert (first.linear, first.attention) == (True, False) and timed == ["linear", "attention"]
    fresh.setattr(products_module, "_cached", None)
    timed = _stub_timings(fresh, (1.0, 0.99), (1.0, 0.5))  # this process would measure the reverse
    later = bf16_products()
    assert (later.linear, later.attention) == (True, False) and timed == []
    assert later.why.startswith(first.why) and "remembered from" in later.why and f"${ENV}=measure" in later.why


def test_measure_measures_again_and_the_next_process_takes_that(fresh):
    _stub_timings(fresh, (1.0, 0.5), (1.0, 0.99))
    bf16_products()
    fresh.setattr(products_module, "_cached", None)
    fresh.setenv(ENV, "measure")
    timed = _stub_timings(fresh, (1.0, 0.99), (1.0, 0.5))
    again = bf16_products()
    assert (again.linear, again.attention) == (False, True) and timed == ["linear", "attention"]
    fresh.setattr(products_module, "_cached", None)
    fresh.delenv(ENV)
    assert (bf16_products().linear, bf16_products().attention) == (False, True)


def test_a_verdict_with_an_unmeasured_product_is_not_kept(fresh):
    """A process whose kernel did not build (or was turned off) decides for itself only: the
    next process, with the kernel, measures."""
    fresh.setattr(products_module, "_linear_seconds", lambda: (1.0, 0.5))
    fresh.setattr(products_module, "_attention_seconds", lambda: None)
    assert "attention unmeasured" in bf16_products().why
    fresh.setattr(products_module, "_cached", None)
    timed = _stub_timings(fresh, (1.0, 0.99), (1.0, 0.5))
    assert (bf16_products().linear, bf16_products().attention) == (False, True) and timed == ["linear", "attention"]


def test_another_thread_count_or_an_unreadable_file_is_measured_afresh(fresh):
    _stub_timings(fresh, (1.0, 0.5), (1.0, 0.99))
    bf16_products()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        fresh.setattr(products_module, "_cached", None)
        timed = _stub_timings(fresh, (1.0, 0.99), (1.0, 0.5))
        assert not bf16_products().linear and timed == ["linear", "attention"]
    finally:
        torch.set_num_threads(threads)
    products_module.verdict_path().write_text("{not json")
    fresh.setattr(products_module, "_cached", None)
    timed = _stub_timings(fresh, (1.0, 0.99), (1.0, 0.99))
    assert bf16_products() == Bf16Products(False, False, bf16_products().why) and timed == ["linear", "attention"]
    assert "remembered" not in bf16_products().why


def test_the_environment_overrides_the_measurement(monkeypatch):
    monkeypatch.setenv(ENV, "native")
    assert bf16_products() == Bf16Products(False, False, f"${ENV}=native")
    monkeypatch.setenv(ENV, "FLOAT32")
    verdict = bf16_products()
    assert verdict.linear and verdict.attention
    assert "linear layers and attention of bf16 models run in float32" in verdict.describe()
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ConfigError, match=f"{ENV}='fast'.*'auto', 'native', 'float32'"):
        bf16_products()


@pytest.mark.parametrize("linear,attention,widened", [
    ((1.0, WIDEN_MARGIN), (1.0, WIDEN_MARGIN + 0.01), (True, False)),  # at the margin widens, above not
    ((1.0, 0.99), (2.0, 1.0), (False, True)),
    (None, None, (False, False)),                                       # no kernel: bf16 as it is
])
def test_float32_is_chosen_only_when_it_is_clearly_faster(fresh, linear, attention, widened):
    fresh.setattr(products_module, "_linear_seconds", lambda: linear)
    fresh.setattr(products_module, "_attention_seconds", lambda: attention)
    verdict = measure_bf16_products()
    assert (verdict.linear, verdict.attention) == widened
    assert verdict.why.startswith("measured on this CPU")
    if linear is None:
        assert "linear unmeasured" in verdict.why and "attention unmeasured" in verdict.why
    else:
        assert f"linear bf16 / float32 time {linear[0] / linear[1]:.2f}x" in verdict.why


def test_auto_measures_once_per_process_whatever_the_threads(fresh):
    calls = []

    def slow_measurement() -> Bf16Products:  # long enough for every thread to ask meanwhile
        calls.append(1)
        time.sleep(0.2)
        return Bf16Products(True, False, "measured")

    fresh.setattr(products_module, "measure_bf16_products", slow_measurement)
    threads = [threading.Thread(target=bf16_products) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bf16_products().linear and len(calls) == 1


@needs_prepack
@needs_kernel
def test_the_real_measurement_times_both_products(fresh):
    verdict = bf16_products()
    assert "linear bf16 / float32 time" in verdict.why and "attention bf16 / float32 time" in verdict.why


@needs_prepack
def test_the_linear_product_is_timed_where_onednn_cannot_pack_bf16(monkeypatch):
    """On an AVX2-only CPU the native form is F.linear on the plain weight (7x the widened
    form's time on an AMD EPYC here): it is timed as such, not left unmeasured (which kept
    bf16 prefills on the slow form)."""
    from kvforge.kernels import cpu_prepack
    real = cpu_prepack.onednn_packs
    monkeypatch.setattr(cpu_prepack, "onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))
    timed = []
    monkeypatch.setattr(products_module, "_best_seconds", lambda fn: timed.append(fn()) or 1.0)
    assert products_module._linear_seconds() == (1.0, 1.0)
    assert [t.dtype for t in timed] == [torch.bfloat16, torch.bfloat16] and torch.allclose(
        timed[0].float(), timed[1].float(), rtol=2 ** -6, atol=1e-2)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return ((torch.randn(96, 64, generator=generator) * 0.1).bfloat16(),
            (torch.randn(96, generator=generator) * 0.1).bfloat16())


@needs_prepack
def test_a_widened_copy_is_the_float32_product_of_the_bf16_values_rounded_once():
    weight, bias = _weights()
    report = prepack_weights([weight], "on", PLENTY, widen_bf16=True)
    assert report.widened == 1 and report.bytes == weight.numel() * 4  # float32 copy
    assert "1 bf16 weights packed as float32" in report.describe()
    x = torch.randn(3, 50, 64).bfloat16()
    for b in (bias, None):
        out = packed_linear(x, weight, b)
        assert out.dtype == torch.bfloat16 and out.shape == (3, 50, 96)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        once = exact.to(torch.bfloat16).double()
        # one rounding of a float32 sum: within one bf16 step of the exact value rounded
        assert torch.allclose(out.double(), once, rtol=2 ** -7, atol=1e-6)
    drop_packed([weight])


@needs_prepack
def test_a_copy_in_the_other_form_is_packed_again():
    weight, bias = _weights()
    prepack_weights([weight], "on", PLENTY)
    again = prepack_weights([weight], "on", PLENTY, widen_bf16=True)
    assert again.reused == 0 and again.widened == 1
    assert prepack_weights([weight], "on", PLENTY, widen_bf16=True).reused == 1
    float_weight = weight.float()
    assert prepack_weights([float_weight], "on", PLENTY, widen_bf16=True).widened == 0  # float32 is as it is
    drop_packed([weight, float_weight])


def _qkv(n: int = 70, m: int = 70, heads: int = 4, kv_heads: int = 2):
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(n, heads, 64, generator=generator).bfloat16()
    k, v = (torch.randn(kv_heads, m, 64, generator=generator).bfloat16() for _ in range(2))
    return q, k, v


@needs_kernel
def test_widened_attention_is_the_float32_kernel_on_the_bf16_values(monkeypatch):
    q, k, v = _qkv(n=40, m=70)
    monkeypatch.setenv(ENV, "float32")
    out, lse = causal_attention(q, k, v, 0.125)
    wide_out, wide_lse = torch.ops.kvforge_cpu_causal.causal_attention(q.float(), k.float(), v.float(), 0.125)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide_out.to(torch.bfloat16)) and torch.equal(lse, wide_lse)
    # a few queries (a decode step's, a short chunk's) keep the bf16 kernel: widening the whole
    # K/V for them would cost more than it gains
    few = q[:8]
    assert torch.equal(causal_attention(few, k, v, 0.125)[0], torch.ops.kvforge_cpu_causal.causal_attention(
        few, k, v, 0.125)[0])
    monkeypatch.setenv(ENV, "native")
    native, _ = causal_attention(q, k, v, 0.125)
    assert torch.equal(native, torch.ops.kvforge_cpu_causal.causal_attention(q, k, v, 0.125)[0])
    # both against the definition (float64 softmax over the visible keys)
    group = q.shape[1] // k.shape[0]
    kk, vv = (t.double().repeat_interleave(group, dim=0) for t in (k, v))
    offset = k.shape[1] - q.shape[0]
    scores = torch.einsum("nhd,hmd->hnm", q.double(), kk) * 0.125
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(q.shape[0])[:, None] + offset
    reference = torch.einsum("hnm,hmd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv)
    assert (out.double() - reference).abs().max() <= (native.double() - reference).abs().max() + 2 ** -8


@needs_prepack
@needs_kernel
def test_an_engine_on_a_bf16_model_says_what_it_measured_and_packs_accordingly(monkeypatch):
    _, model = make_pair("llama_gqa")
    model = model.to(torch.bfloat16)
    monkeypatch.setenv(ENV, "float32")
    cache = create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.bfloat16)
    engine = LLMEngine(model, cache, None, EngineConfig(1 << 22, max_num_batched_tokens=128, prepack_weights="on"))
    assert "run in float32" in engine.bf16_report
    assert engine.prepack_report.widened == engine.prepack_report.weights > 0
    # the start-up line says what was done: without the copies the linear layers stay bf16
    off = LLMEngine(model, create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.bfloat16), None,
                    EngineConfig(1 << 22, prepack_weights="off"))
    assert "linear layers stay bf16" in off.bf16_report and "linear layers and" not in off.bf16_report
    float_model = make_pair("llama_gqa")[1]
    cache32 = create_cache("full:block_size=4", float_model.cache_layout(), 1 << 22, torch.float32)
    engine32 = LLMEngine(float_model, cache32, None, EngineConfig(1 << 22, prepack_weights="on"))
    assert engine32.bf16_report is None and engine32.prepack_report.widened == 0


@needs_prepack
def test_a_prompt_sized_mlp_keeps_float32_between_its_widened_products():
    from kvforge.kernels.cpu_linear import MAX_ROWS, widened_input
    from kvforge.models.layers import GatedMLP
    torch.manual_seed(0)
    mlp = GatedMLP(64, 96, "silu", bias=False, dtype=torch.bfloat16)
    weights = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    x = torch.randn(MAX_ROWS + 8, 64).bfloat16()
    with torch.no_grad():
        bf16_chain = mlp(x)  # no copies yet: the bf16 chain
        prepack_weights(weights, "on", PLENTY, widen_bf16=True)
        out = mlp(x)
        g, u, d = (w.float() for w in weights)
        x32 = x.float()
        chain32 = (F.silu(x32 @ g.T) * (x32 @ u.T) @ d.T).to(torch.bfloat16)
        g64, u64, d64 = (w.double() for w in weights)
        exact = F.silu(x.double() @ g64.T) * (x.double() @ u64.T) @ d64.T
    assert out.dtype == torch.bfloat16
    # the float32 chain rounded once: equal but for a rare last-bit tie of the summation order
    # (a bf16 rounding of the activations between the products leaves about 60% equal)
    assert torch.allclose(out.float(), chain32.float(), rtol=2 ** -7, atol=1e-3)
    assert (out == chain32).float().mean() >= 0.95
    assert (out.double() - exact).abs().mean() < (bf16_chain.double() - exact).abs().mean()
    # decode-sized rows, autograd and weights without a widened copy keep x as it is
    assert widened_input(x, weights[0]) is x  # the weight needs its gradient here
    with torch.no_grad():
        assert widened_input(x[:MAX_ROWS], weights[0]).dtype == torch.bfloat16
        assert widened_input(x, weights[0]).dtype == torch.float32
        drop_packed(weights)
        assert widened_input(x, weights[0]) is x


@needs_prepack
def test_auto_packs_bf16_copies_where_float32_ones_would_not_fit():
    weight, _ = _weights()
    bf16_bytes = weight.numel() * 2
    fits_bf16_only = int(bf16_bytes / 0.25) + 1  # AUTO_MEMORY_SHARE of it holds the bf16 copy, not the float32
    report = prepack_weights([weight], "auto", fits_bf16_only, widen_bf16=True)
    if onednn_packs(torch.bfloat16):
        assert report.weights == 1 and report.widened == 0 and report.bytes == bf16_bytes
    else:  # an AVX2-only CPU: oneDNN has no bf16 copy to fall back on
        assert report.weights == 0 and "would take more than" in report.skipped
    drop_packed([weight])


@needs_prepack
@needs_kernel
@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_a_widened_prefill_computes_the_bf16_model_within_its_rounding(monkeypatch, arch):
    """The whole model, prompts longer than the small-M path, native bf16 against widened
    (every product of a layer: q/k/v from one widened x, the float32 MLP chain, attention):
    logits agree to bf16's rounding, and the widened run really took the widened products."""
    from conftest import decode_logits

    from kvforge.engine.runner import ModelRunner
    from kvforge.kernels import cpu_prepack
    _, model = make_pair(arch)
    model = model.to(torch.bfloat16)
    prompts = [list(range(3, 43)), list(range(50, 95))]

    def logits(mode: str) -> torch.Tensor:
        monkeypatch.setenv(ENV, mode)
        prepack_weights(model.prefill_linear_weights(), "on", PLENTY, widen_bf16=mode == "float32")
        cache = create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.bfloat16)
        with torch.no_grad():
            return decode_logits(ModelRunner(model, cache), prompts, steps=2).float()

    native = logits("native")
    calls = []
    real = cpu_prepack._widened_product
    monkeypatch.setattr(cpu_prepack, "_widened_product", lambda *a: calls.append(1) or real(*a))
    widened = logits("float32")
    layers = len(model.model.layers)
    assert len(calls) >= 7 * layers  # q, k, v, o, gate, up, down of every layer (the prompt steps)
    scale = native.abs().max()
    assert (widened - native).abs().max() <= 0.05 * scale
    assert (widened - native).abs().mean() <= 0.01 * scale
    drop_packed(model.prefill_linear_weights())


@needs_prepack
def test_a_projection_whose_copy_went_stale_takes_x_as_it_is():
    """q/k/v share one widened x; a k_proj changed since packing has no widened copy and must
    get the bf16 x (F.linear refuses a float32 x with a bf16 weight)."""
    from kvforge.kernels.cpu_linear import MAX_ROWS, linear_from, widened_input
    q_weight, _ = _weights(0)
    k_weight, _ = _weights(1)
    prepack_weights([q_weight, k_weight], "on", PLENTY, widen_bf16=True)
    with torch.no_grad():
        k_weight.mul_(2)  # stale copy
        x = torch.randn(MAX_ROWS + 4, 64).bfloat16()
        wide = widened_input(x, q_weight)
        assert wide.dtype == torch.float32
        k = linear_from(x, wide, k_weight, None)
        q = linear_from(x, wide, q_weight, None)
    assert k.dtype == q.dtype == torch.bfloat16
    assert torch.equal(k, F.linear(x, k_weight))
    drop_packed([q_weight, k_weight])
