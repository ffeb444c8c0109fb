"""`kvforge swiftkv init | flops | distill | evaluate | compare | export`: write SwiftKV checkpoints,
account their FLOPs, distill them from the base model, measure how close they come to it, show
one prompt through both, and export a self-contained checkpoint in the authors' layout."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvforge.arg_types import add_load_format_arg, at_least, thread_count
from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.devices import add_device_arg, add_dtype_arg
from kvforge.errors import ConfigError, ModelLoadError, require
from kvforge.tools.report.provenance import provenance


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:  # a layer count and a group size are both >= 1
        raise argparse.ArgumentTypeError(f"must be integers >= 1 separated by commas, got {text!r}")
    return values


def add_swiftkv_args(swift: argparse.ArgumentParser) -> None:
    """The sub-verbs of `kvforge swiftkv` and their arguments, on its parser."""
    kinds = swift.add_subparsers(dest="swiftkv_verb", required=True)

    init = kinds.add_parser("init", help="write a SwiftKV checkpoint initialised from a base model")
    init.add_argument("--model", default="smollm2-135m", help="base model: named model, .gguf file or HF directory (smollm2-135m)")
    add_load_format_arg(init)  # dummy: SwiftKV at a shape's size, for timing (needs --params-only)
    init.add_argument("--num-key-value-layers", type=int, required=True,
                      help="l: layers < l run on every prompt token; later layers take K/V from layer l's input")
    init.add_argument("--group-size", type=int, default=1, help="g: later layers sharing one KV cache (AcrossKV, 1)")
    init.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    init.add_argument("--params-only", action="store_true",
                      help="write only the SwiftKV tensors (+ the base model's name); loads on top of the base")
    init.add_argument("--dtype", default="float32", help="dtype of the written tensors (float32)")
    init.add_argument("--early-exit-head", action="store_true",
                      help="add an early-exit head on layer l's input (starts as the final head)")

    flops = kinds.add_parser("flops", help="GFLOP per prompt token by part, baseline vs SwiftKV (paper Table 1)")
    source = flops.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="named model, .gguf file or HF directory")
    source.add_argument("--config", default=None, help="a Hugging Face config.json")
    flops.add_argument("--num-key-value-layers", type=_int_list, required=True, metavar="L1[,L2...]",
                       help="l of each SwiftKV setting")
    flops.add_argument("--group-size", type=_int_list, default=[1], metavar="G1[,G2...]",
                       help="g of each setting (one value applies to all; 1)")
    flops.add_argument("--context", type=int, default=None,
                       help="prompt length the attention term averages over (default max_position_embeddings)")
    flops.add_argument("--json", metavar="OUT", default=None, help="also write the table as JSON")

    from kvforge.tools.swiftkv.recipe import add_recipe_flags

    distill = kinds.add_parser(
        "distill", help="knowledge recovery: train the SwiftKV parameters on the base model's logits",
        description="Flags and the keys of --recipe (YAML, keys = flag names) are the same; flags given "
                    "here override the recipe. Run under torchrun for data parallelism.")
    distill.add_argument("--recipe", default=None, metavar="YAML", help="recipe file (keys = the flag names)")
    add_recipe_flags(distill)

    evaluate = kinds.add_parser("evaluate", help="held-out perplexity of teacher and SwiftKV student, "
                                                 "KL(teacher || student), top-1 agreement")
    evaluate.add_argument("--swiftkv", required=True, metavar="DIR", nargs="+",
                          help="SwiftKV checkpoint(s): initialised (swiftkv init) or distilled")
    evaluate.add_argument("--model", default=None,
                          help="base (teacher) model (default: the base named by a params-only checkpoint)")
    evaluate.add_argument("--context", type=int, default=1024, help="tokens per held-out window (1024)")
    evaluate.add_argument("--max-windows", type=int, default=6, help="windows evaluated (6)")
    evaluate.add_argument("--text-file", default=None, help="text whose last 20%% is held out (default WikiText)")
    evaluate.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's, one per core)")
    add_device_arg(evaluate)  # of the teacher and every student
    add_dtype_arg(evaluate)  # of the teacher and every student; log-probabilities in float32
    evaluate.add_argument("--json", metavar="OUT", default=None, help="also write the figures as JSON")

    compare = kinds.add_parser("compare", help="one held-out prompt through the base model and a SwiftKV "
                                               "checkpoint: prefill time and greedy continuations side by side")
    compare.add_argument("--swiftkv", required=True, metavar="DIR", help="SwiftKV checkpoint")
    compare.add_argument("--model", default=None,
                         help="base model (default: the base named by a params-only checkpoint)")
    compare.add_argument("--prompt-tokens", type=at_least(1), default=1024, help="prompt length in tokens (1024)")
    compare.add_argument("--max-tokens", type=at_least(1), default=32, help="tokens generated by each system (32)")
    compare.add_argument("--repeats", type=at_least(1), default=3, help="timed prefills per system; the best counts (3)")
    compare.add_argument("--text-file", default=None, help="text whose held-out part gives the prompt")
    compare.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's, one per core)")
    add_device_arg(compare)  # of both systems
    add_dtype_arg(compare)

    memory = kinds.add_parser("memory", help="device memory per process of a sharded distillation "
                                             "(--fsdp under torchrun), estimated from the config")
    source = memory.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="named model, .gguf file or HF directory")
    source.add_argument("--config", default=None, help="a Hugging Face config.json")
    memory.add_argument("--num-key-value-layers", type=at_least(1), required=True, help="l")
    memory.add_argument("--group-size", type=at_least(1), default=1, help="g (1)")
    memory.add_argument("--processes", type=at_least(1), default=8, help="processes (GPUs) sharing the model (8)")
    memory.add_argument("--seq-len", type=at_least(1), default=8192, help="tokens per packed sequence (8192)")
    memory.add_argument("--micro-batch-size", type=at_least(1), default=1, help="sequences per micro-batch (1)")
    memory.add_argument("--fsdp-mixed-precision", default="bfloat16", choices=("none", "bfloat16"),
                        help="compute dtype of the gathered parameters (bfloat16)")
    memory.add_argument("--no-activation-checkpointing", action="store_true",
                        help="estimate without --activation-checkpointing")
    memory.add_argument("--kl-chunk-tokens", type=at_least(1), default=256, help="as the recipe key (256)")

    early = kinds.add_parser("early-exit", help="early-exit decoding on held-out prompts: exit rate, agreement "
                                                "with the final head, greedy-output agreement, decode speed")
    early.add_argument("--swiftkv", required=True, metavar="DIR", help="SwiftKV checkpoint with an early-exit head")
    early.add_argument("--model", default=None, help="base model (default: the base a params-only checkpoint names)")
    early.add_argument("--threshold", type=float, default=0.95, help="top probability to exit at (0.95)")
    early.add_argument("--prompts", type=int, default=50, help="held-out prompts (50)")
    early.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (64)")
    early.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt (64)")
    early.add_argument("--speed-prompts", type=int, default=4, help="prompts timed one at a time (4)")
    early.add_argument("--repeats", type=int, default=3, help="alternated timed runs per setting (3)")
    early.add_argument("--text-file", default=None, help="text whose held-out part gives the prompts")
    early.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's, one per core)")
    add_device_arg(early)
    add_dtype_arg(early)
    early.add_argument("--json", metavar="OUT", default=None, help="also write the figures as JSON")

    export = kinds.add_parser("export", help="a self-contained checkpoint in the authors' layout (every base "
                                             "weight, the SwiftKV tensors, the tokenizer) from a params-only one")
    export.add_argument("--swiftkv", required=True, metavar="DIR", help="SwiftKV checkpoint (params-only or full)")
    export.add_argument("--out", required=True, metavar="FULL", help="new or empty output directory")
    export.add_argument("--model", default=None,
                        help="base model (default: the base named by a params-only checkpoint)")
    export.add_argument("--dtype", default="float32", help="dtype of the written tensors (float32)")


def run_swiftkv(args: argparse.Namespace) -> int:
    return {"init": _run_init, "flops": _run_flops, "distill": _run_distill,
            "evaluate": _run_evaluate, "compare": _run_compare,
            "export": _run_export, "memory": _run_memory, "early-exit": _run_early_exit}[args.swiftkv_verb](args)


def _run_distill(args: argparse.Namespace) -> int:
    from kvforge.tools.swiftkv.distill import run_distill
    from kvforge.tools.swiftkv.recipe import recipe_from_args

    recipe = recipe_from_args(args)  # an unknown key or a bad value fails here, before any loading
    result = run_distill(recipe)
    if not result.main_process:
        return 0
    line = (f"distilled SwiftKV l={recipe.num_key_value_layers} g={recipe.group_size}: {result.steps} steps, "
            f"{result.tokens_trained:,} tokens, training {result.train_s:.0f} s (wall {result.wall_s:.0f} s) -> "
            f"{result.out}")
    print(line)
    if result.before is not None and result.after is not None:
        from kvforge.tools.swiftkv.evaluate import gap_closed

        print(f"held-out KL {result.before.kl:.4f} -> {result.after.kl:.4f}, student ppl "
              f"{result.before.student_ppl:.3f} -> {result.after.student_ppl:.3f} (teacher "
              f"{result.after.teacher_ppl:.3f}, gap closed {100 * gap_closed(result.before, result.after):.1f}%)")
    return 0


def _base_model(model: str | None, checkpoints: list[str]) -> str:
    """--model, else the base model the first (params-only) checkpoint names; every
    checkpoint must be a directory."""
    from kvforge.models.swiftkv_checkpoint import base_model_of

    for directory in checkpoints:
        if not Path(directory).is_dir():
            raise ModelLoadError(f"SwiftKV checkpoint {directory} is not a directory")
    model = model or base_model_of(checkpoints[0])
    if model is None:
        raise ConfigError("model", None, "is required: the checkpoint does not name its base model")
    return model


def _run_evaluate(args: argparse.Namespace) -> int:
    import torch

    from kvforge.models.loader import load_model
    from kvforge.models.tokenizer import load_tokenizer
    from kvforge.tools.swiftkv.evaluate import QualitySettings, compare_all, format_quality, heldout_windows

    settings = QualitySettings(args.context, args.max_windows)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = _base_model(args.model, args.swiftkv)
    teacher, source = load_model(model, dtype=args.dtype, device=args.device)
    windows = heldout_windows(load_tokenizer(source), settings, args.text_file)
    students = [load_model(model, dtype=args.dtype, swiftkv=directory, device=args.device)[0]
                for directory in args.swiftkv]
    rows = list(zip(map(str, args.swiftkv), compare_all(teacher, students, windows)))
    print(format_quality(rows, settings))
    if args.json:
        payload = {"swiftkv_evaluate": True, "model": model, "dtype": args.dtype, "context": settings.context,
                   "windows": len(windows),
                   "students": {name: quality.to_dict() for name, quality in rows}, "provenance": provenance(args)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    import torch

    from kvforge.tools.swiftkv.side_by_side import (
        SideBySideSettings,
        compare_side_by_side,
        format_side_by_side,
    )

    settings = SideBySideSettings(args.prompt_tokens, args.max_tokens, args.repeats,
                                  device=args.device, dtype=args.dtype)  # fails before loading
    model = _base_model(args.model, [args.swiftkv])
    if args.threads:
        torch.set_num_threads(args.threads)
    prompt, runs = compare_side_by_side(model, args.swiftkv, settings, args.text_file)
    print(format_side_by_side(model, args.swiftkv, prompt, runs))
    return 0


def _run_init(args: argparse.Namespace) -> int:
    from kvforge.models.loader import load_model_config, load_state_dict, parse_dtype, resolve_model_source
    from kvforge.models.swiftkv_checkpoint import config_family, initial_swiftkv_tensors, write_checkpoint

    dtype = parse_dtype(args.dtype)
    swift = SwiftKVConfig(args.num_key_value_layers, args.group_size, early_exit_head=args.early_exit_head)
    source = resolve_model_source(args.model, args.load_format)
    require(source.kind != "dummy" or args.params_only, "load_format", args.load_format,
            "a dummy base gives a params-only checkpoint only (add --params-only): a full one would be "
            "random weights on disk; load it with --model MODEL --load-format dummy --swiftkv DIR")
    base = load_model_config(source)
    if base.swiftkv is not None:
        raise ConfigError("model", args.model, "must be a base model, not a SwiftKV checkpoint")
    config = replace(base, swiftkv=swift)  # validates l and g against the layer count
    config_family(config)  # a config.json layout states it (ConfigError if not), before any weight is read
    start = time.perf_counter()
    state = load_state_dict(source, base)
    tensors = initial_swiftkv_tensors(state, base, swift)
    if not args.params_only:
        tensors = {**state, **tensors}
    out = write_checkpoint(args.out, config, tensors, dtype, base_model=args.model if args.params_only else None)
    if not args.params_only:  # a self-contained checkpoint carries its tokenizer
        from kvforge.models.tokenizer import load_tokenizer

        load_tokenizer(source).save_pretrained(str(out))
    size = sum(p.stat().st_size for p in Path(out).iterdir())
    print(f"wrote {out}: SwiftKV l={swift.num_key_value_layers} g={swift.key_value_group_size} of "
          f"{config.num_layers} layers, {len(tensors)} tensors, {size / 2**20:.1f} MiB "
          f"({time.perf_counter() - start:.1f} s)"
          + (f"; initialised from the base's weights {source.weights}: for timing only" if source.kind == "dummy"
             else ""))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    from kvforge.models.loader import parse_dtype
    from kvforge.tools.swiftkv.export import export_full_checkpoint

    start = time.perf_counter()
    result = export_full_checkpoint(args.swiftkv, args.out, base_model=args.model, dtype=parse_dtype(args.dtype))
    print(f"exported {args.swiftkv} over {result.base_model} -> {result.out}: SwiftKV "
          f"l={result.num_key_value_layers} g={result.key_value_group_size}, {result.num_tensors} tensors, "
          f"{result.bytes_written / 2**20:.1f} MiB ({time.perf_counter() - start:.1f} s)")
    return 0


def _run_early_exit(args: argparse.Namespace) -> int:
    import torch

    from kvforge.engine.llm import LLM
    from kvforge.tools.bench.machine_load import LoadProbe, flags
    from kvforge.tools.swiftkv.early_exit_eval import (
        EarlyExitSettings,
        format_early_exit,
        run_early_exit_eval,
    )

    settings = EarlyExitSettings(args.threshold, args.prompts, args.prompt_tokens, args.max_tokens,
                                 args.speed_prompts, args.repeats)  # fails before loading
    model = _base_model(args.model, [args.swiftkv])
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(model=model, swiftkv=args.swiftkv, device=args.device, dtype=args.dtype, kv_budget="1GiB")
    probe = LoadProbe()
    result = run_early_exit_eval(llm, settings, args.text_file)
    load = probe.report()
    warnings = flags(load, settings.repeats)
    print(format_early_exit(result))
    for warning in warnings:
        print(f"  warning: {warning['message']}")
    if args.json:
        result.update(swiftkv_early_exit=True, model=model, swiftkv=args.swiftkv, environment=load,
                      flags=warnings, provenance=provenance(args))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _run_memory(args: argparse.Namespace) -> int:
    from kvforge.tools.swiftkv.fsdp_memory import GIB, format_fsdp_memory, fsdp_memory

    config = _flops_config(args)
    swift = SwiftKVConfig(args.num_key_value_layers, args.group_size)
    memory = fsdp_memory(config, swift, args.processes, args.seq_len * args.micro_batch_size,
                         args.fsdp_mixed_precision, not args.no_activation_checkpointing, args.kl_chunk_tokens)
    name = args.config or args.model or "smollm2-135m"
    print(format_fsdp_memory(memory, f"{name}, SwiftKV l={swift.num_key_value_layers} g={swift.key_value_group_size}, "
                                     f"{args.processes} processes, {args.micro_batch_size} x {args.seq_len} tokens "
                                     f"per micro-batch, {args.fsdp_mixed_precision} compute, activation "
                                     f"checkpointing {'off' if args.no_activation_checkpointing else 'on'}:"))
    print(f"  (not counted: CUDA context, allocator fragmentation, attention workspaces; leave 2-4 GiB; "
          f"unsharded, one process would hold {memory.sharded_parameters * args.processes / GIB:.1f} GiB "
          f"of parameters)")
    return 0


def _run_flops(args: argparse.Namespace) -> int:
    from kvforge.tools.swiftkv.flops import flops_table, format_flops_table

    config = _flops_config(args)
    layers, groups = args.num_key_value_layers, args.group_size
    if len(groups) == 1:
        groups = groups * len(layers)
    require(len(groups) == len(layers), "group-size", args.group_size,
            f"give one value or one per --num-key-value-layers entry ({len(layers)})")
    settings = [SwiftKVConfig(first, group) for first, group in zip(layers, groups)]
    for swift in settings:
        swift.check_layers(config.num_layers)
    context = config.max_position_embeddings if args.context is None else args.context  # 0 is refused
    require(context >= 1, "context", context, "must be >= 1")
    rows = flops_table(config, context, settings)
    print(format_flops_table(rows, context))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"context": context, "rows": rows, "provenance": provenance(args)},
                                              indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _flops_config(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        path = Path(args.config)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        from kvforge.models.hf_config import config_from_hf_dict

        return replace(config_from_hf_dict(data), swiftkv=None)
    from kvforge.models.loader import load_model_config, resolve_model_source

    return replace(load_model_config(resolve_model_source(args.model or "smollm2-135m")), swiftkv=None)
