"""`rank=attention`: a layer's rank from the change low-rank keys make to the attention of
the prompt's last queries (attention_rank.py, query_samples.py).

The error is checked against a direct re-statement of its definition (SVD basis, explicit
RoPE, per-row softmax, exact keys where compression keeps them); the chosen rank against
the error it promises; the queries the cache records against the rows the step holds; and
end to end, a target no low rank can meet keeps every layer at full width, so outputs
equal the full cache's, on plain, sliding-window and SwiftKV (AcrossKV) models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import across_kv_model, decode_logits, make_pair, make_runner
from test_shadowkv import exact_spec

from kvforge.batch import ForwardBatch
from kvforge.cache.shadowkv.attention_rank import AttentionProbe, QuerySample, attention_rank
from kvforge.cache.shadowkv.config import RANK_STEP, ShadowKVConfig
from kvforge.cache.shadowkv.query_samples import QuerySampler
from kvforge.config import RopeConfig
from kvforge.errors import ConfigError
from kvforge.rope import RotaryEmbedding

HEADS, GROUP, DIM, N, M = 2, 2, 8, 48, 5


def _probe(seed: int, exact_share: float = 0.3) -> AttentionProbe:
    generator = torch.Generator().manual_seed(seed)
    width = HEADS * DIM
    # Keys with a decaying spectrum, so low ranks lose something but not everything.
    left, _ = torch.linalg.qr(torch.randn(N, width, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(width, width, generator=generator))
    keys_pre = left @ torch.diag(torch.tensor([3.0 * 0.8 ** i for i in range(width)])) @ right.T * math.sqrt(N)
    rope = RotaryEmbedding(DIM, RopeConfig(theta=100.0)).at(torch.arange(1), torch.float32)
    keys_post = rope.apply_at(keys_pre.view(N, HEADS, DIM), torch.arange(N)).transpose(0, 1).contiguous()
    values = torch.randn(HEADS, N, DIM, generator=generator)
    exact = torch.rand(HEADS, N, generator=generator) < exact_share
    positions = torch.arange(N - M, N)
    queries = rope.apply_at(torch.randn(M, HEADS * GROUP, DIM, generator=generator), positions)
    _, _, vh = torch.linalg.svd(keys_pre)
    return AttentionProbe(keys_pre, vh, keys_post, values, exact, QuerySample(queries, positions), rope, 0.3)


def _rotate(x: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE of one head vector [D] at `position`, written out pair by pair (theta 100)."""
    half = DIM // 2
    out = torch.empty_like(x)
    for i in range(half):
        angle = position * 100.0 ** (-2 * i / DIM)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def _error_by_definition(probe: AttentionProbe, rank: int) -> float:
    basis = probe.directions[:rank].double()
    approx_pre = (probe.keys_pre.double() @ basis.T @ basis).view(N, HEADS, DIM)
    exact_out, approx_out = [], []
    for i in range(M):
        position = int(probe.sample.positions[i])
        for head in range(HEADS * GROUP):
            kv = head // GROUP
            q = probe.sample.queries[i, head].double()
            keys = torch.stack([probe.keys_post[kv, t].double() if probe.exact[kv, t]
                                else _rotate(approx_pre[t, kv], t) for t in range(position + 1)])
            true_keys = probe.keys_post[kv, :position + 1].double()
            values = probe.values[kv, :position + 1].double()
            exact_out.append(torch.softmax(true_keys @ q * probe.scale, 0) @ values)
            approx_out.append(torch.softmax(keys @ q * probe.scale, 0) @ values)
    exact, approx = torch.stack(exact_out), torch.stack(approx_out)
    return float(torch.linalg.norm(approx - exact) / torch.linalg.norm(exact))


@pytest.mark.parametrize(("seed", "rank"), [(0, 3), (1, 8), (2, 13)])
def test_the_error_is_the_definitions(seed, rank):
    probe = _probe(seed)
    measured = probe.error(rank)
    assert measured == pytest.approx(_error_by_definition(probe, rank), rel=1e-4, abs=1e-6)
    assert measured > 1e-3  # the low rank does change attention here


def test_full_rank_or_every_key_exact_changes_nothing():
    probe = _probe(3)
    assert probe.error(HEADS * DIM) < 1e-5
    everything_exact = _probe(3, exact_share=1.1)
    assert everything_exact.error(1) == 0.0
    assert attention_rank(everything_exact, 1e-3, least=2, step=4) == 2


@pytest.mark.parametrize("target", [0.03, 0.1, 0.3])
def test_the_chosen_rank_meets_the_target_and_the_next_smaller_candidate_does_not(target):
    probe = _probe(4)
    least, step = 2, 3
    rank = attention_rank(probe, target, least, step)
    candidates = sorted({min(HEADS * DIM, r) for r in range(least, HEADS * DIM + step, step)})
    assert probe.error(rank) <= target
    index = candidates.index(rank)
    assert index == 0 or probe.error(candidates[index - 1]) > target
    assert least < rank < HEADS * DIM  # the targets sit inside the range


def test_the_sampler_keeps_the_last_rows_of_compressing_spans():
    batch = ForwardBatch.build([7, 9], [list(range(30)), list(range(4))], [0, 10])
    q = torch.arange(34, dtype=torch.float32).view(34, 1, 1).expand(34, 2, 3)
    sampler = QuerySampler(limit=16)
    sampler.record(0, batch, batch.spans, q)
    first = sampler.sample(0, 7)
    assert first.queries[:, 0, 0].tolist() == list(range(14, 30)) and first.positions.tolist() == list(range(14, 30))
    second = sampler.sample(0, 9)
    assert second.queries[:, 0, 0].tolist() == [30, 31, 32, 33] and second.positions.tolist() == [10, 11, 12, 13]
    # attend_rows: q holds only the asked rows; a second call on the layer adds its rows.
    rows = torch.tensor([29, 33])
    sampler.record(0, batch, batch.spans, q[rows] + 100, rows)
    assert sampler.sample(0, 7).queries[:, 0, 0].tolist()[-1] == 129
    assert sampler.sample(0, 9).positions.tolist() == [10, 11, 12, 13, 13]
    assert sampler.sample(1, 7) is None
    off = QuerySampler(enabled=False)  # other rank rules read no queries: nothing is kept
    off.record(0, batch, batch.spans, q)
    assert off.sample(0, 7) is None


@pytest.mark.parametrize("model_kind", ["llama_gqa", "gemma3_hybrid", "across_kv"])
def test_an_unreachable_target_keeps_full_rank_and_equals_the_full_cache(model_kind):
    model = across_kv_model() if model_kind == "across_kv" else make_pair(model_kind)[1]
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    prompts = [list(range(3, 40)), list(range(5, 70))]
    full = decode_logits(make_runner(model), prompts, 12)
    spec = exact_spec(model, rank="attention", attention_error=1e-9, rank_min=1)
    runner = make_runner(model, cache=spec)
    torch.testing.assert_close(decode_logits(runner, prompts, 12), full, atol=1e-4, rtol=0)
    stats = runner.cache.statistics()
    assert stats["compressions"] == 2 and stats["rank_mean"] == width


def test_a_loose_target_lowers_the_rank_and_an_absent_sample_falls_back_to_energy():
    _, model = make_pair("llama_gqa")
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    runner = make_runner(model, cache=exact_spec(model, rank="attention", attention_error=0.9, rank_min=1))
    decode_logits(runner, [list(range(3, 40))], 2)
    assert runner.cache.statistics()["rank_mean"] == 1  # the first candidate already meets 90%
    config = ShadowKVConfig(rank="attention", energy=0.5, rank_min=1)
    probe = _probe(5)
    from kvforge.cache.shadowkv.compress import LayerKeys
    from kvforge.cache.shadowkv.lowrank import key_spectrum
    spectrum = key_spectrum(probe.keys_pre)
    keys = LayerKeys(spectrum, probe.keys_pre, probe.keys_post, probe.values, probe.exact, probe.rope)
    assert config.choose_rank(keys, None, 0.3) == config.layer_rank(spectrum.energy) < width
    assert config.choose_rank(keys, probe.sample, 0.3) == attention_rank(probe, 0.1, 1, RANK_STEP)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1])
def test_attention_error_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match="attention_error"):
        ShadowKVConfig(rank="attention", attention_error=value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("target", "rank_of"), [(1e-9, lambda width: width), (0.9, lambda width: 1)])
def test_cuda_rank_attention_picks_the_cpu_ranks_and_matches_its_outputs(target, rank_of):
    """On CUDA the sampled queries come from device tensors (rows located on the host): an
    unreachable target keeps full width and equals the CPU full cache; a loose one keeps
    the first candidate, as on the CPU."""
    import copy

    from kvforge.cache.registry import create_cache
    from kvforge.engine.runner import ModelRunner

    _, model = make_pair("llama_gqa")
    layout = model.cache_layout()
    width = layout.num_kv_heads * layout.head_dim
    prompts = [list(range(3, 40)), list(range(5, 70))]
    spec = exact_spec(model, rank="attention", attention_error=target, rank_min=1)
    cpu = make_runner(model, cache=spec)
    expected = decode_logits(cpu, prompts, 8)
    gpu_model = copy.deepcopy(model).to("cuda")
    cache = create_cache(spec, gpu_model.cache_layout(), 1 << 22, torch.float32, device="cuda")
    ours = decode_logits(ModelRunner(gpu_model, cache), prompts, 8).cpu()
    assert cache.statistics()["rank_mean"] == cpu.cache.statistics()["rank_mean"] == rank_of(width)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_compression_tells_the_rule_which_keys_stay_exact():
    """The rule sees exact = the outlier chunks' tokens and the exact tail [prefix, n), the
    same keys the compressed layer holds exactly."""
    from kvforge.cache.shadowkv.compress import compress_layer

    heads, dim, n, chunk, prefix, outliers = 2, 8, 40, 4, 32, 2
    generator = torch.Generator().manual_seed(6)
    rope = RotaryEmbedding(dim, RopeConfig(theta=10000.0)).at(torch.arange(1), torch.float32)
    keys_post = torch.randn(heads, n, dim, generator=generator)
    seen = []

    def rule(keys) -> int:
        seen.append(keys)
        return 3
    layer, _ = compress_layer(keys_post, torch.randn(heads, n, dim, generator=generator), rope, prefix, rule, chunk,
                              outliers, window_capacity=16, chunks_per_step=2)
    (keys,) = seen
    expected = torch.zeros(heads, n, dtype=torch.bool)
    expected[:, prefix:] = True
    for head in range(heads):
        for c in layer.outliers[head].tolist():
            expected[head, c * chunk:(c + 1) * chunk] = True
    assert torch.equal(keys.exact, expected) and int(expected[:, :prefix].sum()) == heads * outliers * chunk
    torch.testing.assert_close(keys.keys_post, keys_post)
    torch.testing.assert_close(rope.apply_at(keys.keys_pre.view(n, heads, dim), torch.arange(n)).transpose(0, 1),
                               keys_post, atol=1e-5, rtol=0)
