"""SwiftKV's later layers in the fused decoder-layer op (kernels/cpu_decode_layer.py's
given-K/V entry, chosen by models/fused_decode.py::fused_given_kv): bitwise equal logits to
the eager later layers over prefill + decode steps, with and without AcrossKV, in float32 and
bfloat16, with q biases; the op is taken for every later layer of every decode step; and
what keeps it off (early exit, a hook, a step whose rows do not all sample, more than
MAX_ROWS rows, a step timer, a cache that offers no given K/V, the switch)."""

from __future__ import annotations

import pytest
import torch
from conftest import across_kv_model, decode_logits
from test_cpu_decode_layer import PROMPTS, fused_and_eager, requires_kernel, runner_for

from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import StepItem
from kvforge.kernels import cpu_decode_layer
from kvforge.models import fused_decode
from kvforge.step_timing import StepTimer, recording

# 5 layers: l = 1 with AcrossKV groups of 2 (later layers 1-4 on 2 cache layers), l = 2
# without AcrossKV (later layers 2-4, one cache layer each).
SWIFTKV = {"across_kv": SwiftKVConfig(1, 2), "single_input_kv": SwiftKVConfig(2, 1)}


@pytest.fixture
def later_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records (rows, later layers the op computed) for every step that asked for the run."""
    calls: list[tuple[int, int]] = []
    original = fused_decode.fused_given_kv

    def spy(layers, rope_index, hidden, cache, meta, ropes, start, layer_class, attention_class):
        out, done = original(layers, rope_index, hidden, cache, meta, ropes, start, layer_class, attention_class)
        if done:
            calls.append((hidden.shape[0], done))
        return out, done

    monkeypatch.setattr("kvforge.models.llama_swiftkv.fused_given_kv", spy)
    return calls


def later_layers(model: torch.nn.Module) -> int:
    return model.config.num_layers - model.config.swiftkv.num_key_value_layers


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias"])
@pytest.mark.parametrize("swiftkv", sorted(SWIFTKV))
def test_later_layers_fused_equal_the_eager_layers_bitwise(swiftkv: str, name: str, dtype: torch.dtype,
                                                           later_calls: list[tuple[int, int]]) -> None:
    model = across_kv_model(SWIFTKV[swiftkv], name).to(dtype)
    fused, eager = fused_and_eager(model, dtype)
    # Every later layer of every decode step (and no prefill step) went through one op call.
    assert later_calls == [(len(PROMPTS), later_layers(model))] * 14
    assert torch.equal(fused, eager)


def generated_logits(model: torch.nn.Module, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused, eager) logits of decode steps whose tokens are marked generated (early exit
    applies to those only)."""
    logits = []
    for enabled in (True, False):
        cpu_decode_layer.set_enabled(enabled)
        try:
            logits.append(decode_logits(runner_for(model, torch.float32), PROMPTS, steps, decode=True))
        finally:
            cpu_decode_layer.set_enabled(True)
    return logits[0], logits[1]


@requires_kernel
def test_early_exit_keeps_the_eager_later_layers(later_calls: list[tuple[int, int]]) -> None:
    """A model with early exit on chooses its rows per step on the host: its later layers
    stay eager (whether or not a row exits), and observing only keeps them eager too."""
    model = across_kv_model(SwiftKVConfig(1, 2, early_exit_head=True))
    fused, eager = generated_logits(model, steps=3)
    assert later_calls == [(len(PROMPTS), 4)] * 3 and torch.equal(fused, eager)
    later_calls.clear()
    for threshold, exits in ((1.0, False), (1e-6, True)):  # 1e-6: every decode row exits
        model.set_early_exit(threshold)
        model.early_exit_counts.exited = 0
        fused, eager = generated_logits(model, steps=3)
        assert later_calls == [] and torch.equal(fused, eager)
        assert (model.early_exit_counts.exited > 0) == exits
    model.set_early_exit(None)
    model.early_exit_probe = []
    fused, eager = generated_logits(model, steps=2)
    assert later_calls == [] and torch.equal(fused, eager) and model.early_exit_probe


@requires_kernel
def test_a_hooked_later_layer_ends_the_run(later_calls: list[tuple[int, int]]) -> None:
    model = across_kv_model()
    seen: list[int] = []
    handle = model.model.layers[3].mlp.register_forward_hook(lambda *args: seen.append(1))
    try:
        fused, eager = fused_and_eager(model, torch.float32, steps=3)
    finally:
        handle.remove()
    assert later_calls == [(len(PROMPTS), 2)] * 3  # layers 1 and 2; 3 and 4 eager
    assert len(seen) == 2 * 4  # every step of both runs, prefill included
    assert torch.equal(fused, eager)


@requires_kernel
def test_a_decode_step_whose_rows_do_not_all_sample_is_not_fused(later_calls: list[tuple[int, int]]) -> None:
    """Later layers run on the logit rows only; the op takes them only when they are every
    row of the step in order (what the cache's plan covers)."""
    model = across_kv_model()
    logits = []
    for enabled in (True, False):
        cpu_decode_layer.set_enabled(enabled)
        try:
            runner = runner_for(model, torch.float32)
            runner.step([StepItem(seq, prompt) for seq, prompt in enumerate(PROMPTS)])
            logits.append(runner.step([StepItem(0, [5]), StepItem(1, [6], num_logits=0), StepItem(2, [7])]))
            logits.append(runner.step([StepItem(seq, [9]) for seq in range(len(PROMPTS))]))
        finally:
            cpu_decode_layer.set_enabled(True)
    assert later_calls == [(len(PROMPTS), 4)]  # the second decode step only
    assert all(torch.equal(a, b) for a, b in zip(logits[:2], logits[2:]))


@requires_kernel
def test_more_rows_than_the_small_m_kernel_takes_and_a_step_timer_keep_it_off(
        later_calls: list[tuple[int, int]]) -> None:
    model = across_kv_model()
    many = [[3 + i, 4 + i] for i in range(cpu_decode_layer.cpu_linear.MAX_ROWS + 1)]
    fused, eager = fused_and_eager(model, torch.float32, prompts=many, steps=2)
    assert later_calls == [] and torch.equal(fused, eager)
    runner = runner_for(model, torch.float32)
    runner.step([StepItem(0, list(range(3, 12)))])
    with recording(StepTimer()):
        runner.step([StepItem(0, [5])])
    assert later_calls == []


@requires_kernel
def test_caches_without_given_kv_and_the_switch_keep_the_eager_later_layers(
        later_calls: list[tuple[int, int]]) -> None:
    """KIVI fuses the earlier layers but offers no given-K/V run; float8 pages offer no target."""
    model = across_kv_model()
    for cache in ("kivi:group=4,residual=8", "full:block_size=4,storage_dtype=float8_e4m3fn"):
        fused, eager = fused_and_eager(model, torch.float32, cache=cache, steps=3)
        assert torch.equal(fused, eager)
    cpu_decode_layer.set_enabled(False)
    try:
        decode_logits(runner_for(model, torch.float32), PROMPTS, steps=2)
    finally:
        cpu_decode_layer.set_enabled(True)
    assert later_calls == []
