"""ShadowKV's one split of the budget between its stores (split.py): the shares are the
budget, a lone sequence fits as far as its bytes do (default), `split_context` trades that
for room for many compressed sequences, and `allocate` keeps each store within its share."""

from __future__ import annotations

import pytest
import torch

from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.cache.shadowkv.method import ShadowKVCache
from kvforge.errors import ConfigError

SPEC = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,rank=4,budget=8"


def hybrid_layout() -> CacheLayout:
    """Two global and two sliding-window layers."""
    return CacheLayout.one_per_layer([CacheLayerSpec(2, 16, 0.25, None if i % 2 else 12) for i in range(4)])


def make(budget: int, options: str = "") -> ShadowKVCache:
    cache = create_cache(SPEC + options, hybrid_layout(), budget, torch.float32)
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


def test_a_budget_too_small_to_compress_holds_one_sequence_as_far_as_its_bytes_do():
    """When not even a min_context sequence fits, the split follows the longest that does:
    every length whose bytes fit the budget (less one chunk page set aside) fits and can be
    allocated in a fresh cache; no length fits whose bytes do not."""
    probe = make(1 << 22)
    for tokens in (5, 12, 20):
        budget = probe.memory.sequence_bytes(tokens) + probe.fast_chunk_bytes + 100
        cache = make(budget)
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
def test_exact_share_gives_the_exact_stores_their_fraction(options):
    """The exact stores get exact_share of the budget (less the page set aside), between
    them in a sequence's proportions; the compressed state gets the rest, between chunk
    pages and per-sequence state as without it (split_context's proportions, or the
    per-token mix)."""
    share = float(options.split(",")[1].split("=")[1])
    budget = 1 << 22
    cache = make(budget, options)
    split, room = cache.split, budget - cache.fast_chunk_bytes
    assert split.exact + split.sliding + split.chunk_pages * cache.fast_chunk_bytes + split.fixed == budget
    assert int(room * share) - 2 <= split.exact + split.sliding <= int(room * share)
    parts = cache.memory.sizes.sequence_parts(100 if "split_context" in options else 24)
    assert split.exact / (split.exact + split.sliding) == pytest.approx(parts["exact"] / (parts["exact"] + parts["sliding"]),
                                                                       abs=1e-4)
    if "split_context" in options:  # chunk pages : state in a 100-token sequence's proportions
        pages = split.chunk_pages * cache.fast_chunk_bytes
        assert pages / (pages + split.fixed) == pytest.approx(parts["chunks"] / (parts["chunks"] + parts["fixed"]),
                                                              abs=0.01)
    assert cache.exact.memory.capacity["fast"] <= split.exact  # type: ignore[union-attr]
    assert cache.store.num_pages <= split.chunk_pages  # type: ignore[union-attr]


def test_a_small_exact_share_holds_more_compressed_sequences():
    """What exact_share is for: long compressed sequences, whose exact pages are freed when
    they compress. The default split keeps most of the budget for exact pages; a quarter
    for them holds over twice the compressed sequences."""
    budget, n = 1 << 22, 400
    default, small = make(budget), make(budget, ",exact_share=0.25")

    def compressed(cache) -> int:
        parts = cache.memory.sizes.sequence_parts(n)
        return min(cache.split.fixed // parts["fixed"],
                   cache.split.chunk_pages * cache.fast_chunk_bytes // parts["chunks"])

    assert compressed(small) > 2 * compressed(default) > 0
    assert small.split.exact < default.split.exact


def test_a_bad_exact_share_is_refused():
    for share in ("0", "1", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=f"exact_share.*{share}.*must be None or in \\(0, 1\\)"):
            make(1 << 20, f",exact_share={share}")
    with pytest.raises(ConfigError, match="kv_budget.*must give the exact store .* exact_share=0.001: at least"):
        make(60_000, ",exact_share=0.001")
    with pytest.raises(ConfigError, match="kv_budget.*must leave one compressed min_context=24 sequence .* "
                                          "exact_share=0.999"):
        make(60_000, ",exact_share=0.999")


def test_the_least_budget_named_for_an_exact_share_is_enough():
    with pytest.raises(ConfigError) as refused:
        make(30_000, ",exact_share=0.01")
    least = int(str(refused.value).rsplit("at least ", 1)[1].split()[0])
    make(least, ",exact_share=0.01")
