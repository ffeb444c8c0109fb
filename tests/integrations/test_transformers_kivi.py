"""kvforge.integrations.transformers.KIVICache on tiny random Llama models: it works inside
`generate`, follows the residual rules, stores exactly what kvforge.cache.kivi.quant gives, and
with 8 bits stays close to transformers' DynamicCache."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvforge.cache.kivi.quant import dequantize, quantize
from kvforge.errors import ConfigError
from kvforge.integrations.transformers import KIVICache, KIVICacheConfig, KIVILayer, cache_argument


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a shared machine mostly wait on thread wake-ups: use one, then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llama(seed: int = 0, head_dim: int = 32) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=96,
                                      num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                      max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).eval()


def test_generate_runs_with_kivi_cache():
    model = tiny_llama()
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = KIVICache(bits=2, group=16, residual=32, config=model.config)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_argument(cache), max_new_tokens=50,
                             min_new_tokens=50, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 90)
    # the last generated token is never fed back: 40 + 49 tokens stored
    assert cache.get_seq_length() == 89
    layer = cache.layers[0]
    assert (layer.quantized_key_tokens, layer.residual_key_tokens) == (64, 25)
    assert (layer.quantized_value_tokens, layer.residual_value_tokens) == (57, 32)
    assert cache.stored_bytes() > 0


def _step_logits(model, ids: torch.Tensor, cache, prefill: int) -> torch.Tensor:
    """Logits of every position: a prefill of `prefill` tokens, then one token per call."""
    with torch.inference_mode():
        rows = [model(input_ids=ids[:, :prefill], **cache_argument(cache), use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            rows.append(model(input_ids=ids[:, t:t + 1], **cache_argument(cache), use_cache=True).logits)
    return torch.cat(rows, dim=1)


def test_eight_bit_logits_close_to_dynamic_cache_and_two_bit_further():
    model = tiny_llama()
    ids = torch.randint(0, 96, (1, 120), generator=torch.Generator().manual_seed(2))
    reference = _step_logits(model, ids, DynamicCache(config=model.config), 20)
    eight = _step_logits(model, ids, KIVICache(bits=8, group=16, residual=32, config=model.config), 20)
    two = _step_logits(model, ids, KIVICache(bits=2, group=16, residual=32, config=model.config), 20)
    err8 = (eight - reference).abs().max().item()
    err2 = (two - reference).abs().max().item()
    # prefill rows attend to their own exact K/V: identical to the reference
    assert torch.equal(eight[:, :20], reference[:, :20])
    assert err8 < 2e-2 * reference.abs().max().item()
    assert err2 > 4 * err8  # the error grows as bits shrink: quantisation really happens


@pytest.mark.parametrize("residual,group", [(32, 16), (64, 32), (16, 16)])
def test_residual_sizes_follow_the_rules(residual: int, group: int):
    layer = KIVILayer(KIVICacheConfig(bits=2, group=group, residual=residual))
    generator = torch.Generator().manual_seed(3)
    chunks = [1, 7, 1, 1, 40, 3, 1, 1, 100, 1] + [1] * 60 + [250, 1, 2, 1]
    n = 0
    for size in chunks:
        layer.update(torch.randn(1, 2, size, 32, generator=generator), torch.randn(1, 2, size, 32, generator=generator))
        n += size
        assert layer.get_seq_length() == n
        assert layer.quantized_key_tokens == (n // residual) * residual
        assert layer.residual_key_tokens == n % residual
        assert layer.quantized_value_tokens == max(0, n - residual)
        assert layer.residual_value_tokens == min(n, residual)


def test_stored_keys_and_values_equal_kvforge_quant():
    layer = KIVILayer(KIVICacheConfig(bits=4, group=16, residual=32))
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 150, 32, generator=generator)
    values = torch.randn(2, 3, 150, 32, generator=generator)
    for start, end in [(0, 50), (50, 51), (51, 90), *[(t, t + 1) for t in range(90, 150)]]:
        out_k, out_v = layer.update(keys[:, :, start:end], values[:, :, start:end])
        # this call's own tokens come back exactly
        assert torch.equal(out_k[:, :, start:end], keys[:, :, start:end])
        assert torch.equal(out_v[:, :, start:end], values[:, :, start:end])
    nk, nv = layer.quantized_key_tokens, layer.quantized_value_tokens
    assert (nk, nv) == (128, 118)
    expected_k = dequantize(quantize(keys[:, :, :nk].transpose(-1, -2), 4, 16)).transpose(-1, -2)
    expected_v = dequantize(quantize(values[:, :, :nv], 4, 16))
    assert torch.equal(layer.dequantized_keys(), expected_k)
    assert torch.equal(layer.dequantized_values(), expected_v)
    assert torch.equal(layer.keys, keys[:, :, nk:])
    assert torch.equal(layer.values, values[:, :, nv:])
    # what the next call attends to: stored past (dequantised + exact residual), then itself
    new_k, new_v = torch.randn(2, 3, 1, 32), torch.randn(2, 3, 1, 32)
    out_k, out_v = layer.update(new_k, new_v)
    assert torch.equal(out_k, torch.cat([expected_k, keys[:, :, nk:], new_k], dim=-2))
    assert torch.equal(out_v, torch.cat([expected_v, values[:, :, nv:], new_v], dim=-2))


def test_bad_configs_fail_clearly():
    with pytest.raises(ConfigError, match="bits"):
        KIVICache(bits=3)
    with pytest.raises(ConfigError, match="residual"):
        KIVICache(group=32, residual=48)
    layer = KIVILayer(KIVICacheConfig(bits=2, group=32, residual=64))
    with pytest.raises(ConfigError, match="head_dim"):
        layer.update(torch.randn(1, 1, 4, 48), torch.randn(1, 1, 4, 48))
    mistral = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=2, sliding_window=12)
    with pytest.raises(ConfigError, match="full-attention"):
        KIVICache(config=mistral)
