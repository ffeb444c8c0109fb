"""ShadowKV's one split of the budget between its stores (split.py): the shares are the
budget, a lone sequence fits as far as its bytes do, up to the layout's longest (default), `split_context` trades that
for room for many compressed sequences, and `allocate` keeps each store within its share."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.cache.shadowkv.method import ShadowKVCache
from kvforge.cache.shadowkv.split import PARTS
from kvforge.errors import ConfigError

SPEC = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,rank=4,budget=8"


def hybrid_layout(max_sequence_tokens: int | None = None) -> CacheLayout:
    """Two global and two sliding-window layers."""
    layout = CacheLayout.one_per_layer([CacheLayerSpec(2, 16, 0.25, None if i % 2 else 12) for i in range(4)])
    return replace(layout, max_sequence_tokens=max_sequence_tokens)


def make(budget: int, options: str = "", max_sequence_tokens: int | None = None) -> ShadowKVCache:
    cache = create_cache(SPEC + options, hybrid_layout(max_sequence_tokens), budget, torch.float32)
    assert isinstance(cache, ShadowKVCache)
    return cache


def test_the_shares_are_the_budget():
    for budget, options in ((30_000, ""), (100_000, ""), (100_000, ",split_context=48"),
                            (1 << 22, ",split_context=48")):
        cache = make(budget, options)
        split = cache.split
        assert split.exact + split.sliding + split.chunk_pages * cache.fast_chunk_bytes + split.fixed == budget
        assert cache.exact.memory.capacity["fast"] <= split.exact  # type: ignore[union-attr]
        assert cache.sliding.memory.capacity["fast"] <= split.sliding  # type: ignore[union-attr]
        assert cache.store.num_pages <= split.chunk_pages  # type: ignore[union-attr]


def _allocates(cache, num_tokens: int) -> bool:
    """Whether a fresh sequence of `num_tokens` tokens can be allocated now (then freed again)."""
    if not cache.allocate(0, num_tokens):
        return False
    cache.free(0)
    return True


def _longest_alone(cache: ShadowKVCache) -> int:
    """The longest sequence admission lets into `cache` alone."""
    n = 1
    while cache.memory.fits_together([2 * n]):
        n *= 2
    lo, hi = n, 2 * n  # fits at lo, not at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cache.memory.fits_together([mid]) else (lo, mid)
    return lo


def test_a_budget_too_small_to_compress_holds_one_sequence_as_far_as_its_bytes_do():
    """When not even a min_context sequence fits, the split follows the longest that does:
    every length whose bytes fit the budget (less one chunk page set aside) fits and can be
    allocated in a fresh cache; no length fits whose bytes do not. Nothing compresses, so
    the exact stores get all of it (no share for compressed state that never comes)."""
    probe = make(1 << 22)
    for tokens in (5, 12, 20):
        budget = probe.memory.sequence_bytes(tokens) + probe.fast_chunk_bytes + 100
        cache = make(budget)
        assert cache.split.chunk_pages == 1 and cache.split.fixed <= len(PARTS)
        for n in range(1, 60):
            fits = cache.memory.fits_together([n])
            if cache.memory.sequence_bytes(n) <= budget - cache.fast_chunk_bytes:
                assert fits, (tokens, n)
            if fits:
                assert cache.memory.sequence_bytes(n) <= budget and _allocates(cache, n), (tokens, n)
        assert cache.memory.fits_together([tokens]) and not cache.memory.fits_together([40])


@pytest.mark.parametrize("budget", [200_000, 1 << 22])
def test_the_default_split_holds_a_long_sequence_or_many_short_ones(budget):
    """Half the budget for the longest lone sequence, half for compressed sequences: every
    length whose bytes fit half the budget fits alone, and many min_context sequences fit
    at once (which split_context=200 does not give). Their number is bound by the
    per-sequence state: this layout's tiny sequences are mostly fixed-size buffers, so a
    quarter of what their bytes alone would allow."""
    cache, long = make(budget), make(budget, ",split_context=200")
    half = (budget - cache.fast_chunk_bytes) // 2
    for n in range(1, 400, 7):
        if cache.memory.sequence_bytes(n) <= half:
            assert cache.memory.fits_together([n]) and _allocates(cache, n), n
    k = max(1, half // cache.memory.sequence_bytes(24) // 4)
    assert cache.memory.fits_together([24] * k)
    assert not long.memory.fits_together([24] * (budget // cache.memory.sequence_bytes(24)))


def test_the_default_split_keeps_no_room_for_a_sequence_longer_than_the_layout_allows():
    """No sequence outgrows `max_sequence_tokens` (the model's length, or max_model_len), so
    the lone half is sized for one that long, not for the longest its bytes would hold: the
    rest goes to the min_context half, and more compressed sequences fit, while one of the
    longest length still fits alone. A bound as long as the longest sequence whose bytes fit
    half the room (the shortest of the lengths whose parts are its) changes nothing; a token
    shorter does. A bound below min_context: nothing ever compresses, so the exact stores
    get the budget."""
    budget, longest = 1 << 22, 100
    free, bounded = make(budget), make(budget, max_sequence_tokens=longest)
    assert free.memory.fits_together([4 * longest])  # the unbounded half holds far longer ones
    assert bounded.memory.fits_together([longest]) and _allocates(bounded, longest)
    lone = _longest_alone(free)
    parts, half = free.memory.sizes.sequence_parts, (budget - free.fast_chunk_bytes) // 2
    half_holds = max(n for n in range(1, lone + 1) if sum(parts(n).values()) <= half)
    as_long = min(n for n in range(1, half_holds + 1) if parts(n) == parts(half_holds))  # (bytes grow by pages)
    assert longest < as_long <= half_holds < lone
    for bound in (as_long, lone):
        assert make(budget, max_sequence_tokens=bound).split == free.split, bound
    short = make(budget, max_sequence_tokens=as_long - 1)
    assert short.split != free.split and short.memory.fits_together([as_long - 1])
    at_lone = make(budget, max_sequence_tokens=lone)
    assert at_lone.memory.fits_together([lone]) and _allocates(at_lone, lone)
    assert bounded.split.exact < free.split.exact and bounded.split.chunk_pages > free.split.chunk_pages
    assert bounded.memory.sequences_held(longest) > free.memory.sequences_held(longest) > 0
    never = make(budget, max_sequence_tokens=20)  # min_context=24
    assert never.split.chunk_pages == 1 and never.split.exact + never.split.sliding > 0.9 * budget
    assert never.memory.fits_together([20] * 10)


@pytest.mark.parametrize("budget", [1 << 20, 1 << 22, 1 << 24])
def test_compressed_sequences_of_any_length_run_out_of_state_before_chunk_pages(budget):
    """The chunk pages hold the prefixes of as many compressed sequences as the per-sequence
    state's share holds (at the largest rank), at every length: the pages are never what
    stops a long sequence from being admitted while most of the state's share is free."""
    cache = make(budget)
    page_bytes = cache.store.num_pages * cache.fast_chunk_bytes  # type: ignore[union-attr]
    checked = 0
    for n in (24, 48, 100, 400, 1000, 5000):
        parts = cache.memory.sizes.sequence_parts(n)
        by_state = cache.split.fixed // parts["fixed"]
        assert page_bytes // parts["chunks"] >= by_state, n
        checked += by_state > 0
    assert checked >= 4


def test_allocate_keeps_each_store_within_its_share():
    """Sequences that would fit the budget by their bytes are refused once one store's share
    is used up (an inner cache's pages)."""
    cache = make(200_000, ",split_context=48")
    admitted = 0
    while admitted < 100 and cache.allocate(admitted, 20):  # exact sequences (below min_context)
        admitted += 1
    assert 0 < admitted < 100
    assert cache.memory_usage()["fast"] + cache.memory.sequence_bytes(20) <= cache.memory.capacity["fast"]
    inner = [c for c in (cache.exact, cache.sliding) if c is not None]
    assert any(c.pages.pool.num_free < c.pages.pages_for_growth(admitted, 20) for c in inner)


@pytest.mark.parametrize("length", [30, 60, 100])
def test_reserved_state_stays_within_its_share(length):
    """Steps that may compress reserve chunk pages and per-sequence state: admitted until a
    share runs out, never beyond any share."""
    cache = make(200_000, ",split_context=48")
    admitted = 0
    while admitted < 100 and cache.allocate(admitted, length):
        admitted += 1
        assert cache._fixed_bytes <= cache.split.fixed
        assert cache._reserved_pages <= cache.store.num_pages  # type: ignore[union-attr]
    assert 0 < admitted < 100


def test_a_budget_too_small_for_its_split_is_refused():
    with pytest.raises(ConfigError, match="kv_budget.*12000.*split_context=48: at least"):
        make(12_000, ",split_context=48")
    with pytest.raises(ConfigError, match="kv_budget.*5000.*one compressed chunk"):
        make(5000)


def test_split_context_below_min_context_is_refused():
    with pytest.raises(ConfigError, match="split_context.*10.*min_context=24"):
        make(1 << 20, ",split_context=10")


@pytest.mark.parametrize("options", [",exact_share=0.25", ",exact_share=0.6,split_context=100"])
def test_exact_share_gives_the_exact_store_its_fraction(options):
    """The exact store gets exact_share of the budget (less the page set aside); what every
    decoding sequence holds (sliding windows, chunk pages, per-sequence state) the rest, in
    split_context's proportions or the per-token mix (as without exact_share)."""
    share = float(options.split(",")[1].split("=")[1])
    budget = 1 << 22
    cache = make(budget, options)
    split, room = cache.split, budget - cache.fast_chunk_bytes
    pages = split.chunk_pages * cache.fast_chunk_bytes
    assert split.exact + split.sliding + pages + split.fixed == budget
    assert split.exact == int(room * share)
    parts = cache.memory.sizes.sequence_parts(100 if "split_context" in options else 24)
    rest = parts["sliding"] + parts["chunks"] + parts["fixed"]
    assert split.sliding / (room - split.exact) == pytest.approx(parts["sliding"] / rest, abs=1e-4)
    if "split_context" in options:  # in a 100-token sequence's proportions
        assert pages / (pages + split.fixed) == pytest.approx(parts["chunks"] / (parts["chunks"] + parts["fixed"]),
                                                              abs=0.01)
    assert cache.exact.memory.capacity["fast"] <= split.exact  # type: ignore[union-attr]
    assert cache.sliding.memory.capacity["fast"] <= split.sliding  # type: ignore[union-attr]
    assert cache.store.num_pages <= split.chunk_pages  # type: ignore[union-attr]


def test_a_small_exact_share_holds_more_compressed_sequences():
    """What exact_share is for: long compressed sequences, whose exact pages are freed when
    they compress. The default split keeps most of the budget for exact pages; a quarter
    for them, the rest in a 400-token sequence's proportions, holds over twice the
    compressed 400-token sequences."""
    budget, n = 1 << 22, 400
    default, small = make(budget), make(budget, f",exact_share=0.25,split_context={n}")
    assert small.memory.sequences_held(n) > 2 * default.memory.sequences_held(n) > 0
    # an exact share too small for one 400-token prompt: none, however much room is left
    assert make(budget, f",exact_share=0.01,split_context={n}").memory.sequences_held(n) == 0
    assert small.split.exact < default.split.exact


def test_a_bad_exact_share_is_refused():
    for share in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=f"exact_share.*{share}.*must be None or in \\(0, 1\\)"):
            make(1 << 20, f",exact_share={share}")
    with pytest.raises(ConfigError, match="kv_budget.*must give the exact store .* exact_share=0.001: at least"):
        make(60_000, ",exact_share=0.001")
    with pytest.raises(ConfigError, match="kv_budget.*must give the sliding store .* exact_share=0.999: at least"):
        make(200_000, ",exact_share=0.999")
    with pytest.raises(ConfigError, match="kv_budget.*must leave one compressed min_context=24 sequence .* "
                                          "exact_share=0.9"):
        make(200_000, ",exact_share=0.9")


@pytest.mark.parametrize("share", ["0.01", "0.999"])
def test_the_least_budget_named_for_an_exact_share_is_enough(share):
    with pytest.raises(ConfigError) as refused:
        make(30_000, f",exact_share={share}")
    least = int(str(refused.value).rsplit("at least ", 1)[1].split()[0])
    try:
        make(least, f",exact_share={share}")
    except ConfigError as error:  # enough for the store named; another may still be short
        assert "exact_share" in str(error) and str(error) != str(refused.value)


@pytest.mark.parametrize("architecture,options,n", [
    ("llama_gqa", "", 40), ("llama_gqa", ",exact_share=0.3,split_context=40", 40),
    ("llama_gqa", ",exact_share=0.3,split_context=40,slow_budget=20000", 40),  # one sequence's values
    ("llama_gqa", "", 20),  # shorter than min_context: exact
    ("gemma3_hybrid", ",exact_share=0.3,split_context=40", 40)])
def test_sequences_held_is_what_the_cache_holds(architecture, options, n):
    """`sequences_held` (bench throughput's admissible sequences) against a cache filled by
    prompts prefilled one at a time, each compressed at its end if long enough, until
    `allocate` refuses the next: the same count, less at most one (chunk pages counted for
    whole tokens), on global layers; no more than the cache holds with sliding-window layers
    (their windows' pages counted at the most a sequence can hold). `fits_together`, which
    counts every sequence at its compression step, holds fewer with exact_share."""
    from conftest import make_pair

    from kvforge.engine.runner import ModelRunner, StepItem

    model = make_pair(architecture)[1]
    spec = ("shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=3,budget=paper,"
            "budget_floor=4,budget_fraction=0.1,kernel=0")
    cache = create_cache(spec + options, model.cache_layout(), 1 << 20, torch.float32)
    runner = ModelRunner(model, cache)
    held = cache.memory.sequences_held(n)
    if "slow_budget" in options:  # the values' tier binds (through the chunk pages: 2 without it)
        assert held == 1
    filled = 0
    while filled < 100 and cache.allocate(filled, n):
        runner.step([StepItem(filled, [(7 * filled + i) % 90 + 1 for i in range(n)])])
        filled += 1
    assert 0 < held <= filled < 100
    if architecture == "llama_gqa":
        assert filled <= held + 1
    if "exact_share" in options and "slow_budget" not in options:
        assert not cache.memory.fits_together([n] * held)


def test_the_engine_bounds_its_cache_by_the_model_and_max_model_len():
    """LLM builds the cache for sequences no longer than the engine allows them to be: the
    model's length, or a shorter max_model_len (a longer one is lowered to the model's)."""
    from kvforge.engine.llm import LLM

    made = {length: LLM("llama-tiny", load_format="dummy", cache="shadowkv", kv_budget="64MiB", max_model_len=length)
            for length in (None, 3000, 10 ** 6)}
    longest = made[None].model.config.max_position_embeddings
    for length, llm in made.items():
        assert llm.engine.cache.layout.max_sequence_tokens == llm.engine.max_model_len == min(length or longest,
                                                                                              longest)
        assert llm.engine.cache.exact.layout.max_sequence_tokens == llm.engine.max_model_len  # (and its inner caches)
    assert made[3000].engine.cache.split.exact < made[None].engine.cache.split.exact
