"""Arguments of `kvforge bench <prefill|decode|throughput|prefix|serve|soak>` and their dispatch.

Kept free of heavy imports: a benchmark module is imported only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from kvforge.arg_types import add_load_format_arg, at_least, thread_count
from kvforge.devices import add_device_arg
from kvforge.kernels.prepack_policy import PREPACK_POLICIES
from kvforge.tools.bench.soak_options import add_soak_args

_count = at_least  # an integer option with a lower bound


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="named model, .gguf file or HF directory (smollm2-135m)")
    add_load_format_arg(parser)  # dummy: transformers gets the same random weights
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (weights and compute)")
    parser.add_argument("--threads", type=thread_count, default=2, help="torch CPU threads for every system (2)")
    add_device_arg(parser)  # every system, the transformers peer included
    parser.add_argument("--cache", default="full", help="cache method under test, optionally name:key=value,... (full)")
    parser.add_argument("--cache-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="option of the cache under test (repeatable)")
    parser.add_argument("--kv-budget", default="4GiB",
                        help="KV-cache budget of each kvforge system (4GiB; untouched pages cost no RAM); bench "
                             "throughput takes several, comma-separated, and runs every system under each")
    parser.add_argument("--swiftkv", default=None, metavar="DIR",
                        help="SwiftKV checkpoint laid over --model; kvforge systems run it (see --compare base)")
    parser.add_argument("--compare", action="append", default=[], metavar="X[,Y...]",
                        help="also measure: hf (transformers, same weights), no-prefix-caching, eager (on CUDA: "
                             "the system under test without CUDA graphs), base (with --swiftkv: the base "
                             "model, same cache), merge-all-layers (the base model, same cache, one cache layer stored for "
                             "all: the SwiftKV paper's ideal-compression reference), a cache spec such as full or "
                             "full:storage_dtype=bfloat16 (SPEC@DIR: on the SwiftKV checkpoint DIR; SPEC@base: on the "
                             "base model), or (bench prefill and decode) hf-static: transformers' static cache "
                             "with its forward compiled (compile time reported apart, never timed), or (bench "
                             "prefill and decode; pip install -e '.[peers]') llama.cpp[:f16|bf16|f32|as-shipped]: "
                             "llama.cpp on the model's GGUF file converted to that type (f16), or as shipped")
    parser.add_argument("--llama-cpp-flash-attn", choices=("auto", "on", "off"), default="auto",
                        help="the llama.cpp peer's flash attention (llama.cpp's -fa): auto, its default, turns it "
                             "on where the backend supports it, which on some CPUs makes decode slower; measure "
                             "both and quote the faster (auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, kvforge systems run every step eagerly (default: decode steps replay CUDA "
                             "graphs captured when each engine starts)")
    _add_prepack(parser)
    parser.add_argument("--prefix-caching", action="store_true",
                        help="kvforge systems reuse cached prompt prefixes (off by default: repeats would hit the "
                             "previous repeat); --compare no-prefix-caching adds the system under test without it")
    parser.add_argument("--json", metavar="OUT", default=None, help="write JSON to OUT and a plot to OUT.png")
    parser.add_argument("--repeats", type=_count(1), default=3, help="timed runs per system; median reported (3)")
    parser.add_argument("--warmup", type=_count(0), default=1, help="untimed runs per system first (1)")
    parser.add_argument("--rounds", type=_count(1), default=1,
                        help="measure the whole list of systems this many times, in reverse order every other "
                             "round (A B, B A, ...), so drift of a shared machine over a long command touches "
                             "every system alike; each round runs --warmup and --repeats again (1)")
    parser.add_argument("--seed", type=_count(0), default=0, help="seed of the random prompt token ids (0)")
    parser.add_argument("--max-position-embeddings", type=_count(2), default=None, metavar="N",
                        help="raise the model's position limit to N for speed runs past its trained context "
                             "(RoPE extrapolates; outputs there are not meaningful), e.g. --context 16384 on "
                             "smollm2-135m (8192)")


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    """The sub-verbs of `kvforge bench` and their arguments, on its parser."""
    kinds = bench.add_subparsers(dest="bench_verb", required=True)

    prefill = kinds.add_parser("prefill", help="prompt tokens/s to the first token (one engine step)")
    _add_common(prefill)
    prefill.add_argument("--prompt-len", type=_count(1), default=512, help="tokens per prompt (512)")
    prefill.add_argument("--batch", type=_count(1), default=1, help="prompts prefilled together (1)")

    decode = kinds.add_parser("decode", help="generated tokens/s with the prefill excluded")
    _add_common(decode)
    decode.add_argument("--batch", type=_count(1), default=1, help="sequences decoded together (1)")
    decode.add_argument("--context", type=_count(1), default=512, help="prompt tokens per sequence (512)")
    decode.add_argument("--gen", type=_count(2), default=64, help="tokens generated per sequence (64)")

    throughput = kinds.add_parser("throughput", help="requests submitted at once, served to completion")
    _add_common(throughput)
    throughput.add_argument("--num-requests", type=_count(1), default=16, help="requests (16)")
    throughput.add_argument("--input-len", type=_count(1), default=512, help="prompt tokens per request (512)")
    throughput.add_argument("--output-len", type=_count(1), default=64, help="generated tokens per request (64)")
    throughput.add_argument("--shared-prefix", type=_count(0), default=0,
                            help="tokens of a system prompt every request starts with (0); see --prefix-caching")
    throughput.add_argument("--max-num-batched-tokens", type=_count(1), default=2048,
                            help="kvforge tokens per engine step (2048)")
    throughput.add_argument("--max-num-seqs", type=_count(1), default=256, help="kvforge running sequences (256)")
    throughput.add_argument("--admission", choices=("optimistic", "reserve"), default="optimistic",
                            help="kvforge admission policy for every system: optimistic (admit when the next "
                                 "chunk fits, preempt later) or reserve (admit when prompt + max_tokens of every "
                                 "running request fit the budget; no preemption)")
    throughput.add_argument("--no-step-split", dest="step_split", action="store_false",
                            help="skip the extra timed run per kvforge system that splits a step into linear "
                                 "layers, attention, sampling and the rest (the headline runs never have a timer)")
    throughput.add_argument("--hf-batch", type=_count(1), default=None,
                            help="transformers static batch size (default min(num_requests, 16))")
    prefix = kinds.add_parser("prefix", help="a conversation over a shared document, with and without prefix caching")
    _add_common(prefix)
    prefix.add_argument("--shared-prefix", type=_count(1), default=2048, help="tokens of the shared document (2048)")
    prefix.add_argument("--turns", type=_count(2), default=8, help="turns of the conversation (8)")
    prefix.add_argument("--question-len", type=_count(1), default=32, help="tokens of each turn's question (32)")
    prefix.add_argument("--output-len", type=_count(1), default=32, help="tokens of each reply (32)")
    prefix.add_argument("--max-num-batched-tokens", type=_count(1), default=2048, help="tokens per engine step (2048)")
    prefix.add_argument("--text-file", default=None, help="text whose held-out part gives the document and questions")
    _add_serve(kinds)
    add_soak_args(kinds)


def _add_prepack(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prepack-weights", choices=PREPACK_POLICIES, default="auto",
                        help="kvforge systems on a CPU: keep a oneDNN-packed copy of the linear weights for "
                             "prompt-sized products (auto, the default: when it takes at most a quarter of the "
                             "free memory)")


def _add_serve(kinds: Any) -> None:
    serve = kinds.add_parser("serve", help="TTFT/TPOT/ITL and throughput of servers under Poisson arrivals")
    serve.add_argument("--model", default="smollm2-135m",
                       help="model the started servers load; its tokenizer cuts the prompts (smollm2-135m)")
    add_load_format_arg(serve)  # dummy: prompts of random token ids, servers answer token ids
    serve.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    serve.add_argument("--threads", type=_count(1), default=2, help="torch CPU threads of each server (2)")
    add_device_arg(serve)  # of each started server
    serve.add_argument("--cache", default="full", help="cache method of the server under test (full)")
    serve.add_argument("--cache-opt", action="append", default=[], metavar="KEY=VALUE",
                       help="option of the cache under test (repeatable)")
    serve.add_argument("--kv-budget", default="4GiB", help="KV-cache budget of each started server (4GiB)")
    _add_prepack(serve)
    serve.add_argument("--swiftkv", default=None, metavar="DIR", help="SwiftKV checkpoint laid over --model")
    serve.add_argument("--compare", action="append", default=[], metavar="X[,Y...]",
                       help="also measure: base (with --swiftkv: the base model), cache specs, or vllm (vLLM's "
                            "server of the same weights, from --vllm-python's environment), each a server")
    serve.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="python of an environment with vLLM and kvforge, for --compare vllm "
                            "(default $KVFORGE_VLLM_PYTHON)")
    serve.add_argument("--base-url", default=None,
                       help="measure the OpenAI-compatible server at this URL (http://HOST:PORT or .../v1) as "
                            "the system under test (vLLM, llama.cpp's server, ...) instead of starting one")
    serve.add_argument("--served-model-name", default=None, help="model name for --base-url (default: its first)")
    serve.add_argument("--api-key", default=None, help="bearer key for --base-url")
    serve.add_argument("--request-rate", default="1,inf",
                       help="comma-separated requests/s, Poisson arrivals; inf sends all at once (1,inf)")
    serve.add_argument("--workload", choices=("poisson", "chat"), default="poisson",
                       help="poisson: --num-prompts requests per --request-rate; chat: one client's --turns-turn "
                            "conversation over a --shared-prefix-token document, history re-sent (poisson)")
    serve.add_argument("--repeats", type=_count(1), default=1,
                       help="runs per rate (poisson) or conversations (chat), each on fresh prompts; headline "
                            "figures are their medians (1)")
    serve.add_argument("--shared-prefix", type=_count(1), default=1500, help="chat: tokens of the document (1500)")
    serve.add_argument("--turns", type=_count(2), default=6, help="chat: turns of the conversation (6)")
    serve.add_argument("--question-len", type=_count(1), default=32, help="chat: tokens of each question (32)")
    serve.add_argument("--num-prompts", type=_count(1), default=16, help="requests per rate (16)")
    serve.add_argument("--input-len", default="512", help="prompt tokens: N or A:B (512)")
    serve.add_argument("--output-len", default="64", help="generated tokens: N or A:B; chat: each reply (64)")
    serve.add_argument("--prompt-format", choices=("token-ids", "text"), default="token-ids",
                       help="send prompts as token ids (exact lengths) or as their text (token-ids)")
    serve.add_argument("--text-file", default=None, help="text whose held-out part gives the prompts")
    serve.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft=2,tpot=100ms")
    serve.add_argument("--max-num-batched-tokens", type=_count(1), default=2048, help="started servers (2048)")
    serve.add_argument("--max-num-seqs", type=_count(1), default=256, help="started servers (256)")
    serve.add_argument("--admission", choices=("optimistic", "reserve"), default="optimistic",
                       help="admission policy of the started servers (optimistic)")
    serve.add_argument("--request-timeout", type=float, default=1800.0, help="seconds before a request fails (1800)")
    serve.add_argument("--step-split", action="store_true",
                       help="start kvforge servers with --step-timing and report each step kind's time by part "
                            "(linear, attention, sampling, the rest); the timer turns the fused decode layer off, "
                            "so decode runs slower than a user's server (off)")
    serve.add_argument("--profile-servers", default=None, metavar="PY_SPY",
                       help="sample each started server (all its processes) with this py-spy executable during "
                            "its runs and report where its CPU time goes per engine step (off)")
    serve.add_argument("--seed", type=_count(0), default=0, help="seed of prompts, lengths and arrivals (0)")
    serve.add_argument("--json", metavar="OUT", default=None, help="write JSON to OUT and a plot to OUT.png")


PEER_VERBS = ("prefill", "decode")  # the bench verbs that run the llama.cpp peer


def _compare_entries(args: argparse.Namespace) -> list[str]:
    """Every --compare entry, the comma-separated lists flattened."""
    return [piece.strip() for text in getattr(args, "compare", ()) for piece in text.split(",")]


def _check_llamacpp_only_options(args: argparse.Namespace) -> None:
    """An option of the llama.cpp peer given without that peer would change nothing: refused."""
    from kvforge.errors import require
    from kvforge.tools.bench.llamacpp_option import is_peer

    flash_attn = getattr(args, "llama_cpp_flash_attn", "auto")
    if flash_attn != "auto":
        require(any(is_peer(entry) for entry in _compare_entries(args)), "llama_cpp_flash_attn", flash_attn,
                "sets the llama.cpp peer's flash attention: add --compare llama.cpp")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_verb not in PEER_VERBS:  # before anything loads (bench prefix ignores --compare otherwise)
        from kvforge.tools.bench.llamacpp_option import is_peer, parse

        for entry in _compare_entries(args):
            if is_peer(entry):
                parse(entry, allowed=False)
    _check_llamacpp_only_options(args)
    module = importlib.import_module(f"kvforge.tools.bench.{args.bench_verb}")
    result = module.run(args)
    return 1 if result.get("failures") else 0  # a benchmark that judges properties (soak) lists what failed
