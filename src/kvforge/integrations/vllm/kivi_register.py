"""Make `--attention-backend CUSTOM` mean kvforge's KIVI backend, on vLLM's CPU platform too
(imports vLLM; called by `register()` in every vLLM process).

Two hooks, both the narrowest vLLM 0.32 offers:
- `register_backend(AttentionBackendEnum.CUSTOM, ...)`: vLLM's registry for third-party
  attention backends (the GPU platforms resolve CUSTOM through it);
- vLLM's CPU platform hard-codes its backend (`CpuPlatform.get_attn_backend_cls` returns
  CPU_ATTN whatever was selected, logging "Cannot use ... backend on CPU"), so its
  classmethod is wrapped to return the registered CUSTOM class when CUSTOM is the selected
  backend, and to defer to vLLM otherwise (every other selection is unchanged).
"""

from __future__ import annotations

from typing import Any

BACKEND_PATH = "kvforge.integrations.vllm.kivi_backend.KIVIAttentionBackend"


def register_kivi_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    _let_cpu_platform_select_custom()


def _let_cpu_platform_select_custom() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    original = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
    if getattr(original, "_kvforge_custom", False):
        return

    def get_attn_backend_cls(cls: Any, selected_backend: Any, attn_selector_config: Any,
                             num_heads: int | None = None) -> str:
        if selected_backend == AttentionBackendEnum.CUSTOM and not attn_selector_config.use_mla:
            return AttentionBackendEnum.CUSTOM.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._kvforge_custom = True  # type: ignore[attr-defined]
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[method-assign]
