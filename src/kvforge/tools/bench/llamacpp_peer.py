"""The llama.cpp peer of `kvforge bench prefill` and `kvforge bench decode`:
`--compare llama.cpp[:WEIGHTS]`, run in the same process as the kvforge systems, on the same
GGUF model, thread count and prompt token ids. Needs the optional `peers` extra
(llama-cpp-python, which compiles llama.cpp from source).

WEIGHTS (llamacpp_option.py, where `--compare` entries are parsed):
  f16 (the default), bf16, f32   a GGUF converted from the file kvforge loads by llama.cpp's
                                 own quantize (`llama_model_quantize`, allow_requantize, every
                                 2-D weight to that type), cached under
                                 $KVFORGE_CACHE_DIR/llama.cpp (else ~/.cache/kvforge/llama.cpp),
                                 keyed by the source file's path, size and mtime;
  as-shipped                     the file kvforge loads, as it is (smollm2-135m: Q4_1).

Timed exactly as the kvforge counterpart (llamacpp_session.Session does the calls):
- prefill: the prompts, as separate sequences in one llama_batch (filled before the clock
  starts), go through one llama_decode call, then the argmax of each sequence's logits;
- decode: the prompts are prefilled (untimed), then gen-1 lock-step llama_decode calls of
  one token per sequence, each sequence's greedy argmax fed back, are timed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvforge.errors import KVForgeError, require
from kvforge.tools.bench.common import BenchContext, log
from kvforge.tools.bench.llamacpp_option import WEIGHTS
from kvforge.tools.bench.llamacpp_session import Session, load_library
from kvforge.tools.bench.systems import System
from kvforge.user_cache import user_cache_dir

KV_ELEMENT_BYTES = 2  # llama.cpp's default KV cache type is F16
TIMING = {
    "prefill": "the prompts as separate sequences in one llama_batch (filled untimed), one llama_decode "
               "call, then the argmax of each sequence's logits",
    "decode": "prompts prefilled untimed, then G-1 lock-step llama_decode calls of one token per sequence "
              "with each sequence's greedy argmax fed back",
}


def cache_root() -> Path:
    return user_cache_dir("llama.cpp")


def converted_path(source: Path, weights: str, root: Path | None = None) -> Path:
    """Where the `weights` conversion of `source` is cached. Invariant: the name changes
    whenever the source's resolved path, size or mtime does, so a stale file is never used."""
    require(WEIGHTS.get(weights) is not None, "weights", weights,
            f"must be a converted type: {', '.join(k for k, v in WEIGHTS.items() if v is not None)}")
    resolved = source.resolve()
    stat = resolved.stat()
    key = hashlib.sha256(f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return (root or cache_root()) / f"{resolved.stem}-{key}-{weights}.gguf"


def weights_file(source: Path, weights: str, threads: int) -> Path:
    """The GGUF file llama.cpp runs: the source itself, or its cached conversion (made now
    if missing, written to a temporary name and renamed, so a cached file is complete)."""
    if WEIGHTS[weights] is None:
        return source
    target = converted_path(source, weights)
    if target.is_file():
        log(f"llama.cpp {weights} weights (cached): {target}")
        return target
    lib = load_library()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    params = lib.llama_model_quantize_default_params()
    params.ftype = WEIGHTS[weights]
    params.allow_requantize = True  # the source is quantised: dequantise, then convert
    params.pure = True  # every 2-D weight to the one type (no per-tensor mixture)
    params.nthread = threads
    start = time.perf_counter()
    status = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0:
        partial.unlink(missing_ok=True)
        raise KVForgeError(f"llama.cpp could not convert {source} to {weights} (status {status})")
    os.replace(partial, target)
    log(f"llama.cpp {weights} weights converted from {source} in {time.perf_counter() - start:.1f} s: {target}")
    return target


def weight_bytes_per_step(path: Path) -> int:
    """Weight bytes one decode step reads from the GGUF file: every tensor but the token
    embedding, which is read in full only when it is also the output head (tied)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    untied = "output.weight" in tensors
    return sum(size for name, size in tensors.items() if not (untied and name == "token_embd.weight"))


def open_session(ctx: BenchContext, system: System, sequences: int, tokens_per_sequence: int,
                 prompt_tokens: int) -> Session:
    """The peer's context for this benchmark's shapes, on the weights `system` names."""
    assert system.weights is not None
    path = weights_file(ctx.source.path, system.weights, ctx.args.threads)
    start = time.perf_counter()
    session = Session(path, ctx.args.threads, sequences, tokens_per_sequence, prompt_tokens,
                      flash_attn=getattr(ctx.args, "llama_cpp_flash_attn", "auto"))
    log(f"llama.cpp model loaded ({time.perf_counter() - start:.1f} s): {session.model_description()}")
    return session


def describe(session: Session, weights: str) -> dict[str, Any]:
    """What the JSON records about the peer: version, the CPU features its build uses (two
    builds of one version differ by them: a batch-1 row moved 1.5x between builds of 0.3.36),
    weights, file and context settings."""
    import llama_cpp

    features = llama_cpp.llama_print_system_info()
    return {"version": llama_cpp.__version__,
            "system_info": features.decode(errors="replace").strip() if isinstance(features, bytes) else str(features),
            "weights": weights, "file": str(session.path),
            "model": session.model_description(), **session.settings}


def prefill(session: Session) -> float:
    """Seconds of one prefill of the loaded prompts (the cells are cleared first, untimed)."""
    session.clear()
    start = time.perf_counter()
    session.run_prompts()
    return time.perf_counter() - start


def decode(session: Session, prompts: Sequence[Sequence[int]], gen: int) -> dict[str, Any]:
    """Prefill (untimed) then gen-1 timed lock-step greedy steps; seconds and tokens."""
    context = len(prompts[0])
    require(all(len(p) == context for p in prompts), "prompts", [len(p) for p in prompts], "must share one length")
    session.clear()
    prefill_start = time.perf_counter()
    session.load_prompts(prompts)
    tokens = session.run_prompts()
    prefill_seconds = time.perf_counter() - prefill_start
    start = time.perf_counter()
    for step in range(gen - 1):
        tokens = session.step(tokens, context + step)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": len(prompts) * (gen - 1), "steps": gen - 1,
            "prefill_seconds": prefill_seconds}

