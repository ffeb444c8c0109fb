"""Options of the `kivi` cache method (`--cache kivi:key=value,...`), validated on construction:
the paper's setting by default (2 bits, G = 32, R = 128, a 16-bit residual)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.cache.kivi.int8_keys import KEY_DOTS
from kvforge.cache.kivi.int8_values import VALUE_DOTS
from kvforge.cache.kivi.presets import apply_preset
from kvforge.cache.kivi.quant import SUPPORTED_BITS
from kvforge.errors import require

RESIDUAL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Decode attention (one query token per sequence), resolved per cache by decode_kernels.py:
# "auto" picks "triton" on CUDA (when installed), "cpp" on CPU, "torch" otherwise; the others
# force one kernel ("torch" is the PyTorch reference path of attention.py).
DECODE_KERNELS = ("auto", "triton", "torch", "cpp")
# "blockwise": prefill.py (fused attention per part, log-sum-exp merge); "reference": the
# plain PyTorch online-softmax path of attention.py.
PREFILL_ATTENTION = ("blockwise", "reference")
# How prefix caching reuses an earlier prompt (engine/prefix_cache.py): "snapshot" starts
# from the state at a chunk boundary the run without a hit has too (same tokens as without
# prefix caching, but a prompt that fits one step has no such boundary); "continue" adopts
# a finished request's whole sequence (a chat's earlier turns are never recomputed, but the
# reply was stored as decoded, not as a prefill would store it, so tokens may differ).
PREFIX_REUSE = ("snapshot", "continue")
# Which keys are quantised: "post_rope" (the paper: keys as attention reads them) or
# "pre_rope" (KVQuant: keys before RoPE, whose outlier channels sit still across tokens;
# RoPE is applied after dequantisation, at each stored token's position).
KEY_SPACES = ("post_rope", "pre_rope")
# An orthonormal Hadamard rotation of the head dimension before quantisation (rotation.py):
# "hadamard" rotates keys and values, "hadamard_keys" / "hadamard_values" one of them.
ROTATIONS = ("none", "hadamard", "hadamard_keys", "hadamard_values")


def default_residual_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The paper keeps its residual in the model's fp16; here 16 bits of the model's family."""
    return torch.bfloat16 if compute_dtype == torch.bfloat16 else torch.float16


@dataclass(frozen=True)
class KIVICacheConfig:
    bits: int = 2
    group: int = 32  # G: tokens per key group (= page size), channels per value group
    residual: int = 128  # R: full-precision tokens (key residual flush size, value window)
    # None: 16-bit as in the paper (bfloat16 for a bfloat16 model, else float16), so the
    # residual costs what a 16-bit full cache pays per token; "float32" keeps it exact.
    residual_dtype: str | None = None
    # Stored tokens dequantised at once by prefill chunks and by the PyTorch decode path.
    prefill_tile_tokens: int = 512
    decode_tile_tokens: int = 1024
    # One of DECODE_KERNELS; what a forced kernel needs (device, package, build) is checked
    # when the cache is built.
    decode_kernel: str = "auto"
    # Attention of multi-token spans (prefill chunks): one of PREFILL_ATTENTION.
    prefill_attention: str = "blockwise"
    # With prefix caching on: one of PREFIX_REUSE.
    prefix_reuse: str = "snapshot"
    # Residual slots: the most sequences held at once (running requests, kept sequences and
    # prefix snapshots alike). Their rings are allocated up front out of kv_budget, the rest
    # of which holds quantised pages; None: as many slots as a quarter of the budget pays for.
    max_sequences: int | None = None
    # Beyond the paper (defaults keep the paper's setting). key_group: tokens per key group,
    # which is also the page size; value_group: channels per value group; None: `group`.
    key_group: int | None = None
    value_group: int | None = None
    # The first `sinks` tokens of every sequence stay exact (residual_dtype), never read
    # from the quantised pages, and are left out of the range of the key group they share.
    sinks: int = 0
    key_space: str = "post_rope"  # one of KEY_SPACES
    rotation: str = "none"  # one of ROTATIONS
    # Decode scores of quantised keys: "float" (the paper's arithmetic) or "int8" (the scaled
    # query quantised to int8 per page, exact integer sums: int8_keys.py); one of KEY_DOTS.
    key_dot: str = "float"
    # Decode sums of quantised values: "float" (the paper's arithmetic) or "int8" (the
    # softmax weights times value scales quantised to 8 bits per page, exact integer sums:
    # int8_values.py); one of VALUE_DOTS.
    value_dot: str = "float"
    # Bits of key codes and of value codes; None: `bits`.
    key_bits: int | None = None
    value_bits: int | None = None
    # A named setting (PRESETS, presets.py) filling the fields above; the fields it sets must
    # be left at their defaults.
    preset: str | None = None

    @property
    def key_tokens(self) -> int:
        """Tokens per key group (= tokens per page)."""
        return self.key_group if self.key_group is not None else self.group

    @property
    def value_channels(self) -> int:
        """Channels per value group."""
        return self.value_group if self.value_group is not None else self.group

    @property
    def kbits(self) -> int:
        return self.bits if self.key_bits is None else self.key_bits

    @property
    def vbits(self) -> int:
        return self.bits if self.value_bits is None else self.value_bits

    @property
    def rotates_keys(self) -> bool:
        return self.rotation in ("hadamard", "hadamard_keys")

    @property
    def rotates_values(self) -> bool:
        return self.rotation in ("hadamard", "hadamard_values")

    def __post_init__(self) -> None:
        if self.preset is not None:
            apply_preset(self)
        require(self.bits in SUPPORTED_BITS, "bits", self.bits, f"must be one of {list(SUPPORTED_BITS)}")
        require(self.group >= 1 and 8 % self.bits == 0 and (self.group * self.bits) % 8 == 0, "group",
                self.group, f"must be >= 1 and fill whole bytes ({8 // self.bits} codes per byte)")
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            require(value is None or value in SUPPORTED_BITS, name, value, f"must be None or one of {list(SUPPORTED_BITS)}")
        for name, bits in (("key_group", self.kbits), ("value_group", self.vbits)):
            value = getattr(self, name)
            require(value is None or (value >= 1 and (value * bits) % 8 == 0), name, value,
                    f"must be None or >= 1 and fill whole bytes ({8 // bits} codes per byte)")
        require((self.key_tokens * self.kbits) % 8 == 0, "group", self.group,
                f"must fill whole bytes with {self.kbits}-bit key codes")
        kg = self.key_tokens
        key_group = f"{'key_group' if self.key_group is not None else 'group'}={kg}"  # the option the user set
        require(self.residual >= kg, "residual", self.residual, f"must be >= {key_group}")
        require(self.residual % kg == 0, "residual", self.residual, f"must be a multiple of {key_group}")
        require(self.sinks >= 0, "sinks", self.sinks, "must be >= 0")
        require(self.key_space in KEY_SPACES, "key_space", self.key_space, f"must be one of {list(KEY_SPACES)}")
        require(self.rotation in ROTATIONS, "rotation", self.rotation, f"must be one of {list(ROTATIONS)}")
        require(self.key_dot in KEY_DOTS, "key_dot", self.key_dot, f"must be one of {list(KEY_DOTS)}")
        if self.key_dot == "int8":
            require(self.key_space == "post_rope", "key_dot", self.key_dot,
                    "needs key_space=post_rope (pre-RoPE keys are rotated after dequantisation, so their "
                    "codes are not what the query multiplies)")
            require(self.kbits in (2, 4), "key_dot", self.key_dot, f"needs 2- or 4-bit keys (key bits: {self.kbits})")
        require(self.value_dot in VALUE_DOTS, "value_dot", self.value_dot, f"must be one of {list(VALUE_DOTS)}")
        if self.value_dot == "int8":
            require(self.vbits in (2, 4), "value_dot", self.value_dot,
                    f"needs 2- or 4-bit values (value bits: {self.vbits})")
            # w8 * code sums stay below 2^24 (exact in the PyTorch path's float32) up to 4,096 tokens a page.
            require(kg <= 4096, "value_dot", self.value_dot, f"needs pages of <= 4096 tokens ({key_group})")
        require(self.residual_dtype is None or self.residual_dtype in RESIDUAL_DTYPES, "residual_dtype",
                self.residual_dtype, f"must be one of {sorted(RESIDUAL_DTYPES)}")
        for name in ("prefill_tile_tokens", "decode_tile_tokens"):
            value = getattr(self, name)
            require(value >= kg, name, value, f"must be >= {key_group}")
        require(self.decode_kernel in DECODE_KERNELS, "decode_kernel", self.decode_kernel,
                f"must be one of {list(DECODE_KERNELS)}")
        require(self.prefix_reuse in PREFIX_REUSE, "prefix_reuse", self.prefix_reuse,
                f"must be one of {list(PREFIX_REUSE)}")
        require(self.max_sequences is None or self.max_sequences >= 1, "max_sequences", self.max_sequences,
                "must be None or >= 1")
        require(self.prefill_attention in PREFILL_ATTENTION, "prefill_attention", self.prefill_attention,
                f"must be one of {list(PREFILL_ATTENTION)}")
