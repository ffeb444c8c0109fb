"""Which KIVI setting the vLLM KIVI backend runs, and what one vLLM block of it costs
(pure kvforge: no vLLM import).

The setting comes from the environment variable `KVFORGE_VLLM_KIVI`, written as the options
of kvforge's `--cache kivi:...` (so both engines parse it with the same code and reject the
same values): unset or empty is the paper's setting (bits=2, group=32, residual=128), e.g.

    KVFORGE_VLLM_KIVI="bits=4"    KVFORGE_VLLM_KIVI="preset=paper2"    KVFORGE_VLLM_KIVI="preset=quality3"

One vLLM block holds one kvforge KIVI page: `key_tokens` (G) tokens of key codes per channel
and value codes per token, with their float16 scales and zero points, for one attention
layer (`page_block_bytes`), plus its share of the residual: the full-precision residual of
each sequence lives in exact copies of the newest blocks (kivi_exact.py), a pool of a fixed
size (`copy_pool_bytes`, set by max_num_seqs) that is placed after the pages in each layer's
region. `block_bytes_with_copies` declares each block large enough that the blocks vLLM
makes of its KV budget carry the pool in their spare bytes, so the budget holds pages and
copies together (as kvforge's own KIVI cache takes its residual slots from its budget).

Beyond the paper (kivi_stored.py): `rotation` (values stored as v H, the output o H undone
by H^T; rotated keys matched by rotating the queries, or unrotated before RoPE),
`key_space=pre_rope` (the backend undoes the RoPE of the keys vLLM hands it, in float32 at
each token's position, and readers RoPE them after dequantisation, as kvforge's do), and
`sinks` <= G (the first N tokens exact in a sink area of every block, `sink_block_bytes`,
read from a sequence's first block: kivi_exact.py). So `preset=quality3` runs. Bytes per
token (`bytes_per_token`) are the page's, as `kvforge info` reports them: the sink area,
like the exact copies, is declared in the block bytes (vLLM's block count pays for it) but
is not part of bytes per token (kvforge counts its sink buffers in the residual slots).
Refused here, naming the option: `key_dot`/`value_dot=int8` (the backend does not pass
them to the kernels) and sinks > G.
"""

from __future__ import annotations

import os

from kvforge.cache.kivi.config import RESIDUAL_DTYPES, KIVICacheConfig, default_residual_dtype
from kvforge.cache.kivi.store import page_bytes
from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError
from kvforge.integrations.vllm.kivi_exact import exact_slots

KIVI_ENV = "KVFORGE_VLLM_KIVI"
# Options the backend does not implement: only their default is accepted (`check_supported`).
UNSUPPORTED_DEFAULTS = {"key_dot": "float", "value_dot": "float"}


def kivi_config(options: str | None = None) -> KIVICacheConfig:
    """The validated KIVI config of `options` (kvforge's `kivi:` option text; None: read
    KIVI_ENV), checked against what the vLLM backend implements."""
    text = os.environ.get(KIVI_ENV, "") if options is None else options
    config = parse_cache_spec("kivi:" + text.strip()).config() if text.strip() else KIVICacheConfig()
    check_supported(config)
    return config


def check_supported(config: KIVICacheConfig) -> None:
    for name, default in UNSUPPORTED_DEFAULTS.items():
        value = getattr(config, name)
        if value != default:
            source = f" (set by preset={config.preset})" if config.preset else ""
            raise ConfigError(f"{KIVI_ENV} {name}", value,
                              f"is not implemented by kvforge's vLLM KIVI backend{source}; it supports "
                              f"{name}={default} only (use kvforge's own engine for it)")
    if config.sinks > config.key_tokens:
        group = "key_group" if config.key_group is not None else "group"
        raise ConfigError(f"{KIVI_ENV} sinks", config.sinks,
                          f"must be <= {group}={config.key_tokens} in kvforge's vLLM KIVI backend (the sinks "
                          f"live in a sequence's first block, the only block prefix caching shares with it)")


def residual_dtype_name(config: KIVICacheConfig, model_dtype: str) -> str:
    """The residual dtype kvforge's cache would use for a model computing in `model_dtype`
    ('float32', 'bfloat16', 'float16')."""
    if config.residual_dtype is not None:
        return config.residual_dtype
    chosen = default_residual_dtype(RESIDUAL_DTYPES[model_dtype])
    return next(name for name, dtype in RESIDUAL_DTYPES.items() if dtype == chosen)


def page_block_bytes(config: KIVICacheConfig, kv_heads: int, head_dim: int) -> int:
    """Bytes of one vLLM block (= one kvforge KIVI page, G tokens) of one attention layer:
    key and value codes plus float16 scales and zero points, exactly kvforge's page."""
    if head_dim % config.value_channels:
        raise ConfigError("group" if config.value_group is None else "value_group", config.value_channels,
                          f"must divide head_dim={head_dim} (values are grouped over channels)")
    return page_bytes(1, kv_heads, head_dim, config.kbits, config.key_tokens, config.value_channels, config.vbits)


def sink_block_bytes(config: KIVICacheConfig, kv_heads: int, head_dim: int, residual_element_bytes: int) -> int:
    """Bytes of one block's sink area for one layer: N tokens of K and V in the residual
    dtype (0 without sinks). Every block has one: any block can be a sequence's first."""
    return 2 * config.sinks * kv_heads * head_dim * residual_element_bytes


def bytes_per_token(config: KIVICacheConfig, kv_heads: int, head_dim: int, num_cache_layers: int) -> float:
    """Quantised bytes one token costs over all cache layers: what `kvforge info` reports
    for the same setting (its KiviMemorySpec.kv_bytes_per_token)."""
    return page_block_bytes(config, kv_heads, head_dim) * num_cache_layers / config.key_tokens


def copy_pool_bytes(config: KIVICacheConfig, kv_heads: int, head_dim: int, residual_element_bytes: int,
                    max_num_seqs: int) -> int:
    """Bytes of one layer's exact copies: `exact_slots` blocks of G tokens, K and V, in the
    residual dtype (`residual_element_bytes` each)."""
    slots = exact_slots(config.key_tokens, config.residual, max_num_seqs)
    return slots * 2 * config.key_tokens * kv_heads * head_dim * residual_element_bytes


def block_bytes_with_copies(page: int, pool_bytes: int, budget_bytes: int, num_layers: int, block_size: int) -> int:
    """Bytes one vLLM block declares per layer: a page of `page` bytes plus its share of the
    copy pool (`pool_bytes` per layer), a multiple of `block_size` (vLLM's spec is
    block_size cells of equal bytes). vLLM makes N = budget_bytes // (num_layers * result)
    blocks of the budget; the result is the smallest found for which N >= 1 and the N blocks'
    spare bytes, N * (result - page), hold the pool, so pages and copies together stay
    within the budget."""
    per_layer = budget_bytes // num_layers
    blocks = (per_layer - pool_bytes) // page  # the most pages the budget could hold beside the pool
    while blocks >= 1:
        share = -(-pool_bytes // blocks)
        declared = -(-(page + share) // block_size) * block_size
        made = budget_bytes // (num_layers * declared)
        if made >= 1 and made * (declared - page) >= pool_bytes:
            return declared
        blocks -= 1
    raise ConfigError("kv_cache_memory_bytes", budget_bytes,
                      f"must hold the KIVI backend's exact copies ({pool_bytes} bytes per layer, set by "
                      f"max_num_seqs and the residual) plus one page of {page} bytes per layer, "
                      f"for {num_layers} layers")
