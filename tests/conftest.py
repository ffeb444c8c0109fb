"""Shared fixtures: tiny random-weight models of each architecture, built both in
transformers (the reference) and in kvforge with the same weights."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace

import pytest
import torch
import transformers
from hypothesis import settings

from kvforge.cache.registry import create_cache
from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import ModelRunner
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv

# Two threads by default (the CI machine's cores); `mutants/run.py --jobs N` runs N pytest
# processes side by side and gives each its share of the cores through this variable.
torch.set_num_threads(int(os.environ.get("KVFORGE_TEST_THREADS", "2")))

# The generator tests (hypothesis) draw the same examples on every run of `make test`, so CI
# cannot fail on a draw no one has seen; `KVFORGE_HYPOTHESIS=explore` draws fresh ones (to
# look for new failures; what it finds gets a fix and, where it is a new class, a test).
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("KVFORGE_HYPOTHESIS", "repeatable"))

# `--dtype auto` (the default of generate, serve and LLM) is bfloat16 on a CPU with bf16
# hardware: the suite pins it to float32 so that its exactness tests mean the same on every CPU
# (subprocesses inherit it); tests/test_compute_dtype.py checks the resolution itself.
os.environ.setdefault("KVFORGE_AUTO_DTYPE", "float32")
# Likewise a bf16 model's prefill products run in bf16, never widened to float32 by a timing
# (kernels/bf16_products.py measures which is faster); tests of the widened form ask for it.
os.environ.setdefault("KVFORGE_BF16_PRODUCTS", "native")

# Without a GPU the Triton kernel runs in Triton's CPU interpreter, so `make test` checks it.
# `triton.jit` reads TRITON_INTERPRET when kvforge.cache.kivi.triton_decode (or
# kvforge.kernels.triton_jit, for the other Triton kernels) is imported, and
# kvforge imports that module only when a cache may use the kernel (decode_kernels.py), never
# at import: setting the variable here, before any test, is in time (asserted). It stays set
# for the session, as Triton expects (it reads it again while interpreting), and subprocesses
# inherit it; nothing else reads it: only the Triton kernel does, and only caches with
# decode_kernel=triton (or auto on CUDA) import it. With CUDA the kernel tests run compiled;
# without triton they skip. setdefault keeps a value the caller chose (0 turns them off).
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    assert not {"kvforge.cache.kivi.triton_decode", "kvforge.kernels.triton_jit"} & set(sys.modules), \
        "a Triton kernel was imported before TRITON_INTERPRET was set: it will not run interpreted"

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            max_position_embeddings=1024)

# name -> (transformers config class, overrides). Chosen to cover GQA, QKV bias, llama3
# RoPE scaling, Mistral sliding window and Gemma3's hybrid layers.
ARCHITECTURES = {
    "llama_gqa": (transformers.LlamaConfig, dict(num_hidden_layers=3, num_key_value_heads=2)),
    "llama3_rope": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, num_key_value_heads=1, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64))),
    "smollm2_tied": (transformers.LlamaConfig, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                    tie_word_embeddings=True)),
    "qwen2_bias": (transformers.Qwen2Config, dict(num_hidden_layers=2, num_key_value_heads=2)),
    "mistral_window": (transformers.MistralConfig, dict(num_hidden_layers=2, num_key_value_heads=2,
                                                        sliding_window=12)),
    "gemma3_hybrid": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=32, sliding_window=10,
        query_pre_attn_scalar=24, sliding_window_pattern=2)),
}


def make_pair(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers model, kvforge model) with identical random weights, fp32."""
    config_cls, overrides = ARCHITECTURES[name]
    torch.manual_seed(seed)
    hf_config = config_cls(**{**TINY, **overrides})
    hf_config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    state = hf.state_dict()
    for key in state:  # give norms and biases non-trivial values
        if "norm" in key or key.endswith("bias"):
            state[key] = torch.randn_like(state[key]) * 0.2 + (0 if "gemma" in name else 1.0) * ("norm" in key)
    hf.load_state_dict(state)
    ours = build_model(config_from_hf_dict(hf_config.to_dict()), dtype=torch.float32)
    ours.load_hf_state_dict(hf.state_dict())
    return hf, ours


def make_runner(model, cache: str = "full:block_size=4", budget: int = 1 << 22) -> ModelRunner:
    return ModelRunner(model, create_cache(cache, model.cache_layout(), budget, torch.float32))


ACROSS_KV = SwiftKVConfig(1, 2)


def across_kv_model(swiftkv: SwiftKVConfig = ACROSS_KV, name: str = "llama_gqa"):
    """A 5-layer SwiftKV model of architecture `name` (by default l = 1, AcrossKV groups of 2:
    3 cache layers), random weights; later layers attend through attend_rows."""
    base = make_pair(name)[1]
    config = replace(base.config, num_layers=5, layer_types=(), swiftkv=swiftkv)
    plain = build_model(replace(config, swiftkv=None))
    torch.manual_seed(4)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    state.update(initial_swiftkv_tensors(state, plain.config, config.swiftkv))
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(state, config))
    return model


def decode_logits(runner: ModelRunner, prompts: list[list[int]], steps: int, decode: bool = False) -> torch.Tensor:
    """Prefill the prompts together, then decode `steps` batched tokens (marked as generated
    with `decode`, which SwiftKV's early exit needs); logits [steps, B, V]."""
    from kvforge.engine.runner import StepItem

    runner.step([StepItem(seq, prompt) for seq, prompt in enumerate(prompts)])
    return torch.stack([runner.step([StepItem(seq, [(5 * step + seq) % 90], decode=decode)
                                     for seq in range(len(prompts))]) for step in range(steps)])


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture
def tiny_sources(monkeypatch):
    """`kvforge bench serve`'s model lookups answered by the tiny server model's tokenizer and
    config (tests/server_helpers.py), so a bench runs against a tiny in-process server."""
    from server_helpers import char_tokenizer

    from kvforge.tools.bench import serve as bench_serve

    tokenizer = char_tokenizer()
    config = config_from_hf_dict({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
                                  "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                                  "num_hidden_layers": 2, "max_position_embeddings": 512})
    monkeypatch.setattr(bench_serve, "resolve_model_source", lambda name, load_format="auto": name)
    monkeypatch.setattr(bench_serve, "load_model_config", lambda source: config)
    monkeypatch.setattr(bench_serve, "heldout_text", lambda path: "a held-out text. " * 200)
    monkeypatch.setattr("kvforge.models.tokenizer.load_tokenizer", lambda source: tokenizer)
    return tokenizer
