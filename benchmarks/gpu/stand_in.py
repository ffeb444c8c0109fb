"""A stand-in checkpoint for a machine that the real weights cannot reach.

The device machine receives the repository and at most 64 MiB; smollm2-135m's weights are
98 MB even as Q4_1. The stand-in keeps everything of the model but the values of its
matrices: the architecture (config.json), the tokenizer, the norm weights exactly, and
for every matrix its shape, mean and standard deviation, from which `build` draws
Gaussian values with a fixed seed. Kernels, shapes, memory and speed are the real model's;
logits are not (no outlier channels, no attention sinks), so a check on the stand-in is a
check of the device paths, never of the model's quality.

    python benchmarks/gpu/stand_in.py stats smollm2-135m .gpu/smollm2-stats     # here: ~3 MB
    python benchmarks/gpu/stand_in.py build .gpu/smollm2-stats /tmp/smollm2      # there
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

EXACT_MAX_ELEMENTS = 1 << 16  # tensors this small (norms, biases) travel as they are
STATS_FILE = "stats.safetensors"


def write_stats(model: str, out: Path) -> None:
    from kvforge.models.loader import load_model_config, load_state_dict, resolve_model_source
    from kvforge.models.swiftkv_checkpoint import hf_config_dict
    from kvforge.models.tokenizer import load_tokenizer

    source = resolve_model_source(model)
    config = load_model_config(source)
    state = load_state_dict(source, config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(config), indent=2) + "\n")
    load_tokenizer(source).save_pretrained(str(out))
    stats: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if tensor.numel() <= EXACT_MAX_ELEMENTS:
            stats[f"exact/{name}"] = tensor.contiguous()
        else:  # shape, then mean and std, as float64 for the shape's exactness
            stats[f"shape/{name}"] = torch.tensor(tensor.shape, dtype=torch.int64)
            stats[f"moments/{name}"] = torch.stack([tensor.mean(), tensor.std()]).double()
    save_file(stats, str(out / STATS_FILE))
    print(f"stats of {len(state)} tensors of {source.path} -> {out}")


def build(stats_dir: Path, out: Path, seed: int) -> None:
    stats = load_file(str(stats_dir / STATS_FILE))
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for key in sorted(stats):
        kind, name = key.split("/", 1)
        if kind == "exact":
            state[name] = stats[key]
        elif kind == "shape":
            mean, std = stats[f"moments/{name}"].tolist()
            shape = tuple(int(n) for n in stats[key].tolist())
            state[name] = (torch.randn(shape, generator=generator) * std + mean).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    for item in stats_dir.iterdir():
        if item.name != STATS_FILE:
            shutil.copy(item, out / item.name)
    save_file(state, str(out / "model.safetensors"))
    print(f"stand-in of {len(state)} tensors (seed {seed}) -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    stats = verbs.add_parser("stats", help="config, tokenizer, exact small tensors and matrix moments")
    stats.add_argument("model")
    stats.add_argument("out", type=Path)
    made = verbs.add_parser("build", help="a checkpoint directory drawn from the stats")
    made.add_argument("stats_dir", type=Path)
    made.add_argument("out", type=Path)
    made.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.verb == "stats":
        write_stats(args.model, args.out)
    else:
        build(args.stats_dir, args.out, args.seed)


if __name__ == "__main__":
    main()
