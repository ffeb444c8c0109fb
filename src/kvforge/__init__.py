"""kvforge: KV-cache reshaping for LLM inference (SwiftKV, KIVI, ShadowKV on one engine)."""

__version__ = "0.1.0"
