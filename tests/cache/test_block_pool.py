"""Block pool and page tables: allocation, release, exhaustion, sliding-window bounds."""

from __future__ import annotations

import pytest

from kvforge.cache.block_pool import BlockPool
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.page_table import RELEASED, LayerGroups, PageTable
from kvforge.errors import CacheCapacityError, ConfigError


def test_allocate_free_roundtrip():
    pool = BlockPool(8)
    first = pool.allocate(3)
    second = pool.allocate(5)
    assert len(set(first + second)) == 8 and pool.num_free == 0
    pool.free(first)
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted(first)


def test_free_blocks_are_handed_out_lowest_id_first():
    """Sequences get ascending runs of adjacent pages (the CPU decode kernels stream them
    about twice as fast as scattered or descending ones), also after frees in any order."""
    pool = BlockPool(12)
    assert pool.allocate(4) == [0, 1, 2, 3]
    middle = pool.allocate(4)
    pool.allocate(4)
    pool.free(middle[::-1])  # freed highest first, as a LIFO list would then hand them out
    pool.free([1, 0])
    assert pool.allocate(6) == [0, 1, 4, 5, 6, 7]


def test_exhaustion_takes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(CacheCapacityError, match="asked for 2 blocks, 1 of 4 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert not pool.can_allocate(2) and pool.can_allocate(1)


def test_double_free_is_refused():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(blocks)


def test_empty_pool_is_a_config_error():
    with pytest.raises(ConfigError, match="num_blocks"):
        BlockPool(0)


def _layout(windows):
    return CacheLayout.one_per_layer([CacheLayerSpec(1, 8, 1.0, w) for w in windows])


def test_groups_have_equal_size_per_kind():
    groups = LayerGroups.from_layout(_layout([4, 4, None, 4, 4, None]))
    assert groups.group_size == 2
    assert groups.layers == ((0, 1), (3, 4), (2, 5))
    assert groups.windows == (4, 4, None)
    assert groups.slot_of[5] == (2, 1)


def test_page_table_global_growth_and_free():
    table = PageTable(BlockPool(10), block_size=4, groups=LayerGroups.from_layout(_layout([None, None])))
    assert table.allocate(7, 9)  # 3 pages
    table.commit(7, 9)
    assert table.allocate(7, 12)  # still 3 pages
    assert table.pool.num_used == 3
    assert table.allocate(7, 13) and table.pool.num_used == 4
    assert not table.allocate(8, 30)  # 8 pages needed, 6 free: nothing taken
    assert table.pool.num_used == 4 and not table.has(8)
    table.free(7)
    assert table.pool.num_used == 0


def test_sliding_group_keeps_only_its_window():
    window, block = 6, 4
    table = PageTable(BlockPool(100), block, LayerGroups.from_layout(_layout([window])))
    for n in range(1, 60):
        assert table.allocate(0, n)
        table.commit(0, n)
        kept = [j for j, page in enumerate(table.pages(0, 0)) if page != RELEASED]
        first_needed = max(0, n - window + 1)  # the next query (position n) sees these
        assert kept == list(range(first_needed // block, (n - 1) // block + 1))
        assert table.pool.num_used <= -(-(window - 1) // block) + 1


def test_sliding_group_long_chunk_stores_only_the_tail():
    table = PageTable(BlockPool(100), 4, LayerGroups.from_layout(_layout([6])))
    assert table.allocate(0, 40)  # one 40-token prefill chunk
    # tokens 35..39 are the only ones a later query sees: pages 8 and 9
    assert table.pool.num_used == 2
    with pytest.raises(CacheCapacityError, match="no storage"):
        table.require_slots(0, 0, 0, 40)
