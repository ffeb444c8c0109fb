"""Compiled kernels (built at first use) with PyTorch fallbacks in `kvforge.cache.attention`."""
