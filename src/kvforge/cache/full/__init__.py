"""The `full` cache method: exact K/V (fp32/bf16/fp16) on a paged block pool.

method.py (the CacheMethod), config.py (its options), cpu_decode.py + .cpp (the paged
decode attention kernel for CPU, parity-tested against `cache.attention.decode_attention`).
"""

from kvforge.cache.full.config import FullCacheConfig
from kvforge.cache.full.method import FullCache

__all__ = ["FullCache", "FullCacheConfig"]
