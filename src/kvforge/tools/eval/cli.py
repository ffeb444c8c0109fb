"""Arguments of `kvforge eval <ppl|niah>` and their dispatch.

Kept free of heavy imports: an evaluation module is imported only when it runs. Later
evaluations (ruler, lm-eval) register here the same way.
"""

from __future__ import annotations

import argparse
import importlib

from kvforge.arg_types import thread_count
from kvforge.devices import add_device_arg
from kvforge.tools.bench.cli import _count

MODULES = {"ppl": "perplexity", "niah": "niah", "ruler": "ruler"}


def _add_common(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("--model", default=default_model, help="named model, .gguf file or HF directory (%(default)s)")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (weights and compute)")
    parser.add_argument("--threads", type=thread_count, default=2, help="torch CPU threads (2)")
    add_device_arg(parser)  # every system, the transformers ones included
    parser.add_argument("--cache", default="full", help="cache method under test, optionally name:key=value,... (full)")
    parser.add_argument("--cache-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the cache under test (repeatable)")
    parser.add_argument("--kv-budget", default="4GiB", help="KV-cache budget of each kvforge system (4GiB)")
    parser.add_argument("--swiftkv", default=None, metavar="DIR",
                        help="SwiftKV checkpoint laid over --model for kvforge systems (compare with: base)")
    parser.add_argument("--compare", action="append", default=[], metavar="X[,Y...]",
                        help="also evaluate: base (with --swiftkv), hf (transformers, same weights), hf-quanto:bits=2|4[,group=..,"
                             "residual=..], hf-hqq:..., hf-kivi:bits=..., or any cache spec (full, kivi:bits=4)")
    parser.add_argument("--baseline", default=None,
                        help="system the deltas refer to (default: the first full-precision compared system, "
                             "else the system under test if full precision)")
    parser.add_argument("--json", metavar="OUT", default=None, help="write per-sample results as JSON to OUT")


def add_eval_args(evaluate: argparse.ArgumentParser) -> None:
    """The sub-verbs of `kvforge eval` and their arguments, on its parser."""
    kinds = evaluate.add_subparsers(dest="eval_verb", required=True)

    ppl = kinds.add_parser("ppl", help="perplexity on held-out text, prefill or token-by-token decode")
    _add_common(ppl, "smollm2-135m")
    ppl.add_argument("--text-file", default=None,
                     help="text whose held-out part (last ~20%%) is scored (default "
                          "../shared/data/wikitext-2-raw-test.txt)")
    ppl.add_argument("--context", type=_count(2), default=2048, help="tokens per window (2048)")
    ppl.add_argument("--mode", choices=("prefill", "decode"), default="decode",
                     help="prefill: whole window at once; decode: --prefill-len tokens, then one token per step "
                          "(decode)")
    ppl.add_argument("--prefill-len", type=_count(1), default=64, help="decode mode: tokens prefilled (64)")
    ppl.add_argument("--max-windows", type=_count(1), default=None, help="score at most this many windows")
    ppl.add_argument("--batch", type=_count(1), default=None,
                     help="windows run together (default 8 in decode mode, 1 in prefill mode)")

    niah = kinds.add_parser("niah", help="pass-key retrieval over lengths x depths, heatmaps")
    _add_common(niah, "gemma3-270m")
    niah.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths in tokens (2048,4096,8192)")
    niah.add_argument("--depths", type=_count(1), default=10, help="needle depths evenly spaced over 0-100%% (10)")
    niah.add_argument("--samples", type=_count(1), default=1, help="prompts per (length, depth) cell (1)")
    niah.add_argument("--seed", type=_count(0), default=0, help="seed of the pass keys (0)")
    niah.add_argument("--key-digits", type=_count(1), default=5, help="digits of the pass key (5)")
    niah.add_argument("--haystack-file", default=None, help="text whose sentences fill the haystack "
                                                           "(default: repeated noise sentences)")
    niah.add_argument("--chat", action="store_true", help="render the prompt with the model's chat template")
    niah.add_argument("--multi-turn", type=_count(1), default=None, metavar="K",
                      help="hide K named needles and ask for them in K turns of one conversation that keeps "
                           "its cache (plain-text prompts; heatmap rows are the needles' depths)")
    niah.add_argument("--max-new-tokens", type=_count(1), default=12, help="greedy tokens generated (12)")
    niah.add_argument("--batch", type=_count(1), default=2, help="kvforge prompts run together (2)")
    niah.add_argument("--prefill-chunk", type=_count(1), default=2048, help="kvforge prefill chunk (2048)")

    ruler = kinds.add_parser("ruler", help="RULER-style synthetic long-context tasks, scored per task")
    _add_common(ruler, "gemma3-270m")
    ruler.add_argument("--lengths", default="4096", help="prompt lengths in tokens, answer included (4096)")
    ruler.add_argument("--tasks", default="all", help="all, or names/prefixes: niah, niah_single_1, vt, cwe, fwe, ...")
    ruler.add_argument("--samples", type=_count(1), default=20, help="samples per task and length (20)")
    ruler.add_argument("--seed", type=_count(0), default=0, help="seed of the generated samples (0)")
    ruler.add_argument("--haystack-file", default=None, help="text whose sentences and words fill the haystacks "
                                                           "(default ../shared/data/wikitext-2-raw-test.txt)")
    ruler.add_argument("--chat", action="store_true", help="render prompts with the model's chat template")
    ruler.add_argument("--batch", type=_count(1), default=2, help="kvforge prompts run together (2)")
    ruler.add_argument("--prefill-chunk", type=_count(1), default=2048, help="kvforge prefill chunk (2048)")


def run_eval(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"kvforge.tools.eval.{MODULES[args.eval_verb]}")
    module.run(args)
    return 0
