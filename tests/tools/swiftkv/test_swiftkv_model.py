"""SwiftKV wiring in the engine: the skipping forward (later layers only on logit rows)
equals the dense reference forward in which every token runs every layer."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_pair, make_runner
from swiftkv_helpers import across_kv_pair, swiftkv_model

from kvforge.engine.runner import StepItem
from kvforge.models.dense import dense_logits

ATOL = 1e-4
VOCAB = 96


def tokens_of(length: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def dense(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return dense_logits(model, torch.tensor([tokens]))[0]


@pytest.mark.parametrize("arch", ["llama_gqa", "smollm2_tied", "qwen2_bias", "mistral_window"])
def test_last_layer_count_equals_base_model(arch):
    _, base = make_pair(arch)
    model = swiftkv_model(base, base.config.num_layers, 1, perturb=False)
    tokens = tokens_of(33, 1)
    torch.testing.assert_close(dense(model, tokens), dense(base, tokens), atol=1e-5, rtol=0)
    runner, base_runner = make_runner(model), make_runner(base)
    for chunk in (33, 5):
        for start in range(0, 33, chunk):
            piece = tokens[start:start + chunk]
            got = runner.step([StepItem(0, piece, len(piece))])
            want = base_runner.step([StepItem(0, piece, len(piece))])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        runner.release(0)
        base_runner.release(0)


SETTINGS = [("llama_gqa", 1, 1), ("llama_gqa", 2, 1), ("smollm2_tied", 1, 1), ("qwen2_bias", 1, 1),
            ("mistral_window", 1, 1)]


@pytest.mark.parametrize(("arch", "first_later", "group"), SETTINGS)
@pytest.mark.parametrize("chunk", [40, 7, 1])
def test_single_sequence_matches_dense_reference(arch, first_later, group, chunk):
    _, base = make_pair(arch)
    model = swiftkv_model(base, first_later, group)
    tokens = tokens_of(40, 2)
    expected = dense(model, tokens)
    runner = make_runner(model)
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        logits = runner.step([StepItem(0, piece)])  # the last token of the chunk gets logits
        torch.testing.assert_close(logits[0], expected[start + len(piece) - 1], atol=ATOL, rtol=0)


def test_mixed_batches_with_chunked_prefill_match_dense_reference():
    _, model = across_kv_pair()
    assert model.cache_layout().num_cache_layers == 3
    prompts = [tokens_of(n, 10 + n) for n in (30, 1, 17, 41)]
    decode_len = 6
    full = [p + tokens_of(decode_len, 100 + i) for i, p in enumerate(prompts)]
    expected = [dense(model, seq) for seq in full]
    runner = make_runner(model)
    rng = random.Random(5)
    fed = [0] * len(full)
    checked = 0
    while any(f < len(s) for f, s in zip(fed, full)):
        items, owners = [], []
        for seq, tokens in enumerate(full):
            if fed[seq] >= len(tokens) or rng.random() < 0.25:
                continue
            in_prompt = fed[seq] < len(prompts[seq])
            size = rng.randint(1, 9) if in_prompt else 1
            piece = tokens[fed[seq]:fed[seq] + size]
            scored = rng.choice([0, 1, len(piece)]) if in_prompt else 1  # middle chunks may need none
            items.append(StepItem(seq, piece, scored))
            owners.append((seq, fed[seq] + len(piece), scored))
            fed[seq] += len(piece)
        if not items:
            continue
        logits = runner.step(items)
        row = 0
        for seq, end, scored in owners:
            for position in range(end - scored, end):
                torch.testing.assert_close(logits[row], expected[seq][position], atol=ATOL, rtol=0)
                row += 1
                checked += 1
    assert checked > 40


def test_across_kv_cache_bytes_drop_by_the_exact_fraction():
    base, model = across_kv_pair()
    budget = 1 << 20
    from kvforge.cache.registry import create_cache

    base_bytes = create_cache("full", base.cache_layout(), budget, torch.float32).memory.kv_bytes_per_token()
    swift_bytes = create_cache("full", model.cache_layout(), budget, torch.float32).memory.kv_bytes_per_token()
    layers, first, group = 5, 1, 2
    assert 1 - swift_bytes / base_bytes == pytest.approx((layers - first) * (1 - 1 / group) / layers)


def test_prompt_chunks_without_logits_skip_later_layers():
    """A middle chunk runs only layers < l: the later layers never see it."""
    _, model = across_kv_pair()
    calls = []
    for layer in model.model.layers[1:]:
        layer.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    runner = make_runner(model)
    runner.step([StepItem(0, tokens_of(12, 1), 0)])
    assert calls == []
    runner.step([StepItem(0, tokens_of(12, 2), 1)])
    assert calls == [1] * 4  # one row through each later layer


def test_packed_segments_equal_separate_sequences():
    _, model = across_kv_pair()
    a, b = tokens_of(9, 1), tokens_of(7, 2)
    segments = torch.tensor([[0] * 9 + [1] * 7])
    with torch.no_grad():
        packed = dense_logits(model, torch.tensor([a + b]), segment_ids=segments)[0]
    torch.testing.assert_close(packed[:9], dense(model, a), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[9:], dense(model, b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("residual", [64, 16])
def test_swiftkv_composes_with_kivi(residual):
    """Later layers query only the logit rows through the KIVI cache too (its generic
    attend_rows). With a residual longer than the sequence KIVI stores nothing quantised,
    so the result is exact; with residual 16 (8-bit) the error is KIVI's own, the same size
    as on the base model. The residual is kept in float32 (the compute dtype) so that
    "exact" means exact; the default 16-bit residual would round it."""
    base, model = across_kv_pair()
    tokens = tokens_of(60, 9)
    cache = f"kivi:bits=8,group=8,residual={residual},residual_dtype=float32"

    def run(net, spec):
        runner = make_runner(net, cache=spec)
        rows = [runner.step([StepItem(0, tokens[start:min(start + 13, 40)])])[0] for start in range(0, 40, 13)]
        rows += [runner.step([StepItem(0, [tokens[p]])])[0] for p in range(40, 60)]
        return torch.stack(rows)

    expected = dense(model, tokens)[[12, 25, 38, 39] + list(range(40, 60))]
    got = run(model, cache)
    if residual == 64:
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    else:
        swift_error = (got - expected).abs().max().item()
        base_error = (run(base, cache) - run(base, "full:block_size=4")).abs().max().item()
        assert swift_error < 2 * base_error + 1e-3
