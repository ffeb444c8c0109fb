"""The `shadowkv` cache method (Sun et al.): low-rank pre-RoPE keys and landmarks on the
fast tier, values on the slow tier, landmark top-k chunk attention at decode.

config.py (options), method.py (the CacheMethod), memory.py (byte accounting of both
tiers), state.py / store.py (compressed per-sequence state, chunk pages), lowrank.py,
select.py, compress.py (Algorithm 1), sparse.py, attention.py (Algorithm 2), stats.py,
threads.py, cpu_decode.py + .cpp (the fused CPU decode kernel).
"""

from kvforge.cache.shadowkv.config import ShadowKVConfig
from kvforge.cache.shadowkv.method import ShadowKVCache

__all__ = ["ShadowKVCache", "ShadowKVConfig"]
