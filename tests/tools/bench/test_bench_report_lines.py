"""bench's text report: the cache line of a ShadowKV system names its bytes, hit rate,
phase times and the ranks it chose per compressed layer."""

from __future__ import annotations

from kvforge.tools.bench.report import cache_lines


def test_shadowkv_cache_line_lists_ranks_per_layer():
    stats = {"chunk_hit_rate": 0.75, "seconds_selection": 1.5, "rank_mean": 78.0, "rank_layer_0": 48.0,
             "rank_layer_1": 55.0, "rank_layer_2": 131.0}
    system = {"name": "kvforge[shadowkv]", "cache_bytes_after_prefill": {"fast": 2**20, "slow": 2**21},
              "cache_statistics": stats}
    (line,) = cache_lines([system, {"name": "hf"}])
    assert line.startswith("kvforge[shadowkv]: KV after prefill: fast")
    assert "chunk hit rate 0.750" in line and "selection 1.50" in line
    assert "ranks per layer 48/55/131 (mean 78.0)" in line
