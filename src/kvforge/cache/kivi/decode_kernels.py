"""Which kernel attends KIVI decode tokens (`kivi:decode_kernel=`), chosen once per cache.

- "triton": the fused Triton kernel (triton_decode.py), on CUDA; on CPU tensors only when
  it was loaded in Triton's interpreter (TRITON_INTERPRET=1, how the tests run it).
- "cpp": the compiled CPU kernel (cpu_decode.py).
- "torch": the PyTorch tile loop `attention.kivi_decode_attention`, the reference path.
- "auto": "triton" on CUDA when the `triton` package is installed, "cpp" on CPU, "torch"
  otherwise. Under "auto" a CPU kernel that fails to build falls back to "torch" (the build
  warns once), as it always has.

Options beyond the paper that a compiled kernel does not read yet (`unsupported_options`)
make "auto" pick "torch" and a forced compiled kernel a ConfigError. Rotations need no
kernel support (method.py rotates q, k and v around the kernel).

A forced kernel never falls back: `resolve_decode_kernel` checks what it needs (device,
package, build) when the cache is built and raises a ConfigError naming the rule. Every
kernel takes the same arguments and returns the same attention (parity-tested).

triton_decode.py is imported only when a cache may use it, so CPU runs never import
triton, and importing kvforge does not fix whether the kernel is interpreted.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvforge.cache.kivi.attention import kivi_decode_attention
from kvforge.cache.kivi.config import KIVICacheConfig
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available, kivi_decode_attention_cpu
from kvforge.cache.kivi.key_space import KeyTransform, StoredKeys
from kvforge.cache.kivi.plan import residual_split as split_by_residual
from kvforge.cache.kivi.quant import SUPPORTED_BITS
from kvforge.cache.kivi.store import KIVILayerView
from kvforge.errors import ConfigError
from kvforge.kernels.build import DISABLE_ENV

__all__ = ["kivi_decode", "resolve_decode_kernel"]

INSTALL_TRITON = "pip install 'kvforge[triton]'"


def _triton_module() -> ModuleType:
    from kvforge.cache.kivi import triton_decode

    return triton_decode


# What each compiled kernel reads beyond the paper's layout.
KERNEL_OPTIONS: dict[str, frozenset[str]] = {
    "cpp": frozenset({"sinks", "value_group", "key_bits=4,value_bits=2", "key_space=pre_rope", "key_dot=int8",
                       "value_dot=int8"}),
    # the Triton kernel reads any bits of keys and of values
    "triton": frozenset(f"key_bits={k},value_bits={v}" for k in SUPPORTED_BITS for v in SUPPORTED_BITS if k != v)}


def requested_options(config: KIVICacheConfig | None) -> list[str]:
    """The options of `config` that change what a decode kernel must read."""
    if config is None:
        return []
    wanted = []
    if config.sinks:
        wanted.append("sinks")
    if config.key_space == "pre_rope":
        # Rotated pre-RoPE keys must be unrotated before RoPE: only the PyTorch path does that.
        wanted.append("key_space=pre_rope" + (" with a key rotation" if config.rotates_keys else ""))
    if config.key_dot != "float":
        wanted.append(f"key_dot={config.key_dot}")
    if config.value_dot != "float":
        wanted.append(f"value_dot={config.value_dot}")
    if config.value_channels != config.key_tokens:
        wanted.append("value_group")
    if (config.kbits, config.vbits) == (4, 2):
        wanted.append("key_bits=4,value_bits=2")
    elif config.kbits != config.vbits:
        wanted.append(f"key_bits={config.kbits},value_bits={config.vbits}")
    return wanted


def unsupported_options(kernel: str, config: KIVICacheConfig | None) -> list[str]:
    if kernel == "torch":
        return []
    return [o for o in requested_options(config) if o not in KERNEL_OPTIONS[kernel]]


def resolve_decode_kernel(requested: str, device: torch.device, config: KIVICacheConfig | None = None) -> str:
    """The kernel ("triton", "cpp" or "torch") that `requested` (a DECODE_KERNELS value)
    means for a cache on `device` with `config`'s options; ConfigError when a forced kernel
    cannot run there or cannot read those options."""
    if requested == "auto":
        if device.type == "cuda" and not unsupported_options("triton", config):
            return "triton" if _triton_module().triton_available() else "torch"
        return "cpp" if device.type == "cpu" and not unsupported_options("cpp", config) else "torch"
    missing = unsupported_options(requested, config)
    if missing:
        raise ConfigError("decode_kernel", requested, f"does not read {', '.join(missing)} (a PyTorch-path "
                          f"option so far); use decode_kernel=torch or auto")
    if requested == "triton":
        triton_decode = _triton_module()
        if not triton_decode.triton_available():
            raise ConfigError("decode_kernel", requested,
                              f"needs the `triton` package, which is not installed: {INSTALL_TRITON}")
        if device.type == "cpu" and not triton_decode.triton_interpreted():
            raise ConfigError("decode_kernel", requested,
                              "runs on CUDA; on CPU only in Triton's interpreter, which needs "
                              "TRITON_INTERPRET=1 in the environment before the process starts")
        if device.type not in ("cuda", "cpu"):
            raise ConfigError("decode_kernel", requested, f"runs on CUDA (or CPU, interpreted), not {device.type}")
    if requested == "cpp":
        if device.type != "cpu":
            raise ConfigError("decode_kernel", requested, f"is the CPU kernel; the cache is on {device}")
        if not cpu_kivi_kernel_available():
            raise ConfigError("decode_kernel", requested,
                              f"needs the compiled CPU KIVI kernel, which did not build or is disabled "
                              f"({DISABLE_ENV}); use decode_kernel=torch or auto")
    return requested


def kivi_decode(kernel: str, q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, view: KIVILayerView,
                page_table: torch.Tensor, first_page_position: torch.Tensor, visible_from: torch.Tensor,
                lengths: torch.Tensor, slots: torch.Tensor, scale: float, tile_pages: int,
                key_transform: KeyTransform = None, key_dot: str = "float", value_dot: str = "float",
                residual_split: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention with the resolved `kernel`; arguments as
    `attention.kivi_decode_attention` (`tile_pages` is used by the PyTorch path only; a
    compiled kernel was resolved only where it reads every option in use).
    `residual_split`: (nk, nv) of `lengths` under the residual rules (`Decode.residual_split`,
    made once per step), which the Triton kernel reads; None: computed here."""
    args = (q, k_self, v_self, view, page_table, first_page_position, visible_from, lengths, slots, scale)
    if kernel == "triton":
        return _triton_over_view(*args, residual_split=residual_split)
    if kernel == "cpp" and cpu_kivi_kernel_available():  # False only under "auto" (checked when forced)
        tables = None
        if isinstance(key_transform, StoredKeys):
            # resolve_decode_kernel keeps rotated pre-RoPE keys off this kernel.
            assert key_transform.rotation is None, "the C++ kernel cannot unrotate pre-RoPE keys"
            tables = key_transform.rope_tables(int(lengths.max()) if lengths.numel() else 0)
        return kivi_decode_attention_cpu(*args, rope_tables=tables, key_dot=key_dot, value_dot=value_dot)
    return kivi_decode_attention(*args, tile_pages=tile_pages, key_transform=key_transform, key_dot=key_dot,
                                 value_dot=value_dot)


def _triton_over_view(q: torch.Tensor, k_self: torch.Tensor, v_self: torch.Tensor, view: KIVILayerView,
                      page_table: torch.Tensor, first_page_position: torch.Tensor, visible_from: torch.Tensor,
                      lengths: torch.Tensor, slots: torch.Tensor, scale: float,
                      residual_split: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    # The kernel takes nk and nv per sequence; for the cache they follow the residual rules
    # (keys flushed R at a time, values a window of the last R tokens).
    nk, nv = residual_split if residual_split is not None else split_by_residual(lengths, view.residual)
    return _triton_module().kivi_decode_attention_triton(
        q, k_self, v_self, view.k_codes, view.k_scale, view.k_zero, view.v_codes, view.v_scale, view.v_zero,
        view.k_res, view.v_res, slots, page_table, first_page_position, nk, nv, visible_from, lengths, scale,
        view.bits, view.group, value_bits=view.vbits)
