"""The per-layer ranks ShadowKV settings choose on one passage, measured by compressing it
through the cache (kvforge.tools.eval.shadowkv_ranks); the front reads them with `--ranks`.

    python benchmarks/shadowkv_ranks.py --model gemma3-270m --tokens 32704 \
        --cache shadowkv:rank=attention [--cache ...] --out docs/results/eval/shadowkv_ranks_gemma3-270m.json

The passage is the one `kvforge analyze key-spectra --tokens N` reads (the first N tokens of
the held-out text), so measured and spectrum-derived ranks describe the same keys.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from kvforge.tools.analysis.cli import load_model_and_tokenizer, passage_tokens
from kvforge.tools.eval.shadowkv_ranks import measure_ranks
from kvforge.tools.report.provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, required=True, help="passage length (the spectra's)")
    parser.add_argument("--cache", action="append", required=True, help="a shadowkv setting (repeatable)")
    parser.add_argument("--text-file", default=None, help="default: the held-out text")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.command_line = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    torch.set_num_threads(args.threads)
    model, tokenizer, name = load_model_and_tokenizer(args.model, "float32")
    token_ids = passage_tokens(tokenizer, args.text_file, args.tokens)
    doc = {"eval": "shadowkv-ranks", "model": args.model, "num_tokens": len(token_ids),
           "systems": measure_ranks(model, token_ids, args.cache), "provenance": provenance(args)}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for setting in doc["systems"]:
        ranks = setting["ranks"]
        print(f"{setting['cache']:<44} mean {sum(ranks) / len(ranks):.1f}  {ranks}")


if __name__ == "__main__":
    main()
