"""`kvforge demo`: the three techniques and a composition on one long held-out prompt.

One chat request (a ~3K-token passage of held-out WikiText and a question about it) is
served, greedy, by five systems on the same engine: the base model with the full cache,
SwiftKV (the committed distilled l=15 model), KIVI-2, ShadowKV, and SwiftKV + KIVI-2.
For each: the KV bytes the sequence holds after its prefill (fast tier; ShadowKV's values
on the slow tier are listed apart), the prefill time (time to first token), the decode
speed and the first words of the answer. One run each: a demonstration, not a benchmark
(`kvforge bench` measures with repeats and peers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.arg_types import thread_count
from kvforge.devices import add_device_arg, add_dtype_arg
from kvforge.errors import require

DEFAULT_SWIFTKV = "models/swiftkv-smollm2-135m-l15"
QUESTION = "\n\nWhat is this text about? Answer in one sentence."
# (name, cache spec, runs the SwiftKV model)
SYSTEMS = (("base", "full", False), ("SwiftKV", "full", True), ("KIVI-2", "kivi", False),
           ("ShadowKV", "shadowkv", False), ("SwiftKV + KIVI-2", "kivi", True))


@dataclass(frozen=True)
class DemoRow:
    system: str
    cache: str
    kv_bytes_per_sequence: int  # fast tier, after the prefill
    slow_bytes: int
    prefill_seconds: float
    decode_tokens_per_s: float
    answer_start: str
    answer: str


def add_demo_args(demo: argparse.ArgumentParser) -> None:
    """The arguments of `kvforge demo`, on its parser."""
    demo.add_argument("--model", default="smollm2-135m", help="base model (smollm2-135m)")
    demo.add_argument("--swiftkv", default=DEFAULT_SWIFTKV, metavar="DIR", help=f"SwiftKV model ({DEFAULT_SWIFTKV})")
    demo.add_argument("--prompt-tokens", type=int, default=3000, help="tokens of the passage (3000)")
    demo.add_argument("--max-tokens", type=int, default=32, help="tokens of each answer (32)")
    demo.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's, one per core)")
    add_device_arg(demo)
    add_dtype_arg(demo)
    demo.add_argument("--text-file", default=None, help="text whose held-out part gives the passage")
    demo.add_argument("--json", metavar="OUT", default=None, help="also write the table as JSON")


def _prompt(tokenizer: Any, prompt_tokens: int, text_file: str | None) -> list[int]:
    """A chat turn: the first `prompt_tokens` tokens of the held-out text, then QUESTION."""
    from kvforge.models.tokenizer import encode_prompt
    from kvforge.tools.text_data import heldout_text

    ids = tokenizer.encode(heldout_text(text_file).lstrip(), add_special_tokens=False)
    require(len(ids) >= prompt_tokens, "prompt_tokens", prompt_tokens, f"must be <= {len(ids)} (the held-out text)")
    passage = tokenizer.decode(ids[:prompt_tokens])
    return encode_prompt(tokenizer, [{"role": "user", "content": passage + QUESTION}], chat=True)


def _serve_one(engine: Any, prompt: list[int], max_tokens: int) -> tuple[dict[str, int], float, float, Any]:
    """(bytes held after the prefill, prefill s, decode tok/s, final output) of one request."""
    from kvforge.engine.sampling import SamplingParams

    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams.greedy_params(max_tokens=max_tokens))
    held, first, final = None, None, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.error:
                raise RuntimeError(output.error)
            if first is None and output.token_ids:
                first, held = time.perf_counter(), engine.cache.memory_usage()
            final = output
    end = time.perf_counter()
    tokens = len(final.token_ids)
    decode = (tokens - 1) / (end - first) if tokens > 1 and end > first else float("nan")
    return held, first - start, decode, final


def run_demo(model_name: str, swiftkv: str, prompt_tokens: int, max_tokens: int,
             text_file: str | None = None, device: str = "cpu",
             dtype: str = "float32") -> tuple[list[int], list[DemoRow]]:
    from kvforge.cache.registry import create_cache
    from kvforge.engine.engine_config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.models.loader import load_model
    from kvforge.models.tokenizer import load_tokenizer
    from kvforge.prebuild import build_cpu_kernels

    # Every C++ kernel is built (or its cached build loaded) before anything is timed: a
    # kernel first used mid-demo once compiled inside KIVI's timed decode and slowed the
    # speed shown (docs/benchmarks.md#measurements-behind-design-choices).
    # A cached build is recompiled when another checkout of the source tree (a CI clone, a
    # mutation run) loaded it last, since the build records the include path.
    if device == "cpu":
        _, seconds = build_cpu_kernels()
        print(f"[demo] C++ kernels ready in {seconds:.1f} s", file=sys.stderr, flush=True)
    base, source = load_model(model_name, dtype=dtype, device=device)
    tokenizer = load_tokenizer(source)
    prompt = _prompt(tokenizer, prompt_tokens, text_file)
    models = {False: base, True: load_model(model_name, dtype=dtype, swiftkv=swiftkv, device=device)[0]}
    rows = []
    budget = 1 << 30
    for name, spec, use_swiftkv in SYSTEMS:
        model = models[use_swiftkv]
        cache = create_cache(spec, model.cache_layout(), budget, model.dtype, device)
        engine = LLMEngine(model, cache, tokenizer, EngineConfig(budget, max_num_batched_tokens=4096))
        held, prefill, decode, output = _serve_one(engine, prompt, max_tokens)
        text = output.text.strip().replace("\n", " ")
        rows.append(DemoRow(name, spec, held["fast"], held.get("slow", 0), prefill, decode,
                            " ".join(text.split()[:8]), text))
        print(f"[demo] {name}: prefill {prefill:.2f} s, {decode:.1f} tok/s", file=sys.stderr, flush=True)
    return prompt, rows


def format_demo(rows: list[DemoRow], prompt_len: int) -> str:
    base = rows[0]
    lines = [f"One held-out passage as a chat prompt of {prompt_len} tokens, greedy answers, one run each:", "",
             f"{'system':18s} {'KV MiB/seq':>10s} {'vs base':>8s} {'prefill s':>10s} {'decode tok/s':>13s}  answer begins"]
    for row in rows:
        kv = row.kv_bytes_per_sequence / 2**20
        slow = f" (+{row.slow_bytes / 2**20:.0f} MiB slow tier)" if row.slow_bytes else ""
        lines.append(f"{row.system:18s} {kv:10.1f} {base.kv_bytes_per_sequence / row.kv_bytes_per_sequence:7.1f}x "
                     f"{row.prefill_seconds:10.2f} {row.decode_tokens_per_s:13.1f}  {row.answer_start}...{slow}")
    return "\n".join(lines)


def cmd_demo(args: argparse.Namespace) -> int:
    require(args.prompt_tokens >= 16, "prompt_tokens", args.prompt_tokens, "must be >= 16")
    require(args.max_tokens >= 2, "max_tokens", args.max_tokens, "must be >= 2")
    require(Path(args.swiftkv).is_dir(), "swiftkv", args.swiftkv, "must be a SwiftKV checkpoint directory")
    prompt, rows = run_demo(args.model, args.swiftkv, args.prompt_tokens, args.max_tokens, args.text_file,
                            args.device, args.dtype)
    print(format_demo(rows, len(prompt)))
    if args.json:
        from kvforge.tools.report.provenance import provenance

        payload = {"demo": True, "model": args.model, "dtype": args.dtype, "swiftkv": args.swiftkv,
                   "prompt_tokens": len(prompt),
                   "max_tokens": args.max_tokens, "rows": [vars(row) for row in rows], "provenance": provenance(args)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0
