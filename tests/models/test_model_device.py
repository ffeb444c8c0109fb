"""Model state follows the module: `.to(device)` moves every tensor a model holds (weights,
buffers, RoPE frequencies, derived copies), adds no state-dict key, and a moved model runs.

The meta device stands in for CUDA on this CPU-only torch: a tensor left behind by `.to()`
stays on the CPU, where a forward on the new device fails the same way it would on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import ARCHITECTURES, make_pair
from torch import nn

from kvforge.cache.registry import create_cache
from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.models.registry import build_model
from kvforge.rope import rope_inverse_frequencies


def reachable_tensors(obj, path: str = "model", seen: set[int] | None = None):
    """(path, tensor) for every tensor reachable from `obj`: parameters, buffers, and plain
    attributes of modules and of kvforge objects (a RoPE table kept in a plain attribute or
    list would not follow `.to()`, and this walk would still find it)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from reachable_tensors(value, f"{path}.{key}", seen)
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from reachable_tensors(value, f"{path}[{index}]", seen)
    elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("kvforge."):
        for key, value in vars(obj).items():
            yield from reachable_tensors(value, f"{path}.{key}", seen)


def swiftkv_tiny():
    """A 5-layer llama with l = 1 and AcrossKV groups of 2 (random weights)."""
    base = make_pair("llama_gqa")[1]
    config = replace(base.config, num_layers=5, layer_types=(), swiftkv=SwiftKVConfig(1, 2))
    torch.manual_seed(0)
    return build_model(config)


def tiny(name: str):
    return swiftkv_tiny() if name == "swiftkv" else make_pair(name)[1]


MODELS = [*sorted(ARCHITECTURES), "swiftkv"]


def run_steps(model, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 6-token prefill and one decode step, with the `full` cache on `device`
    (its PyTorch decode path: the C++ kernel reads CPU memory)."""
    cache = create_cache("full:decode_kernel=torch,block_size=4", model.cache_layout(), 1 << 22, torch.float32,
                         device)
    runner = ModelRunner(model, cache)
    prefill = runner.step([StepItem(0, [5, 6, 7, 8, 9, 10])])
    return prefill, runner.step([StepItem(0, [11])])


@pytest.mark.parametrize("name", MODELS)
def test_every_tensor_a_model_holds_follows_to_meta(name):
    model = tiny(name)
    run_steps(model, "cpu")  # fills derived state (SwiftKV's fused K/V weight) before the move
    keys = set(model.state_dict())
    model.to("meta")
    left = [path for path, tensor in reachable_tensors(model) if not tensor.is_meta]
    assert not left, f"left on the CPU by .to('meta'): {left}"
    assert all(rotary.inv_freq.is_meta for rotary in model.rotaries)
    assert set(model.state_dict()) == keys and not any("inv_freq" in key for key in keys)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3_hybrid"])
def test_a_model_moved_to_meta_runs_prefill_and_decode_there(name):
    # Not SwiftKV: `full`'s attend_rows reads logit_rows back to the host
    # (ForwardBatch.trailing_counts), which a meta tensor cannot give.
    model = tiny(name).to("meta")
    prefill, decode = run_steps(model, "meta")
    assert prefill.is_meta and decode.is_meta
    assert prefill.shape == decode.shape == (1, model.config.vocab_size)


def test_rope_frequencies_stay_exact_float32_through_dtype_casts():
    _, model = make_pair("llama3_rope")
    exact = rope_inverse_frequencies(model.config.head_dim, model.config.rope)
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16  # read from the weights
    assert torch.equal(model.rotaries[0].inv_freq, exact)  # not rounded to bfloat16 and back
    model.to(torch.float64)
    assert model.dtype == torch.float64
    table = model.rotaries[0]
    assert table.inv_freq.dtype == torch.float32 and torch.equal(table.inv_freq, exact)
    cos, _ = table.cos_sin(torch.arange(3), torch.float64)
    assert cos.dtype == torch.float64


@pytest.mark.parametrize("name", MODELS)
def test_a_model_built_on_a_device_holds_every_tensor_there(name):
    config = tiny(name).config
    model = build_model(config, device="meta")
    left = [path for path, tensor in reachable_tensors(model) if not tensor.is_meta]
    assert not left, f"built on the CPU despite device='meta': {left}"
