"""vLLM config hook for LlamaSwiftKVForCausalLM (imports vLLM).

`register()` adds it to vLLM's per-architecture MODELS_CONFIG_MAP; vLLM calls it while it
builds the engine config, before the model runner exists. It turns on
`cache_config.kv_sharing_fast_prefill`, which makes vLLM hand the trailing KV-sharing
layers (all later SwiftKV layers, see layout.py) attention metadata restricted to the rows
that need logits, and refuses what the plugin does not implement.

`KVFORGE_SWIFTKV_FAST_PREFILL=0` leaves the flag off: later layers then run on every prompt
token (same outputs, no prefill saving) and prompt logprobs work. It is off too with the KIVI
attention backend (`kivi_backend_selected`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)
FAST_PREFILL_ENV = "KVFORGE_SWIFTKV_FAST_PREFILL"


def fast_prefill_wanted() -> bool:
    return os.environ.get(FAST_PREFILL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def kivi_backend_selected(vllm_config: VllmConfig) -> bool:
    """Whether `--attention-backend CUSTOM` (kvforge's KIVI backend) is selected. Fast
    prefill stays off with it: vLLM would build the KV-sharing layers' metadata with a
    second builder, whose exact-copy plan would diverge from the one the cache owners wrote
    by; with it off, every layer of a step reads the owners' metadata (kivi_backend.py)."""
    backend = vllm_config.attention_config.backend
    return backend is not None and backend.name == "CUSTOM"


class SwiftKVEngineConfig(VerifyAndUpdateConfig):
    @staticmethod
    def verify_and_update_config(vllm_config: VllmConfig) -> None:
        from kvforge.integrations.vllm.hf_config import swiftkv_of

        hf_config = vllm_config.model_config.hf_config
        swift = swiftkv_of(hf_config)  # ValueError on a bad checkpoint, before any weight loads
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1:
            raise ValueError("kvforge's SwiftKV plugin runs with tensor_parallel_size=1 only "
                             f"(got {parallel.tensor_parallel_size}); pipeline parallelism is supported")
        stages = parallel.pipeline_parallel_size
        if stages > 1:  # the split each worker will make: refused here, before any worker starts
            from vllm.distributed.utils import get_pp_indices

            from kvforge.integrations.vllm.layout import SwiftKVCacheLayout

            layers = int(hf_config.num_hidden_layers)
            SwiftKVCacheLayout(layers, swift).check_pipeline_split(get_pp_indices(layers, stages - 1, stages)[0],
                                                                   stages)
        if getattr(vllm_config, "quant_config", None) is not None or vllm_config.model_config.quantization:
            raise ValueError("kvforge's SwiftKV plugin does not support quantized checkpoints")
        if any(t != "full_attention" for t in (getattr(hf_config, "layer_types", None) or ())):
            raise ValueError("kvforge's SwiftKV plugin supports full-attention Llama layers only")
        if fast_prefill_wanted() and not kivi_backend_selected(vllm_config):
            vllm_config.cache_config.kv_sharing_fast_prefill = True
        logger.info("kvforge SwiftKV: l=%d, g=%d of %d layers; %d KV cache layers; fast prefill %s",
                    swift.num_key_value_layers, swift.key_value_group_size, hf_config.num_hidden_layers,
                    swift.num_cache_layers(hf_config.num_hidden_layers),
                    "on" if vllm_config.cache_config.kv_sharing_fast_prefill else "off")
