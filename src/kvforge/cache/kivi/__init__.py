"""The `kivi` cache method (Liu et al., ICML 2024): 2/4/8-bit asymmetric K/V quantisation.

config.py (options), quant.py (group quantisation and bit packing), store.py (the storage
tensors), method.py (the CacheMethod: accounting, flushes, step protocol), attention.py
(PyTorch reference attention over the store), prefill.py (the default prefill attention),
decode_reference.py (the reference of the decode kernels), decode_kernels.py (which decode
kernel a cache uses), cpu_decode.py + .cpp (CPU kernel), triton_decode.py (CUDA kernel).
"""

from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.method import KIVICache

__all__ = ["KIVICache", "KIVICacheConfig"]
