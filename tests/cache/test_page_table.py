"""PageTable bounds: what one sequence holds during a step, sliding windows included."""

from __future__ import annotations

from kvforge.cache.block_pool import BlockPool
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.page_table import LayerGroups, PageTable


def test_pages_held_during_a_step_stay_within_the_step_bound():
    """A sliding group keeps its previous window's pages until commit while the step takes
    the new window's: more than the steady state (`max_pages_per_sequence`), never more
    than `max_pages_during_step`, whatever the chunk sizes."""
    layout = CacheLayout.one_per_layer([CacheLayerSpec(1, 8, 1.0, window) for window in (None, 10)])
    for chunk in (1, 3, 16, 24, 40):
        table = PageTable(BlockPool(1000), 4, LayerGroups.from_layout(layout))
        n, beyond_steady = 0, False
        while n < 120:
            assert table.allocate(0, n + chunk)
            held = table.pool.num_used
            assert held <= table.max_pages_during_step(n + chunk), (chunk, n)
            beyond_steady |= held > table.max_pages_per_sequence(n + chunk)
            n += chunk
            table.commit(0, n)
            assert table.pool.num_used <= table.max_pages_per_sequence(n)
        if chunk >= 16:  # a chunk longer than the window: two windows' pages at once
            assert beyond_steady, chunk
