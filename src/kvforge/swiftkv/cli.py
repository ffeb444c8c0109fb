"""`kvforge swiftkv init | flops`: write SwiftKV checkpoints and account their FLOPs."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvforge.config import ModelConfig, SwiftKVConfig
from kvforge.errors import ConfigError, ModelLoadError, require


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be integers separated by commas, got {text!r}") from None


def add_swiftkv_parser(verbs: Any) -> argparse.ArgumentParser:
    swift = verbs.add_parser("swiftkv", help="SwiftKV checkpoints (init) and FLOP accounting (flops)")
    kinds = swift.add_subparsers(dest="swiftkv_verb", required=True)

    init = kinds.add_parser("init", help="write a SwiftKV checkpoint initialised from a base model")
    init.add_argument("--model", default="smollm2-135m", help="base model: named model, .gguf file or HF directory")
    init.add_argument("--num-key-value-layers", type=int, required=True,
                      help="l: layers < l run on every prompt token; later layers take K/V from layer l's input")
    init.add_argument("--group-size", type=int, default=1, help="g: later layers sharing one KV cache (AcrossKV, 1)")
    init.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    init.add_argument("--params-only", action="store_true",
                      help="write only the SwiftKV tensors (+ the base model's name); loads on top of the base")
    init.add_argument("--dtype", default="float32", help="dtype of the written tensors (float32)")

    flops = kinds.add_parser("flops", help="GFLOP per prompt token by part, baseline vs SwiftKV (paper Table 1)")
    source = flops.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="named model, .gguf file or HF directory")
    source.add_argument("--config", default=None, help="a Hugging Face config.json")
    flops.add_argument("--num-key-value-layers", type=_int_list, required=True, metavar="L1[,L2...]",
                       help="l of each SwiftKV setting")
    flops.add_argument("--group-size", type=_int_list, default=[1], metavar="G1[,G2...]",
                       help="g of each setting (one value applies to all)")
    flops.add_argument("--context", type=int, default=None,
                       help="prompt length the attention term averages over (default max_position_embeddings)")
    flops.add_argument("--json", metavar="OUT", default=None, help="also write the table as JSON")
    return swift


def run_swiftkv(args: argparse.Namespace) -> int:
    return {"init": _run_init, "flops": _run_flops}[args.swiftkv_verb](args)


def _run_init(args: argparse.Namespace) -> int:
    from kvforge.models.loader import load_model_config, load_state_dict, parse_dtype, resolve_model_source
    from kvforge.swiftkv.checkpoint import initial_swiftkv_tensors, write_checkpoint

    dtype = parse_dtype(args.dtype)
    swift = SwiftKVConfig(args.num_key_value_layers, args.group_size)
    source = resolve_model_source(args.model)
    base = load_model_config(source)
    if base.swiftkv is not None:
        raise ConfigError("model", args.model, "must be a base model, not a SwiftKV checkpoint")
    config = replace(base, swiftkv=swift)  # validates l and g against the layer count
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
          f"({time.perf_counter() - start:.1f} s)")
    return 0


def _run_flops(args: argparse.Namespace) -> int:
    from kvforge.swiftkv.flops import flops_table, format_flops_table

    config = _flops_config(args)
    layers, groups = args.num_key_value_layers, args.group_size
    if len(groups) == 1:
        groups = groups * len(layers)
    require(len(groups) == len(layers), "group-size", args.group_size,
            f"give one value or one per --num-key-value-layers entry ({len(layers)})")
    settings = [SwiftKVConfig(first, group) for first, group in zip(layers, groups)]
    for swift in settings:
        swift.check_layers(config.num_layers)
    context = args.context or config.max_position_embeddings
    require(context >= 1, "context", context, "must be >= 1")
    rows = flops_table(config, context, settings)
    print(format_flops_table(rows, context))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"context": context, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _flops_config(args: argparse.Namespace) -> ModelConfig:
    if args.config:
        path = Path(args.config)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}") from exc
        return replace(ModelConfig.from_hf_dict(data), swiftkv=None)
    from kvforge.models.loader import load_model_config, resolve_model_source

    return replace(load_model_config(resolve_model_source(args.model or "smollm2-135m")), swiftkv=None)
