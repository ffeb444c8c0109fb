"""`kvforge analyze <layer-similarity|key-spectra|kv-channels|all>`: figures and numbers
behind SwiftKV, ShadowKV and KIVI on a real model and the held-out text.

Kept free of heavy imports until a command runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvforge.arg_types import at_least, thread_count
from kvforge.devices import add_device_arg
from kvforge.tools.analysis import KINDS

CHARS_PER_TOKEN_BOUND = 8  # text prefix encoded first; real text averages ~4 chars per token


def add_analyze_args(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kvforge analyze`, on its parser."""
    parser.add_argument("kind", choices=(*KINDS, "all"), help="analysis to run (all: every one, one forward pass)")
    parser.add_argument("--model", default="smollm2-135m", help="named model, .gguf file or HF directory (smollm2-135m)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--threads", type=thread_count, default=2, help="torch CPU threads (2)")
    add_device_arg(parser)
    parser.add_argument("--text-file", default=None,
                        help="text whose held-out part supplies the passage (default: "
                             "../shared/data/wikitext-2-raw-test.txt)")
    parser.add_argument("--tokens", type=at_least(8), default=2048, help="passage length in tokens (2048)")
    parser.add_argument("--layer", type=int, default=None,
                        help="representative layer of kv-channels (default: the middle layer)")
    parser.add_argument("--out", default=None, help="output directory (default analysis/<model>/)")


def load_model_and_tokenizer(model: str, dtype: str, device: str = "cpu") -> tuple[Any, Any, str]:
    """(kvforge model, tokenizer, model name); tests replace this with a tiny model."""
    from kvforge.models.loader import load_model
    from kvforge.models.tokenizer import load_tokenizer

    net, source = load_model(model, dtype=dtype, device=device)
    return net, load_tokenizer(source), source.name


def passage_tokens(tokenizer: Any, text_file: str | None, tokens: int) -> list[int]:
    """The first `tokens` tokens of the held-out text (with BOS where the tokenizer adds it)."""
    from kvforge.errors import require
    from kvforge.tools.text_data import heldout_text

    require(tokens >= 8, "tokens", tokens, "must be >= 8 (one ShadowKV chunk)")
    text = heldout_text(text_file)
    ids = list(tokenizer.encode(text[:tokens * CHARS_PER_TOKEN_BOUND]))
    if len(ids) < tokens:
        ids = list(tokenizer.encode(text))
    require(len(ids) >= tokens, "tokens", tokens, f"the held-out text has only {len(ids)} tokens")
    return ids[:tokens]


def run_analyze(args: argparse.Namespace) -> int:
    from kvforge.tools.analysis.run import AnalysisSettings, analyze
    from kvforge.tools.text_data import default_text_file

    settings = AnalysisSettings(kinds=KINDS if args.kind == "all" else (args.kind,), layer=args.layer)
    start = time.perf_counter()
    model, tokenizer, name = load_model_and_tokenizer(args.model, args.dtype, args.device)
    token_ids = passage_tokens(tokenizer, args.text_file, args.tokens)
    print(f"[analyze] {name}: {len(token_ids)} tokens, loaded in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)
    out_dir = Path(args.out) if args.out else Path("analysis") / name
    metadata = {"model": name, "dtype": args.dtype,
                "text_file": str(args.text_file or default_text_file()), "text_part": "held-out"}
    for output in analyze(model, token_ids, out_dir, f"{name} ({args.dtype})", settings, metadata):
        print(f"== {output.kind} ==\n{output.summary}")
        print(f"wrote {output.json_path} and {output.png_path}", file=sys.stderr)
    return 0
