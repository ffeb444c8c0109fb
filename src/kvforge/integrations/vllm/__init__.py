"""vLLM general plugin: serve kvforge's SwiftKV checkpoints (the authors' layout,
`architectures: ["LlamaSwiftKVForCausalLM"]`, written by `kvforge swiftkv export`).

Entry point (group `vllm.general_plugins`): `kvforge.integrations.vllm:register`. vLLM calls
it in every process it starts. Importing this package does not import vLLM (nor
transformers); `register()` does, and refuses a vLLM outside the tested range.

Modules: compat (version range), layout (SwiftKV cache layers -> vLLM attention layers),
weights (checkpoint names -> parameters), hf_config (transformers config class),
engine_config (vLLM config hook), model (the vLLM model), base_checkpoint (base model as a
plain HF directory for comparisons), driver (JSON-printing runs for tests and benchmarks),
cpu_pipeline (eager pipeline parallelism on vLLM's CPU runner).
"""

from __future__ import annotations

ARCHITECTURE = "LlamaSwiftKVForCausalLM"
MODEL_CLASS = "kvforge.integrations.vllm.model:LlamaSwiftKVForCausalLM"

_registered = False


def register() -> None:
    """Register the SwiftKV model, its config class, its engine-config hook and the KIVI
    attention backend (`--attention-backend CUSTOM`) with vLLM, and let vLLM's CPU runner
    run pipeline parallelism eagerly (cpu_pipeline.py).
    Idempotent (vLLM may call plugins several times per process)."""
    global _registered
    if _registered:
        return
    import vllm

    from kvforge.integrations.vllm.compat import check_vllm_version

    check_vllm_version(vllm.__version__)  # before touching any vLLM internals
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.platforms import current_platform

    from kvforge.integrations.vllm.cpu_pipeline import register_cpu_pipeline_buffers
    from kvforge.integrations.vllm.engine_config import SwiftKVEngineConfig
    from kvforge.integrations.vllm.hf_config import register_hf_config
    from kvforge.integrations.vllm.kivi_register import register_kivi_backend

    register_hf_config()
    register_kivi_backend()  # `--attention-backend CUSTOM`: kvforge's KIVI (kivi_backend.py)
    if current_platform.is_cpu():
        register_cpu_pipeline_buffers()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)  # lazy: imported by vLLM when used
    MODELS_CONFIG_MAP[ARCHITECTURE] = SwiftKVEngineConfig
    _registered = True
