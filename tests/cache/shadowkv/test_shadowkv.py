"""The `shadowkv` cache method on tiny random models: with full rank and a budget covering
every chunk its outputs equal the full cache's (single sequence, batches of different
lengths, mixed exact/compressed steps, multi-token spans on compressed sequences, folding
of generated tokens, Gemma3 sliding layers, AcrossKV), under the engine's scheduler with
preemption; memory accounting; bad configurations."""

from __future__ import annotations

import pytest
import torch
from conftest import across_kv_model, decode_logits, make_pair, make_runner

from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.cache.shadowkv.method import ShadowKVCache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError

# Small geometry: chunks of 4, 8 local tokens, compression from 24 cached tokens, generated
# tokens folded once the tail passes 8 + 8 tokens.
SMALL = "chunk=4,local=8,outliers=2,min_context=24,generated_window=8"


def exact_spec(model, **extra) -> str:
    """Full rank and a budget larger than any sequence: ShadowKV must equal exact attention."""
    layout = model.cache_layout()
    options = {"rank": layout.num_kv_heads * layout.head_dim, "budget": 128, "coefficient_dtype": "compute", **extra}
    return "shadowkv:" + SMALL + "," + ",".join(f"{k}={v}" for k, v in options.items())


LOSSY = "shadowkv:" + SMALL.replace("outliers=2", "outliers=1") + ",rank=3,budget=4"


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid", "llama3_rope", "mistral_window"])
def test_exact_settings_equal_the_full_cache(arch):
    """Prompts of 37, 65 and 10 tokens prefilled together, then 30 batched decode steps: the
    first two are compressed at the end of the prefill, the third stays exact until it
    reaches 24 tokens (mixed exact and compressed sequences in one step), generated tokens
    are folded several times. Logits equal the full cache's to 1e-4 (fp32)."""
    _, model = make_pair(arch)
    prompts = [list(range(3, 40)), list(range(5, 70)), list(range(1, 11))]
    full = decode_logits(make_runner(model), prompts, 30)
    runner = make_runner(model, cache=exact_spec(model))
    ours = decode_logits(runner, prompts, 30)
    torch.testing.assert_close(ours, full, atol=1e-4, rtol=0)
    stats = runner.cache.statistics()
    if arch != "mistral_window":  # every layer of that model slides: nothing to compress
        assert stats["compressions"] == 3 and stats["folded_chunks"] > 10
        assert stats["chunk_hits"] > 0 and stats["slow_bytes"] > 0
        lossy = decode_logits(make_runner(model, cache=LOSSY), prompts, 30)
        assert (lossy - full).abs().max() > 1e-3  # the parity above is not vacuous
    else:
        assert stats["compressions"] == 0


def test_single_sequence_without_reuse_and_with_mmap_values():
    """One sequence, chunk reuse off, values in a memory-mapped file: still exact."""
    _, model = make_pair("llama_gqa")
    prompt = [list(range(2, 50))]
    full = decode_logits(make_runner(model), prompt, 25)
    runner = make_runner(model, cache=exact_spec(model, reuse=0, slow_store="mmap"))
    torch.testing.assert_close(decode_logits(runner, prompt, 25), full, atol=1e-4, rtol=0)
    assert runner.cache.statistics()["chunk_hits"] == 0 and runner.cache.statistics()["compressions"] == 1


def test_pinned_values_on_a_cpu_are_the_memory_store():
    """slow_store=pinned page-locks the slow tier for CUDA only; on a CPU it is a plain
    tensor the decode path reads in place, with the memory store's logits."""
    _, model = make_pair("llama_gqa")
    prompt = [list(range(2, 50))]
    runners = [make_runner(model, cache=exact_spec(model, slow_store=kind)) for kind in ("memory", "pinned")]
    expected, got = (decode_logits(runner, prompt, 12) for runner in runners)
    assert torch.equal(got, expected)
    store = runners[1].cache.store
    assert store.values_in_place and not store.values.is_pinned()
    assert runners[1].cache.start_up_line() is None  # nothing was locked
    store.pinned_seconds = 2.5  # as CUDA would record it
    gib = store.values.numel() * store.values.element_size() / 2**30
    assert runners[1].cache.start_up_line() == (f"ShadowKV's slow tier: {gib:.1f} GiB of RAM page-locked in 2.5 s "
                                                "(slow_store=pinned: the decode kernels read values from it in place)")


def test_a_failed_page_lock_names_the_option(monkeypatch):
    """cudaHostRegister failing (more than the RAM that can be locked) raises naming
    slow_store and the way out; CUDA's error code arrives as torch's enum, which
    cudaGetErrorString takes (a fake runtime here: there is no GPU)."""
    from kvforge.cache.shadowkv.store import register_pinned

    class Status:  # stands for torch's cudaError enum
        def __int__(self) -> int:
            return 2

    status = Status()

    class Runtime:
        def cudaHostRegister(self, pointer: int, size: int, flags: int) -> Status:
            return status

        def cudaGetErrorString(self, error: Status) -> str:
            assert error is status, "given the enum"
            return "out of memory"

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    with pytest.raises(RuntimeError, match="slow_store=pinned.*16 bytes failed .out of memory.*slow_budget"):
        register_pinned(torch.zeros(4), torch.device("cuda", 0))


@pytest.mark.parametrize("answer", [1, 0, None])
def test_page_locking_asks_whether_the_device_reads_the_host_address(monkeypatch, caplog, answer):
    """The kernels read the slow tier at its host address: a device that cannot
    (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 0) is refused before
    anything is locked, naming the store to use; a driver that cannot say is warned of
    (a fake runtime and driver here: there is no GPU)."""
    from kvforge.cache.shadowkv import store

    registered: list[int] = []
    asked: list[tuple[int, int]] = []

    class Runtime:
        def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
            registered.append(pointer)
            return 0

    class Driver:
        def cuDeviceGet(self, handle, ordinal) -> int:
            handle._obj.value = 10 + ordinal.value
            return 0

        def cuDeviceGetAttribute(self, value, attribute, handle) -> int:
            asked.append((attribute.value, handle.value))
            if answer is None:
                return 1  # CUDA_ERROR_INVALID_VALUE
            value._obj.value = answer
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Runtime)
    monkeypatch.setattr(store, "cuda_driver", Driver)
    values = torch.zeros(4)
    if answer == 0:
        with pytest.raises(RuntimeError, match="slow_store=pinned: cuda:1 cannot read .*slow_store=memory"):
            store.register_pinned(values, torch.device("cuda", 1))
        assert registered == []
    else:
        store.register_pinned(values, torch.device("cuda", 1))
        assert registered == [values.data_ptr()]
        assert ("did not say" in caplog.text) == (answer is None)
    assert asked == [(91, 11)]


def test_budget_equal_to_the_candidates_is_exact():
    """Budget = every candidate chunk exactly (10 chunks - 2 outliers = 8 chunks of 4): each
    step's picks fill every reuse slot, the path where decode attention needs no mask."""
    _, model = make_pair("llama_gqa")
    prompts = [list(range(3, 51)), list(range(7, 55))]  # 48 tokens: 40 compressed + 8 local
    full = decode_logits(make_runner(model), prompts, 12)
    runner = make_runner(model, cache=exact_spec(model, budget=32, generated_window=64))
    torch.testing.assert_close(decode_logits(runner, prompts, 12), full, atol=1e-4, rtol=0)
    state = runner.cache._seqs[0].compressed
    assert state.num_chunks - state.num_outliers == state.chunks_per_step == 8
    assert runner.cache.statistics()["chunk_hit_rate"] > 0.9


def test_multi_token_span_on_a_compressed_sequence():
    """After compression, a 6-token span (logits for every token, as perplexity scoring
    does) selects once for its queries and attends causally within itself: exact settings
    give the full cache's logits; then decoding goes on."""
    _, model = make_pair("qwen2_bias")
    runners = [make_runner(model), make_runner(model, cache=exact_spec(model))]
    outputs = []
    for runner in runners:
        logits = [runner.step([StepItem(0, list(range(1, 41)))]), runner.step([StepItem(0, [7])])]
        logits.append(runner.step([StepItem(0, [8, 9, 10, 11, 12, 13], num_logits=6)]))
        logits.append(runner.step([StepItem(0, list(range(20, 37)), num_logits=17)]))  # folds in end_step
        logits += [runner.step([StepItem(0, [t])]) for t in (3, 4, 5)]
        outputs.append(torch.cat(logits))
    assert runners[1].cache.is_compressed(0)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=0)


def test_across_kv_layout_equals_the_full_cache():
    model = across_kv_model()
    assert model.cache_layout().num_cache_layers == 3
    prompts = [list(range(3, 45)), list(range(9, 40))]
    full = decode_logits(make_runner(model), prompts, 20)
    runner = make_runner(model, cache=exact_spec(model))
    torch.testing.assert_close(decode_logits(runner, prompts, 20), full, atol=1e-4, rtol=0)
    assert runner.cache.statistics()["compressions"] == 2


def test_swiftkv_prompt_beside_compressed_decodes_attends_only_its_logit_rows():
    """SwiftKV + AcrossKV, a step that prefills a 31-token prompt (exact) while a compressed
    sequence decodes: logits equal the full cache's, and only layer 0 (before l = 1) attends
    the prompt's rows; the later layers reach the inner cache through attend_rows with the
    one row that needs logits (the generic attend_rows would attend every row)."""
    model = across_kv_model()
    full, runner = make_runner(model), make_runner(model, cache=exact_spec(model))
    cache = runner.cache
    calls: list[int] = []
    inner_attend = cache.exact.attend
    cache.exact.attend = lambda layer, batch, q, rope: calls.append(q.shape[0]) or inner_attend(layer, batch, q, rope)
    steps = [[StepItem(0, list(range(3, 45)))],  # compressed at the end of this step
             [StepItem(0, [7]), StepItem(1, list(range(9, 40)))],  # a decode beside a prompt
             [StepItem(0, [8]), StepItem(1, [9])]]
    for number, items in enumerate(steps):
        calls.clear()
        torch.testing.assert_close(runner.step(items), full.step(items), atol=1e-4, rtol=0)
        if number == 1:
            assert cache.is_compressed(0) and calls == [31]


def _engine(model, spec: str, budget: int, batched_tokens: int = 48) -> LLMEngine:
    cache = create_cache(spec, model.cache_layout(), budget, torch.float32)
    return LLMEngine(model, cache, None, EngineConfig(kv_budget_bytes=budget, max_num_batched_tokens=batched_tokens))


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams.greedy_params(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            if out.finished:
                done[out.request_id] = out.token_ids
    return {i: done[i] for i in ids}


def test_engine_under_a_tight_budget_matches_full():
    """Three prompts, chunked prefill mixed with decode, a budget that forces preemption
    (recompute from scratch, compression again): the greedy outputs equal the full cache's
    (run with room to spare), and everything is freed at the end."""
    _, model = make_pair("llama_gqa")
    prompts = [list(range(1 + i, 26 + 6 * i)) for i in range(3)]
    expected = _generate(_engine(model, "full:block_size=4", 1 << 24, 32), prompts, 60)
    engine = _engine(model, exact_spec(model, block_size=4), 440_000, 32)
    got = _generate(engine, prompts, 60)
    assert list(got.values()) == list(expected.values())
    cache = engine.cache
    # preempted requests were recomputed, at least one of them after it had been compressed
    assert engine.scheduler.num_preemptions > 0 and cache.statistics()["compressions"] > len(prompts)
    engine.clear_prefix_cache()
    assert cache.memory_usage() == {"fast": 0, "slow": 0}


def test_memory_accounting_and_compression_savings():
    """Compression frees the exact pages and keeps far fewer fast bytes; values move to
    the slow tier; sequence_bytes bounds what a sequence holds at every step; allocate is
    all-or-nothing."""
    heads, dim, layers = 2, 16, 3
    layout = CacheLayout.one_per_layer([CacheLayerSpec(heads, dim, dim ** -0.5)] * layers)
    spec = "shadowkv:chunk=8,local=16,outliers=4,min_context=256,generated_window=64,rank=6,budget=32"
    cache = create_cache(spec, layout, 1 << 22, torch.float32)
    assert isinstance(cache, ShadowKVCache)
    _, model = make_pair("llama_gqa")  # 3 layers, 2 KV heads, head_dim 16: the same layout
    runner = make_runner(model, cache=spec, budget=1 << 22)
    cache = runner.cache
    runner.step([StepItem(0, list(range(90)) * 11 + [1, 2], num_logits=0)])  # 992 tokens, no logits: exact
    exact_fast = cache.memory_usage()["fast"]
    assert cache.memory_usage()["slow"] == 0 and exact_fast <= cache.memory.sequence_bytes(992)
    full_bytes = 2 * layers * heads * dim * 4 * 992
    assert exact_fast >= full_bytes
    for step in range(30):
        runner.step([StepItem(0, [step % 90])])
        assert cache.memory_usage()["fast"] <= cache.memory.sequence_bytes(cache.num_cached_tokens(0))
    assert cache.is_compressed(0)
    usage = cache.memory_usage()
    assert usage["fast"] < exact_fast / 2 and usage["slow"] >= (992 - 24) * heads * layers * dim * 4
    stats = cache.statistics()
    assert stats["fast_bytes"] == usage["fast"] and stats["compressed_sequences"] == 1
    assert 0 <= stats["chunk_hit_rate"] <= 1 and stats["seconds_compress"] > 0
    # all-or-nothing: a budget that fits one prompt's exact pages but not two
    small = create_cache(spec, layout, cache.memory.sequence_bytes(100) + 1000, torch.float32)
    assert small.allocate(0, 100) and not small.allocate(1, 100)
    assert small.num_cached_tokens(1) == 0
    small.free(0)
    assert small.memory_usage()["fast"] == 0 and small.allocate(1, 100)
    cache.free(0)
    assert cache.memory_usage() == {"fast": 0, "slow": 0}


def test_bad_configs_fail_naming_the_parameter():
    cases = {"shadowkv:budget=4": "budget.*at least one chunk",
             "shadowkv:budget=12": "budget.*multiple of chunk",
             "shadowkv:chunk=0": "chunk.*>= 1",
             "shadowkv:local=12": "local.*multiple of chunk",
             "shadowkv:min_context=16": "min_context.*local \\+ chunk",
             "shadowkv:generated_window=4": "generated_window",
             "shadowkv:slow_store=disk": "slow_store",
             "shadowkv:slow_budget=lots": "slow_budget",
             "shadowkv:slow_store=pinned,slow_dir=/tmp": "slow_dir.*only applies with slow_store=mmap",
             "shadowkv:rank=0": "rank",
             "shadowkv:rank=fast": "rank.*auto.*paper",
             "shadowkv:energy=0": "energy.*\\(0, 1\\]",
             "shadowkv:energy=1.5": "energy",
             "shadowkv:rank_min=0": "rank_min.*>= 1",
             "shadowkv:budget=most": "budget.*token count.*auto.*paper",
             "shadowkv:layer_budget=-1": "layer_budget",
             "shadowkv:coefficient_dtype=int8": "coefficient_dtype.*float16"}
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            parse_cache_spec(spec)
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 16, 0.25)] * 2)
    with pytest.raises(ConfigError, match="rank.*33.*<= kv_heads x head_dim = 32"):
        create_cache("shadowkv:rank=33", layout, 1 << 24, torch.float32)
    with pytest.raises(ConfigError, match="slow_budget"):
        create_cache("shadowkv:slow_budget=100", layout, 1 << 24, torch.float32)
    default = create_cache("shadowkv", layout, 1 << 24, torch.float32)
    assert default.rank_bounds == (16, 32)  # rank=attention: between rank_min and the KV width
    assert create_cache("shadowkv:rank=paper", layout, 1 << 24, torch.float32).rank_bounds == (5, 5)  # round(32 / 6)
    assert create_cache("shadowkv:rank_min=64", layout, 1 << 24, torch.float32).rank_bounds == (32, 32)
    paper = parse_cache_spec("shadowkv:budget=paper").config()  # max(128, 1.56% of the context)
    assert paper.budget_tokens(1000, 1) == 128 and paper.budget_tokens(16384, 1) == 256
    # auto: at least layer_budget = 512 tokens per layer over its KV heads, in whole chunks
    assert default.config.budget_tokens(1000, 1) == 512 and default.config.budget_tokens(1000, 3) == 176
    assert default.config.budget_tokens(16384, 3) == 256 and default.config.budget_tokens(65536, 1) == 1024
    assert default.config.budget_tokens(1000, 8) == 128


def test_info_lists_shadowkv_fast_and_slow_bytes(tmp_path):
    """`kvforge info` reports shadowkv's fast-tier bytes per token (coefficients + landmark
    share + candidate flags) and per tier per sequence once compressed; exact below
    min_context (2048)."""
    import json

    from kvforge.info import format_info, model_info
    from kvforge.models.hf_checkpoint import CONFIG_FILE

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 8192, "rope_theta": 10000.0}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    info = model_info(str(tmp_path))
    row, full = info["kv_cache"]["shadowkv"], info["kv_cache"]["float32"]
    layers, heads, dim, chunk, rank = 4, 2, 32, 8, 64  # rank=attention (default): at most the KV width, 64
    # float16 coefficients (2 bytes), float32 landmarks, a candidate flag per KV head
    assert row["bytes_per_token"] == pytest.approx(layers * (chunk * rank * 2 + heads * dim * 4 + heads) / chunk)
    # rank=attention only learns ranks at compression: a range from rank_min (16) to the width
    assert row["rank_range"] == [16, 64] and "ranks 16-64 per layer" in format_info(info)
    chunks_8k = (8192 - 32) // chunk
    assert row["bytes_per_sequence"]["8192"] - row["least_bytes_per_sequence"]["8192"] == \
        layers * (64 - 16) * (chunks_8k * chunk * 2 + heads * dim * 4)
    assert row["bytes_per_sequence"]["1024"] == full["bytes_per_sequence"]["1024"]  # not compressed
    assert row["slow_bytes_per_sequence"]["1024"] == 0
    compressed_chunks = (8192 - 32) // chunk  # local = 32 tokens stay exact
    assert row["slow_bytes_per_sequence"]["8192"] == compressed_chunks * layers * heads * chunk * dim * 4
    assert row["least_bytes_per_sequence"]["8192"] < full["bytes_per_sequence"]["8192"] / 3
    assert "shadowkv" in format_info(info) and "slow tier" in format_info(info)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fetch side stream and pinned slow tier)")
def test_cuda_path_with_exact_settings_equals_the_cpu_full_cache():
    """The CUDA path (values fetched from pinned host memory on a side stream while keys are
    rebuilt) against the CPU full cache: the same prompts, compressions and folds as the
    exact-settings test above (torch keeps TF32 off for fp32 matmuls by default)."""
    import copy

    _, model = make_pair("llama_gqa")
    prompts = [list(range(3, 40)), list(range(5, 70)), list(range(1, 11))]
    full = decode_logits(make_runner(model), prompts, 30)
    gpu_model = copy.deepcopy(model).to("cuda")
    cache = create_cache(exact_spec(model), gpu_model.cache_layout(), 1 << 22, torch.float32, device="cuda")
    ours = decode_logits(ModelRunner(gpu_model, cache), prompts, 30).cpu()
    torch.testing.assert_close(ours, full, atol=1e-4, rtol=0)
    stats = cache.statistics()
    assert stats["compressions"] == 3 and stats["chunk_hits"] > 0 and stats["slow_bytes"] > 0
