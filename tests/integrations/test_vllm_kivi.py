"""kvforge's KIVI vLLM backend, the parts that need no vLLM: the setting and its refusals,
the bytes of a block against kvforge's own KIVI accounting, the page views over a layer's
bytes, and the exact-copy plan checked against kvforge's residual rule (nk = (n // R) * R,
nv = n - R) on random schedules. The vLLM runs are the slow tests in test_vllm_plugin.py."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvforge.cache.kivi.memory import quantized_keys, quantized_values
from kvforge.cache.kivi.store import KIVIStore
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache
from kvforge.errors import ConfigError
from kvforge.integrations.vllm.kivi_exact import (
    MISSING,
    ExactCopies,
    LostExactCopy,
    SequenceStep,
    exact_slots,
)
from kvforge.integrations.vllm.kivi_options import (
    KIVI_ENV,
    block_bytes_with_copies,
    bytes_per_token,
    copy_pool_bytes,
    kivi_config,
    page_block_bytes,
    sink_block_bytes,
)
from kvforge.integrations.vllm.kivi_pages import ExactPool, page_components, region_bytes


def test_default_setting_is_the_papers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KIVI_ENV, raising=False)
    config = kivi_config()
    assert (config.bits, config.key_tokens, config.residual) == (2, 32, 128)
    monkeypatch.setenv(KIVI_ENV, "bits=4,residual=32")
    assert (kivi_config().bits, kivi_config().residual) == (4, 32)


@pytest.mark.parametrize("options,option", [("key_dot=int8", "key_dot"), ("value_dot=int8", "value_dot"),
                                            ("preset=quality2,key_dot=int8", "key_dot"), ("sinks=33", "sinks"),
                                            ("key_group=16,residual=32,sinks=17", "sinks")])
def test_unimplemented_options_are_refused_by_name(options: str, option: str) -> None:
    with pytest.raises(ConfigError, match=f"{KIVI_ENV} {option}"):
        kivi_config(options)


def test_quality3_is_accepted_as_kvforge_defines_it() -> None:
    config = kivi_config("preset=quality3")
    assert (config.kbits, config.vbits, config.key_tokens, config.value_channels, config.sinks, config.rotation,
            config.key_space) == (4, 2, 128, 64, 4, "hadamard_values", "pre_rope")


@pytest.mark.parametrize("options", ["", "bits=4", "preset=quality2", "residual=32", "value_group=64",
                                     "key_group=128,value_group=64,key_bits=4,value_bits=2", "preset=quality3"])
def test_block_bytes_are_kvforges_page_and_info_bytes_per_token(options: str) -> None:
    config = kivi_config(options)
    page = page_block_bytes(config, 3, 64)
    store = KIVIStore(1, 1, 3, 64, 5, 1, config.kbits, config.key_tokens, config.residual, torch.float16,
                      torch.device("cpu"), value_group=config.value_channels, value_bits=config.vbits)
    page_tensors = (store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero)
    assert sum(t.numel() * t.element_size() for t in page_tensors) == 5 * page == region_bytes(config, 5, 3, 64)
    # what `kvforge info` reports: the kivi cache's bytes per token, 30 layers of 3 x 64 (smollm2-135m)
    layout = CacheLayout.one_per_layer([CacheLayerSpec(3, 64, 0.125)] * 30)
    cache = create_cache("kivi:" + options if options else "kivi", layout, 1 << 30, torch.float32, "cpu")
    assert cache.memory.kv_bytes_per_token() == bytes_per_token(config, 3, 64, 30)
    # at least 4x fewer bytes than a bfloat16 cache (2 bytes x K and V per channel)
    assert 2 * 2 * 3 * 64 / (page / config.key_tokens) >= (4 if config.kbits + config.vbits <= 6 else 2.5)


def test_page_views_cut_the_region_component_major() -> None:
    config = kivi_config("")
    region = torch.zeros(region_bytes(config, 7, 3, 64), dtype=torch.uint8)
    parts = page_components(region, config, 7, 3, 64)
    assert parts["k_codes"].shape == (3, 7, 64, 8) and parts["v_scale"].shape == (3, 7, 32, 2)
    assert all(p.is_contiguous() for p in parts.values())
    parts["v_zero"].fill_(1.0)  # the last component ends exactly at the region's end
    assert region[-2:].view(torch.float16).item() == 1.0
    assert int((region != 0).sum()) == parts["v_zero"].numel() * 2 - parts["v_zero"].numel()  # 0x3c00
    with pytest.raises(ValueError, match="contiguous bytes"):
        page_components(region[:-1], config, 7, 3, 64)


def test_pool_gather_takes_copies_and_rows() -> None:
    pool = ExactPool(2, 4, 1, 2, torch.float16, torch.device("cpu"))
    pool.write(torch.tensor([1, 0]), torch.tensor([3, 0]), torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2))
    rows = torch.full((3, 1, 2), 7.0, dtype=torch.float16)
    keys, values = pool.gather(torch.tensor([7, 0, 8 + 2]), rows, rows)
    assert keys[:, 0, 0].tolist() == [1.0, 1.0, 7.0] and values[:, 0, 0].tolist() == [2.0, 2.0, 7.0]


def _most_blocks_carrying(page: int, pool: int, budget: int, layers: int, block_size: int) -> int:
    """By search: the most blocks N whose declared size (page + ceil(pool / N), rounded up to
    block_size) still gives N blocks of the budget; 0 when none does."""
    for n in range((budget // layers - pool) // page, 0, -1):
        declared = -(-(page + -(-pool // n)) // block_size) * block_size
        if budget // (layers * declared) >= n:
            return n
    return 0


@settings(max_examples=200, deadline=None)
# smollm2-135m's 2-bit page and residual=32 copies at a budget where the first size tried
# rounds to too few blocks to carry the copies
@example(page=4608, pool=786432, layers=30, budget=26222015, block_size=32)
@given(page=st.integers(1, 400).map(lambda n: 16 * n), pool=st.integers(1, 10**6), layers=st.integers(1, 40),
       budget=st.integers(1, 10**7), block_size=st.sampled_from([16, 32, 64]))
def test_declared_blocks_carry_the_copies_within_the_budget(page: int, pool: int, layers: int, budget: int,
                                                            block_size: int) -> None:
    most = _most_blocks_carrying(page, pool, budget, layers, block_size)
    try:
        declared = block_bytes_with_copies(page, pool, budget, layers, block_size)
    except ConfigError as error:
        assert "kv_cache_memory_bytes" in str(error) and most == 0  # refused only when nothing fits
        return
    made = budget // (layers * declared)  # what vLLM makes of the budget
    assert declared % block_size == 0 and declared >= page
    assert made >= 1 and made * (declared - page) >= pool  # the copies live in the blocks' spare bytes
    assert layers * made * declared <= budget  # pages and copies together: within the budget
    assert made >= most  # no fewer blocks than the best declared size gives


def test_a_budget_without_room_for_the_copies_is_refused() -> None:
    config = kivi_config("")
    pool = copy_pool_bytes(config, 3, 64, 2, 8)
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes.*exact copies"):
        block_bytes_with_copies(page_block_bytes(config, 3, 64), pool, 30 * pool, 30, 32)


@pytest.mark.parametrize("options,ratio,pages_only", [("", 4.1, 5.34), ("residual=32", 4.8, 5.34),
                                                      ("preset=quality3", 2.6, 4.14)])
def test_kivi_holds_4x_the_tokens_of_bf16_at_equal_memory_copies_included(options: str, ratio: float,
                                                                          pages_only: float) -> None:
    """smollm2-135m (30 layers, 3 KV heads x 64), a 256 MiB budget, max_num_seqs 8, float16
    residual: vLLM's bfloat16 cache against the KIVI blocks left after the exact copies (and,
    with sinks, the blocks' sink areas). quality3's 128-token blocks make each exact copy 4x
    the paper's, 32 of them a layer: a third of the budget at max_num_seqs 8."""
    config = kivi_config(options)
    budget, layers, g = 256 * 2**20, 30, config.key_tokens
    pool = copy_pool_bytes(config, 3, 64, 2, 8)
    assert pool == 8 * 2 * (config.residual // g + 1) * 2 * g * 3 * 64 * 2  # exact_slots copies, K and V
    block = page_block_bytes(config, 3, 64) + sink_block_bytes(config, 3, 64, 2)
    assert block - page_block_bytes(config, 3, 64) == 2 * config.sinks * 3 * 64 * 2  # sinks: K and V, float16
    declared = block_bytes_with_copies(block, pool, budget, layers, g)
    kivi_tokens = budget // (layers * declared) * g
    bf16_tokens = budget // (layers * 32 * 2 * 3 * 64 * 2) * 32
    assert kivi_tokens / bf16_tokens >= ratio
    assert kivi_tokens / bf16_tokens < pages_only  # below the pages-only ratio: the copies (and sinks) are paid for


def test_pool_over_given_bytes_is_zeroed_and_refuses_too_few() -> None:
    storage = torch.full((2 * 2 * 4 * 1 * 2 * 2 + 6,), 255, dtype=torch.uint8)
    pool = ExactPool(2, 4, 1, 2, torch.float16, torch.device("cpu"), storage=storage)
    assert pool.keys.data_ptr() == storage.data_ptr() and int(storage[:64].sum()) == 0
    assert int((storage[64:] == 255).sum()) == 6  # nothing beyond the copies is touched
    pool.write(torch.tensor([1]), torch.tensor([3]), torch.ones(1, 1, 2), torch.ones(1, 1, 2))
    assert int(storage[:64].count_nonzero()) > 0
    with pytest.raises(ValueError, match="64 bytes aligned to 2 needed"):
        ExactPool(2, 4, 1, 2, torch.float16, torch.device("cpu"), storage=storage[:63])


# -- the exact-copy plan against kvforge's residual rule ------------------------------------
class _Engine:
    """A toy vLLM: sequences with block tables from one block pool, scheduled in random
    chunks; it replays the plan on token ids (exact copies and "pages") and checks that
    every token the ring must hold is there, and that every block is completed once."""

    def __init__(self, g: int, r: int, slots: int) -> None:
        self.g, self.r = g, r
        self.copies = ExactCopies(slots, g, r)
        self.pool = [[None] * g for _ in range(slots)]  # token ids in the exact copies
        self.pages: dict[int, list[int]] = {}
        self.free = list(range(1000))

    def step(self, seqs: list[dict], rng: random.Random) -> None:
        steps, row = [], 0
        for seq in seqs:
            new = rng.choice([1, 1, 1, rng.randint(1, 3 * self.g)])
            need = (seq["n"] + new + self.g - 1) // self.g
            while len(seq["blocks"]) < need:
                seq["blocks"].append(self.free.pop(0))
            steps.append(SequenceStep(seq["n"], new, row, list(seq["blocks"])))
            row += new
        tokens = [seq["id"] * 10_000 + t for seq, s in zip(seqs, steps, strict=True)
                  for t in range(s.stored, s.stored + s.new)]
        plan = self.copies.plan(steps)
        for seq, s, ring in zip(seqs, steps, plan.ring_sources, strict=True):
            n = s.stored
            for t in range(max(0, n - self.r), n):  # kvforge reads these exactly
                source = ring[t % self.r]
                assert source != MISSING
                assert self.pool[source // self.g][source % self.g] == seq["id"] * 10_000 + t
            assert quantized_keys(n, self.r) >= n - self.r and quantized_values(n, self.r) == max(0, n - self.r)
            for k in range(quantized_keys(n, self.r) // self.g):  # pages below nk exist
                assert self.pages[s.blocks[k]] == [seq["id"] * 10_000 + t for t in range(k * self.g, (k + 1) * self.g)]
        pool_tokens = len(self.pool) * self.g
        for i, block in enumerate(plan.full_blocks):
            sources = plan.full_sources[i * self.g:(i + 1) * self.g]
            self.pages[block] = [self.pool[s // self.g][s % self.g] if s < pool_tokens else tokens[s - pool_tokens]
                                 for s in sources]
        for r, slot, offset in zip(plan.write_rows, plan.write_slots, plan.write_offsets, strict=True):
            self.pool[slot][offset] = tokens[r]
        for seq, s in zip(seqs, steps, strict=True):
            seq["n"] += s.new


@pytest.mark.parametrize("g,r", [(4, 4), (4, 16), (8, 32)])
def test_plan_keeps_kvforges_residual_on_random_schedules(g: int, r: int) -> None:
    rng = random.Random(g * 100 + r)
    engine = _Engine(g, r, slots=exact_slots(g, r, 4))
    seqs = [{"id": i, "n": 0, "blocks": []} for i in range(4)]
    for _ in range(60):
        engine.step(rng.sample(seqs, rng.randint(1, 4)) if rng.random() < 0.3 else seqs, rng)


def test_a_lost_partial_block_raises_instead_of_reading_garbage() -> None:
    copies = ExactCopies(num_slots=2, block_size=4, residual=8)
    copies.plan([SequenceStep(0, 2, 0, [10])])  # block 10 half full, in a slot
    copies.plan([SequenceStep(0, 8, 0, [20, 21])])  # another sequence (block 10's is not scheduled) takes both
    with pytest.raises(LostExactCopy, match="block 10"):
        copies.plan([SequenceStep(2, 1, 0, [10])])


def test_a_prefix_hit_without_copies_reads_pages() -> None:
    copies = ExactCopies(num_slots=8, block_size=4, residual=8)
    # a second request starts on two cached full blocks nobody holds copies of
    plan = copies.plan([SequenceStep(8, 1, 0, [3, 4, 5])])
    assert plan.ring_sources[0] == [MISSING] * 8 and plan.any_missing
    assert plan.full_blocks == []
