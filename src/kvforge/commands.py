"""The verbs on the engine itself: `kvforge generate`, `chat` and `serve` run it, `verify`
compares it with transformers on the same weights, `info` describes a model from its config.

Each verb has an `add_*_args(parser)` that fills its parser and a function that runs it
(`kvforge.cli.VERBS` names both); `kvforge.cli` imports this module only when one of these
verbs is parsed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvforge.arg_types import add_load_format_arg, at_least, thread_count
from kvforge.devices import add_device_arg
from kvforge.errors import require
from kvforge.kernels.prepack_policy import PREPACK_POLICIES
from kvforge.serve import server
from kvforge.tools.report.provenance import provenance

DEFAULT_MODEL = "smollm2-135m"
DEFAULT_KV_BUDGET = "1GiB"


MODEL_HELP = (f"named model (smollm2-135m, gemma3-270m), a .gguf file, a Hugging Face checkpoint directory "
              f"or a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct (downloaded; default {DEFAULT_MODEL})")


def _add_model_args(parser: argparse.ArgumentParser, device: bool = True, load_format: bool = True) -> None:
    """--model and --threads; --device too unless the command builds no model (info);
    --load-format unless the command needs the real weights (verify)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    if load_format:
        add_load_format_arg(parser)
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch CPU threads, >= 1 (default: torch's, one per core)")
    if device:
        add_device_arg(parser)


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto",
                        help="auto | float32 | bfloat16 | float16 (auto, the default: bfloat16 on a CPU with AMX or "
                             "AVX-512 BF16, else float32; the start-up line says which)")
    parser.add_argument("--cache", default="full", help="cache method, optionally name:key=value,... (full)")
    parser.add_argument("--cache-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="cache method option (repeatable)")
    parser.add_argument("--kv-budget", default=DEFAULT_KV_BUDGET, help=f"KV-cache memory budget, e.g. 512MB ({DEFAULT_KV_BUDGET})")
    parser.add_argument("--swiftkv", default=None, metavar="DIR",
                        help="SwiftKV checkpoint directory laid over --model (see `kvforge swiftkv init`)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens computed per engine step (prefill chunk size; 2048)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="recompute every prompt in full (default: reuse the K/V of cached prefixes)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, run every step eagerly (default: decode steps replay CUDA graphs captured at "
                             "start-up; no effect on a CPU)")
    parser.add_argument("--prepack-weights", choices=PREPACK_POLICIES, default="auto",
                        help="on a CPU, keep a oneDNN-packed copy of the linear weights for prompt-sized "
                             "products: faster prefill for the weights' memory once more (auto, the default: "
                             "when the copy takes at most a quarter of the free memory; the start-up line says)")
    parser.add_argument("--max-seq-len-to-capture", type=at_least(2), default=8192, metavar="N",
                        help="decode steps with a longer sequence run eagerly (8192)")
    parser.add_argument("--early-exit", type=float, default=None, metavar="P",
                        help="SwiftKV early exit: a decode token whose early-exit head gives its top token "
                             "probability >= P skips the later layers (needs a model with the head; off)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens per prompt (256)")
    parser.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens (0)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k best tokens (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1.0 = off)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below this fraction of the top token's probability, in [0, 1] (0 = off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 0: logits of tokens already in the prompt or output divided by it when positive, "
                             "multiplied when negative, as vLLM (1.0 = off)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="in [-2, 2]: minus this times a token's count in the output so far, as OpenAI (0 = off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="in [-2, 2]: minus this for every token already in the output, as OpenAI (0 = off)")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--structured-outputs", default=None, metavar="JSON",
                        help="the text's shape, as vLLM's structured_outputs: one of {\"json\": SCHEMA}, "
                             "{\"json_object\": true}, {\"regex\": ...}, {\"choice\": [...]}, {\"grammar\": ...} "
                             "(docs/serving.md#structured-output)")


def _sampling_params(args: argparse.Namespace):
    from kvforge.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                          seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                          structured_outputs=_structured_outputs(args.structured_outputs))


def _structured_outputs(text: str | None):
    """--structured-outputs: a JSON object of vLLM's structured_outputs fields, or None."""
    if text is None:
        return None
    from kvforge.engine.structured_output import StructuredOutputs, constraint_fields
    from kvforge.errors import ConfigError

    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise ConfigError("--structured-outputs", text, f"must be a JSON object ({exc})") from None
    require(isinstance(fields, dict), "--structured-outputs", text, "must be a JSON object, as vLLM's "
                                                                    "structured_outputs")
    return StructuredOutputs(**constraint_fields(fields, "--structured-outputs"), origin="--structured-outputs")


def _make_llm(args: argparse.Namespace):
    from kvforge.engine.llm import LLM

    llm = LLM(model=args.model, load_format=args.load_format, swiftkv=args.swiftkv, cache=args.cache,
              cache_options=args.cache_opt, dtype=args.dtype, kv_budget=args.kv_budget, max_num_batched_tokens=args.max_num_batched_tokens,
              prefix_caching=args.prefix_caching, device=args.device, early_exit=args.early_exit,
              enforce_eager=args.enforce_eager, max_seq_len_to_capture=args.max_seq_len_to_capture,
              prepack_weights=args.prepack_weights)
    for line in llm.start_up_lines():
        print(f"kvforge {args.verb}: {line}", file=sys.stderr)
    return llm


def _add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="OUT", default=None, help="also write the result as JSON")


def _write_json(path: str | None, payload: dict[str, Any], args: argparse.Namespace | None = None) -> None:
    if path:
        payload = {**payload, "provenance": provenance(args)}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser)
    _add_engine_args(parser)
    _add_sampling_args(parser)
    parser.add_argument("prompts", nargs="+", help="prompt text(s)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_json_arg(parser)


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser)
    _add_engine_args(parser)
    _add_sampling_args(parser)
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--stats", action="store_true", help="after each reply: prompt tokens, those reused, TTFT")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """`kvforge serve [MODEL]`: the model positionally as `vllm serve MODEL`, or as --model
    (the default is applied after parsing, so that giving both differently is refused:
    `kvforge.cli_checks.take_positional_model`)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model (vLLM's `vllm serve MODEL`)")
    _add_model_args(parser)
    parser.set_defaults(model=None)
    _add_engine_args(parser)
    server.add_serve_args(parser)


def add_verify_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser, load_format=False)  # it compares real weights' outputs
    parser.add_argument("--dtype", default="float32",
                        help="float32 | bfloat16 | float16: both implementations run in it (float32)")
    parser.add_argument("--text-file", default=None,
                        help="text whose held-out part supplies the passage (default: "
                             "../shared/data/wikitext-2-raw-test.txt)")
    parser.add_argument("--passage-tokens", type=int, default=256,
                        help="length of the scored passage (longer than a sliding window to test it; 256)")
    _add_json_arg(parser)


def add_info_args(parser: argparse.ArgumentParser) -> None:
    _add_model_args(parser, device=False)  # config and byte counts only: no model is built
    parser.add_argument("--swiftkv", default=None, metavar="DIR", help="SwiftKV checkpoint laid over --model")
    _add_json_arg(parser)


def _check_before_loading(args: argparse.Namespace) -> None:
    """What generate and chat can check from the config alone: max_tokens within the context."""
    from kvforge.preflight import model_context

    context = model_context(args.model, args.swiftkv, load_format=args.load_format)
    require(args.max_tokens < context, "max_tokens", args.max_tokens,
            f"must be < {context}: {args.model}'s context is {context} tokens, prompt included")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvforge.preflight import require_prompts

    params = _sampling_params(args)  # validated before the model loads
    require_prompts(args.prompts)  # empty is refused with and without the chat template
    _check_before_loading(args)
    llm = _make_llm(args)
    chat = not args.raw and llm.is_chat_model
    prompts = [[{"role": "user", "content": text}] if chat else text for text in args.prompts]
    outputs = []
    if len(prompts) == 1:
        for output in llm.stream(prompts, params):
            print(output.new_text, end="", flush=True)
            if output.finished:
                outputs.append(output)
        print()
    else:
        outputs = llm.generate(prompts, params)
        for text, output in zip(args.prompts, outputs):
            print(f"### {text}\n{output.text}\n")
    errors = [o.error for o in outputs if o.error]
    for error in errors:
        print(f"kvforge generate: error: {error}", file=sys.stderr)
    _write_json(args.json, {"outputs": [_output_record(text, o) for text, o in zip(args.prompts, outputs)]}, args)
    return 2 if errors else 0


def _output_record(prompt: str, output: Any) -> dict[str, Any]:
    return {"prompt": prompt, "text": output.text, "token_ids": output.token_ids,
            "finish_reason": output.finish_reason, "error": output.error,
            "metrics": vars(output.metrics)}


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    _check_before_loading(args)
    llm = _make_llm(args)
    if not llm.is_chat_model:
        print(f"kvforge chat: error: {args.model} has no chat template; use `kvforge generate --raw`",
              file=sys.stderr)
        return 2
    from kvforge.chat import run_chat

    return run_chat(args, llm, params)


def cmd_verify(args: argparse.Namespace) -> int:
    from kvforge.tools.verify import run_verify

    report = run_verify(args.model, text_file=args.text_file, passage_tokens=args.passage_tokens,
                        device=args.device, dtype=args.dtype)
    print(f"model                      {report.model} ({report.dtype})")
    print(f"passage tokens             {report.passage_tokens}")
    print(f"max_abs_logit_diff         {report.max_abs_logit_diff:.3e}  "
          f"(prefill {report.prefill_max_abs_logit_diff:.3e}, decode {report.decode_max_abs_logit_diff:.3e})")
    print(f"argmax_agreement           {report.argmax_agreement:.4f}")
    print(f"argmax_agreement_ties      {report.argmax_agreement_ties:.4f}  "
          "(agrees where the exactly tied maximal logits of the two intersect)")
    for name, value in report.float32_agreement.items():
        ties = report.float32_agreement_ties.get(name)
        print(f"  {name + ' vs float32':<24} {value:.4f}" + ("" if ties is None else f"  (ties {ties:.4f})"))
    print(f"greedy_match               {str(report.greedy_match).lower()}")
    _write_json(args.json, report.as_dict(), args)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from kvforge.info import format_info, model_info

    info = model_info(args.model, swiftkv=args.swiftkv, load_format=args.load_format)
    print(format_info(info))
    _write_json(args.json, info, args)
    return 0
