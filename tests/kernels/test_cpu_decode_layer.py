"""The fused decoder-layer op (kernels/cpu_decode_layer.py, chosen by models/fused_decode.py)
against the eager layer: bitwise
equal logits over prefill + many decode steps on every Llama-family architecture, in float32
and bfloat16, with SwiftKV models (earlier layers as the prefix; the later ones:
test_cpu_decode_later_layers.py), and the rules that
keep it off (prefill steps, a recording step timer, float8 pages, more than MAX_ROWS rows,
Gemma3 layers, the switch)."""

from __future__ import annotations

import pytest
import torch
from conftest import across_kv_model, decode_logits, make_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.kernels import cpu_decode_layer
from kvforge.kernels.cpu_decode_layer import decode_layer_available
from kvforge.models import fused_decode
from kvforge.step_timing import StepTimer, recording

requires_kernel = pytest.mark.skipif(
    not decode_layer_available(),
    reason="the fused decoder-layer op could not be built (see the logged warning) or "
           "KVFORGE_DISABLE_CPU_KERNELS is set")

LLAMA_FAMILY = ["llama_gqa", "llama3_rope", "smollm2_tied", "qwen2_bias", "mistral_window"]
# Long enough that the Mistral window (12) drops pages during the decode steps.
PROMPTS = [list(range(3, 30)), [7, 8], list(range(40, 52))]


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records, for every step, the batch size of each layer that the fused op computed."""
    calls: list[int] = []
    original = fused_decode.fused_prefix

    def spy(layers, rope_index, hidden, cache, meta, ropes, stop, layer_class):
        out, done = original(layers, rope_index, hidden, cache, meta, ropes, stop, layer_class)
        calls.extend([hidden.shape[0]] * done)
        return out, done

    monkeypatch.setattr("kvforge.models.llama.fused_prefix", spy)
    return calls


def runner_for(model: torch.nn.Module, dtype: torch.dtype, cache: str = "full:block_size=4") -> ModelRunner:
    return ModelRunner(model, create_cache(cache, model.cache_layout(), 1 << 22, dtype))


def fused_and_eager(model: torch.nn.Module, dtype: torch.dtype, cache: str = "full:block_size=4",
                    prompts: list[list[int]] = PROMPTS, steps: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    logits = []
    for enabled in (True, False):
        cpu_decode_layer.set_enabled(enabled)
        try:
            logits.append(decode_logits(runner_for(model, dtype, cache), prompts, steps))
        finally:
            cpu_decode_layer.set_enabled(True)
    return logits[0], logits[1]


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_fused_layer_equals_the_eager_layer_bitwise(name: str, dtype: torch.dtype, fused_calls: list[int]) -> None:
    model = make_pair(name)[1].to(dtype)
    fused, eager = fused_and_eager(model, dtype)
    layers = model.config.num_layers
    # Every layer of every decode step (and no prefill step) went through the op.
    assert fused_calls == [len(PROMPTS)] * (14 * layers)
    assert torch.equal(fused, eager)


@requires_kernel
def test_float16_pages_under_a_float32_model(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    fused, eager = fused_and_eager(model, torch.float32, cache="full:block_size=4,storage_dtype=float16")
    assert fused_calls
    assert torch.equal(fused, eager)


@requires_kernel
def test_swiftkv_model_fuses_its_earlier_layers_as_the_prefix(fused_calls: list[int]) -> None:
    model = across_kv_model()  # 5 layers, l = 1: layer 0 is a plain layer, 1-4 SwiftKV later layers
    fused, eager = fused_and_eager(model, torch.float32)
    assert fused_calls == [len(PROMPTS)] * 14
    assert torch.equal(fused, eager)


@requires_kernel
def test_gemma3_layers_are_not_fused(fused_calls: list[int]) -> None:
    model = make_pair("gemma3_hybrid")[1]
    decode_logits(runner_for(model, torch.float32), PROMPTS, steps=2)
    assert fused_calls == []


@requires_kernel
def test_float8_pages_and_the_torch_kernel_are_not_fused(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    for cache in ("full:block_size=4,storage_dtype=float8_e4m3fn", "full:block_size=4,decode_kernel=torch"):
        decode_logits(runner_for(model, torch.float32, cache), PROMPTS, steps=2)
    assert fused_calls == []


@requires_kernel
def test_more_rows_than_the_small_m_kernel_takes_are_not_fused(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    many = [[3 + i, 4 + i] for i in range(cpu_decode_layer.cpu_linear.MAX_ROWS + 1)]
    fused, eager = fused_and_eager(model, torch.float32, prompts=many, steps=2)
    assert fused_calls == []
    assert torch.equal(fused, eager)


@requires_kernel
def test_mixed_prefill_and_decode_step_is_not_fused(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    runner = runner_for(model, torch.float32)
    runner.step([StepItem(0, list(range(3, 12)))])
    runner.step([StepItem(0, [5]), StepItem(1, list(range(20, 26)))])  # one decode row beside a prefill
    assert fused_calls == []
    runner.step([StepItem(0, [6]), StepItem(1, [7])])
    assert fused_calls == [2] * model.config.num_layers


@requires_kernel
def test_not_fused_while_a_step_timer_records(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    runner = runner_for(model, torch.float32)
    runner.step([StepItem(0, list(range(3, 12)))])
    timer = StepTimer()
    with recording(timer):  # the runner then hands the model a TimedCache
        runner.step([StepItem(0, [5])])
    assert fused_calls == []
    assert timer._current.get("linear", 0.0) > 0 and timer._current.get("attention", 0.0) > 0


def test_switch_turns_it_off(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    cpu_decode_layer.set_enabled(False)
    try:
        decode_logits(runner_for(model, torch.float32), PROMPTS, steps=2)
    finally:
        cpu_decode_layer.set_enabled(True)
    assert fused_calls == []


@requires_kernel
def test_hooks_and_caches_that_offer_no_target_get_the_eager_layers(fused_calls: list[int]) -> None:
    """What the op would skip: a forward hook on a layer's module; a cache (here a wrapper
    that sees every write) whose `fused_decode_target` offers nothing. A wrapper that only
    forwards hands out the wrapped cache's targets and is fused."""
    model = make_pair("llama_gqa")[1]
    seen: list[int] = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: seen.append(1))
    try:
        fused, eager = fused_and_eager(model, torch.float32, steps=3)
    finally:
        handle.remove()
    assert fused_calls == [len(PROMPTS)] * 3  # layer 0 only: the run stops at the hooked layer
    assert len(seen) == 2 * 4  # the hook fired on every step of both runs (1 prefill + 3 decode)
    assert torch.equal(fused, eager)

    # The op runs only where the cache offers a target: a wrapper that sees every write
    # (as a tool recording K/V would) says it offers none, and gets every write.
    class Forwarding:
        def __init__(self, cache):
            self._cache = cache

        def __getattr__(self, name):
            return getattr(self._cache, name)

    class CountingWrites(Forwarding):
        def __init__(self, cache):
            super().__init__(cache)
            self.writes: list[int] = []

        def write(self, layer, *args):
            self.writes.append(layer)
            return self._cache.write(layer, *args)

        def fused_decode_target(self, cache_layer, meta):
            return None

    fused_calls.clear()
    runner = runner_for(model, torch.float32)
    runner.cache = counting = CountingWrites(runner.cache)
    counted = decode_logits(runner, PROMPTS, steps=2)
    assert fused_calls == [] and len(counting.writes) == 3 * model.config.num_layers
    # A wrapper that changes nothing hands out the wrapped cache's targets: fused, same logits.
    runner = runner_for(model, torch.float32)
    runner.cache = Forwarding(runner.cache)
    assert torch.equal(decode_logits(runner, PROMPTS, steps=2), counted)
    assert fused_calls == [len(PROMPTS)] * (2 * model.config.num_layers)


# kivi: small groups and residuals, so keys flush and values leave the window during the steps.
KIVI_CACHES = ["kivi:group=4,residual=8", "kivi:bits=4,group=4,residual=8,sinks=2",
               "kivi:group=4,residual=8,key_dot=int8,value_dot=int8"]


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", KIVI_CACHES)
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "mistral_window"])
def test_fused_layer_over_kivi_equals_the_eager_layer_bitwise(name: str, cache: str, dtype: torch.dtype,
                                                              fused_calls: list[int]) -> None:
    model = make_pair(name)[1].to(dtype)
    fused, eager = fused_and_eager(model, dtype, cache=cache, steps=20)
    # Every layer of every decode step went through the op, flushes and window slides included.
    assert fused_calls == [len(PROMPTS)] * (20 * model.config.num_layers)
    assert torch.equal(fused, eager)


@requires_kernel
def test_kivi_settings_the_op_does_not_compute_run_eagerly(fused_calls: list[int]) -> None:
    model = make_pair("llama_gqa")[1]
    for cache in ("kivi:group=4,residual=8,key_space=pre_rope", "kivi:group=4,residual=8,rotation=hadamard",
                  "kivi:group=4,residual=8,decode_kernel=torch"):
        decode_logits(runner_for(model, torch.float32, cache), PROMPTS, steps=2)
    assert fused_calls == []
