"""Named KIVI settings (`--cache kivi:preset=NAME`): option sets chosen by measurement.

A preset fills fields of KIVICacheConfig; a field it sets must be left at its default by
the user (ConfigError otherwise), so `kivi:preset=paper2,bits=4` is refused rather than
silently meaning one or the other, as is a field the preset's fields override
(`kivi:preset=quality2,bits=4`: quality2 sets key_bits and value_bits, which `bits` only
stands in for), and so is a preset that the user's fields override whole
(`kivi:preset=paper2,key_bits=4,value_bits=4`: paper2 sets only `bits`). Options a preset
does not set stay free (`kivi:preset=quality2,max_sequences=32`). Why each preset is what
it is: the Pareto table in docs/cache-methods.md (measured in docs/results/eval/).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvforge.errors import ConfigError

PRESETS: dict[str, dict[str, Any]] = {
    # The paper's setting, by name.
    "paper2": {"bits": 2},
    "paper4": {"bits": 4},
    # 2-bit-class memory with the quality of 4 bits where it matters: on smollm2-135m the
    # 2-bit error is almost all in the keys (rotating or pre-RoPE-quantising the values
    # changed nothing; every key-side option helped), so keys get 4 bits and values keep
    # 2: 4.0 stored bits per element (2-bit: 3.0, 4-bit: 5.0, each with fp16 scale and zero
    # per group of 32) for a small part of 2-bit's decode perplexity loss, on smollm2-135m
    # and on gemma3-270m (the KIVI table of docs/cache-methods.md). The C++ decode kernel
    # reads it, so it keeps KIVI's CPU decode speed.
    "quality2": {"key_bits": 4, "value_bits": 2},
    # Below 3.5 stored bits per element: 4-bit pre-RoPE keys per channel over pages of 128
    # tokens (4.25 bits), 2-bit values per token over groups of 64 channels after a Hadamard
    # rotation (2.5 bits), the first 4 tokens exact: 3.39 bits per element at 4,096 tokens.
    # On gemma3-270m, whose single 256-wide KV head made quality2's 2-bit values its main
    # loss, the rotation and the sinks take the values' error down (measured: the KIVI
    # table of docs/cache-methods.md). The C++ decode kernel reads it (keys RoPE'd in registers).
    "quality3": {"key_bits": 4, "value_bits": 2, "key_group": 128, "value_group": 64, "sinks": 4,
                 "rotation": "hadamard_values", "key_space": "pre_rope"},
}

# A field read only where the fields after it are None: a preset setting all of those leaves
# it without effect, so a user's value for it is refused as well.
SHADOWED_BY = {"bits": ("key_bits", "value_bits"), "group": ("key_group", "value_group")}


def apply_preset(config: Any) -> None:
    """Fill `config` (a frozen KIVICacheConfig, in its __post_init__) from its preset."""
    name = config.preset
    if name not in PRESETS:
        raise ConfigError("preset", name, f"must be one of {sorted(PRESETS)}")
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for shadowed, by in SHADOWED_BY.items():  # paper2 (bits) under the user's key_bits and value_bits
        if shadowed in PRESETS[name] and all(getattr(config, field) != defaults[field] for field in by):
            raise ConfigError(by[0], getattr(config, by[0]),
                              f"with {' and '.join(by)} both given, preset={name} (which sets {shadowed}) has no "
                              "effect; leave out one of them or drop the preset")
    for field, value in PRESETS[name].items():
        current = getattr(config, field)
        if current != defaults[field] and current != value:
            raise ConfigError(field, current, f"is set by preset={name} (to {value}); leave it out or drop the preset")
        object.__setattr__(config, field, value)
    for shadowed, by in SHADOWED_BY.items():  # `bits` under a preset that sets key_bits and value_bits
        current = getattr(config, shadowed)
        if all(field in PRESETS[name] for field in by) and current != defaults[shadowed]:
            raise ConfigError(shadowed, current, f"has no effect under preset={name}, which sets {' and '.join(by)}; "
                                                 "leave it out or drop the preset")
