"""The distillation recipe: one validated dataclass, readable from CLI flags and from YAML.

A recipe file is a YAML mapping whose keys are the CLI flag names without the leading
dashes (`learning-rate: 2.0e-4`; underscores are accepted too). Flags given on the command
line override the file, the file overrides the defaults. An unknown key, a value of the
wrong type or an invalid value fails here, before any model or data is loaded.

The recipe written next to a distilled checkpoint (`recipe.yaml`) holds every key, so
`kvforge swiftkv distill --recipe OUT/recipe.yaml` repeats the run.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvforge.errors import ConfigError, require

LR_SCHEDULES = ("cosine", "linear")

# key -> (kind, help). Kinds: int, float, str, bool, and "int?" / "str?" for optional values.
# This table is the single source of the CLI flags, the YAML keys and their coercion.
RECIPE_KEYS: dict[str, tuple[str, str]] = {
    "model": ("str", "base (teacher) model: named model, .gguf file or HF directory"),
    "num_key_value_layers": ("int?", "l: layers >= l take K/V from layer l's input (required)"),
    "group_size": ("int", "g: later layers sharing one KV cache (AcrossKV)"),
    "out": ("str?", "output directory: params-only SwiftKV checkpoint + recipe + metrics (required)"),
    "init_from": ("str?", "start the trained tensors from this SwiftKV checkpoint (same model and l, same g "
                          "or g = 1 whose K/V projections are averaged per group; e.g. an earlier "
                          "distillation) instead of the `swiftkv init` initialisation"),
    "train_later_layers": ("bool", "train every parameter of the later layers (ablation), not only "
                                   "norm_swiftkv and the *_proj_swiftkv projections"),
    "data": ("str?", "training data: a text file (its first 80%% is used) or a .jsonl chat file "
                     "({\"messages\": [...]}); default: the WikiText file's training part"),
    "self_generate": ("int", "train on N completions sampled from the teacher (by the engine) for "
                             "prompts drawn from --data, instead of on --data itself (0: off)"),
    "self_generate_max_tokens": ("int", "tokens per self-generated completion"),
    "self_generate_prompt_tokens": ("int", "tokens per prompt drawn from a text file for --self-generate"),
    "self_generate_temperature": ("float", "sampling temperature of --self-generate"),
    "seq_len": ("int", "tokens per packed training sequence"),
    "micro_batch_size": ("int", "sequences per forward/backward pass (per process)"),
    "grad_accum": ("int", "micro-batches accumulated per optimizer step (per process)"),
    "epochs": ("float", "passes over the packed data (fractions allowed); --max-steps overrides"),
    "max_steps": ("int?", "optimizer steps to run (default: from --epochs)"),
    "learning_rate": ("float", "AdamW peak learning rate"),
    "weight_decay": ("float", "AdamW weight decay"),
    "warmup_ratio": ("float", "fraction of the steps with linear warmup"),
    "lr_schedule": ("str", "decay after warmup: cosine or linear (to 0)"),
    "max_grad_norm": ("float", "gradient clipping threshold (global L2 norm); 0 disables"),
    "temperature": ("float", "distillation temperature T; the loss is T^2 * KL(teacher || student)"),
    "kl_chunk_tokens": ("int", "tokens whose vocabulary logits are materialised at once (memory bound)"),
    "hidden_loss_weight": ("float", "weight of the hidden-state MSE term (0: off)"),
    "hidden_loss_layer": ("int?", "the MSE compares the inputs of this layer (default: the last hidden "
                                  "state, num_layers); must be > l"),
    "early_exit_head": ("bool", "also train an early-exit head on layer l's input (paper App. E): its KL to "
                                "the teacher is added to the loss; `--init-from` a model without one starts "
                                "it at the final head"),
    "early_exit_only": ("bool", "train only the early-exit head: the SwiftKV tensors stay as loaded (e.g. "
                                "from --init-from); the head depends on the base layers < l only"),
    "bf16": ("bool", "bfloat16 autocast for the layer forwards (the KL stays float32)"),
    "fsdp": ("bool", "shard the frozen base and the trained tensors over the torchrun processes with "
                     "FSDP2 (fully_shard; gloo on CPU, NCCL on CUDA); states and exports stay full tensors"),
    "fsdp_mixed_precision": ("str", "FSDP parameter dtype in the forward: none (as loaded) or bfloat16 "
                                    "(gradients reduced in float32); needs --fsdp"),
    "activation_checkpointing": ("bool", "recompute each student layer in the backward instead of keeping "
                                         "its activations (less memory, about one more forward)"),
    "seed": ("int", "seed of the data order, the self-generated data and torch"),
    "threads": ("int?", "torch threads per process"),
    "device": ("str", "cpu or cuda (under torchrun each process takes cuda:LOCAL_RANK)"),
    "save_every": ("int", "write a resumable training state every N steps (and at the end)"),
    "keep_checkpoints": ("int", "training states kept under OUT/checkpoints (older ones are deleted)"),
    "resume": ("str?", "resume from a training state directory, or 'auto' for the latest under "
                       "OUT/checkpoints"),
    "eval_windows": ("int", "held-out windows evaluated before and after training (0: off)"),
    "eval_context": ("int", "tokens per evaluation window"),
}

# Keys that do not change the trajectory of the training (may differ on resume).
NON_TRAJECTORY_KEYS = frozenset({"out", "threads", "device", "save_every", "keep_checkpoints", "resume",
                                 "eval_windows", "eval_context", "fsdp", "activation_checkpointing"})


@dataclass(frozen=True)
class DistillRecipe:
    model: str = "smollm2-135m"
    num_key_value_layers: int | None = None
    group_size: int = 1
    out: str | None = None
    init_from: str | None = None
    train_later_layers: bool = False
    data: str | None = None
    self_generate: int = 0
    self_generate_max_tokens: int = 256
    self_generate_prompt_tokens: int = 64
    self_generate_temperature: float = 1.0
    seq_len: int = 512
    micro_batch_size: int = 1
    grad_accum: int = 8
    epochs: float = 1.0
    max_steps: int | None = None
    learning_rate: float = 2e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    lr_schedule: str = "cosine"
    max_grad_norm: float = 1.0
    temperature: float = 2.0
    kl_chunk_tokens: int = 256
    hidden_loss_weight: float = 0.0
    hidden_loss_layer: int | None = None
    early_exit_head: bool = False
    early_exit_only: bool = False
    bf16: bool = False
    fsdp: bool = False
    fsdp_mixed_precision: str = "none"
    activation_checkpointing: bool = False
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    save_every: int = 100
    keep_checkpoints: int = 1
    resume: str | None = None
    eval_windows: int = 0
    eval_context: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):  # types first, so the rules below compare numbers
            object.__setattr__(self, f.name, _coerce(f.name, getattr(self, f.name)))
        require(bool(self.model), "model", self.model, "must name a base model")
        require(self.num_key_value_layers is not None, "num-key-value-layers", None,
                "is required (flag or recipe key)")
        require(self.num_key_value_layers >= 1, "num-key-value-layers", self.num_key_value_layers, "must be >= 1")
        require(self.out is not None and self.out != "", "out", self.out, "is required (flag or recipe key)")
        for name in ("group_size", "seq_len", "micro_batch_size", "grad_accum", "kl_chunk_tokens",
                     "save_every", "keep_checkpoints", "self_generate_max_tokens", "self_generate_prompt_tokens"):
            require(getattr(self, name) >= 1, _flag(name), getattr(self, name), "must be >= 1")
        require(self.seq_len >= 2, "seq-len", self.seq_len, "must be >= 2")
        require(self.self_generate >= 0, "self-generate", self.self_generate, "must be >= 0 (0: off)")
        require(self.self_generate_temperature >= 0, "self-generate-temperature", self.self_generate_temperature,
                "must be >= 0 (0: greedy)")
        require(self.epochs > 0, "epochs", self.epochs, "must be > 0")
        require(self.max_steps is None or self.max_steps >= 1, "max-steps", self.max_steps, "must be >= 1")
        require(self.learning_rate > 0, "learning-rate", self.learning_rate, "must be > 0")
        require(self.weight_decay >= 0, "weight-decay", self.weight_decay, "must be >= 0")
        require(0 <= self.warmup_ratio < 1, "warmup-ratio", self.warmup_ratio, "must be in [0, 1)")
        require(self.lr_schedule in LR_SCHEDULES, "lr-schedule", self.lr_schedule, f"must be one of {LR_SCHEDULES}")
        require(self.max_grad_norm >= 0, "max-grad-norm", self.max_grad_norm, "must be >= 0 (0 disables)")
        require(self.temperature > 0, "temperature", self.temperature, "must be > 0")
        require(self.hidden_loss_weight >= 0, "hidden-loss-weight", self.hidden_loss_weight, "must be >= 0")
        if self.hidden_loss_layer is not None:
            require(self.hidden_loss_layer > self.num_key_value_layers, "hidden-loss-layer",
                    self.hidden_loss_layer, f"must be > num-key-value-layers={self.num_key_value_layers} "
                    "(earlier inputs are identical in teacher and student)")
        require(self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1")
        require(0 <= self.seed < 2**63, "seed", self.seed, "must be in [0, 2**63) (torch.manual_seed's range)")
        require(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device", self.device,
                "must be cpu, cuda or cuda:N")
        from kvforge.tools.swiftkv.sharding import MIXED_PRECISIONS

        require(self.fsdp_mixed_precision in MIXED_PRECISIONS, "fsdp-mixed-precision", self.fsdp_mixed_precision,
                f"must be one of {MIXED_PRECISIONS}")
        require(self.fsdp or self.fsdp_mixed_precision == "none", "fsdp-mixed-precision",
                self.fsdp_mixed_precision, "needs --fsdp (without it use --bf16 autocast)")
        require(not (self.fsdp and self.bf16), "bf16", self.bf16,
                "must be off with --fsdp (use --fsdp-mixed-precision bfloat16)")
        require(not (self.fsdp and self.eval_windows), "eval-windows", self.eval_windows,
                "must be 0 with --fsdp (the sharded model is not evaluated in place; run "
                "`kvforge swiftkv evaluate --swiftkv OUT` on the exported checkpoint)")
        require(self.eval_windows >= 0, "eval-windows", self.eval_windows, "must be >= 0")
        require(self.early_exit_head or not self.early_exit_only, "early-exit-only", self.early_exit_only,
                "needs --early-exit-head")
        require(not (self.early_exit_only and (self.train_later_layers or self.hidden_loss_weight > 0)),
                "early-exit-only", self.early_exit_only,
                "trains the early-exit head alone: not with --train-later-layers or --hidden-loss-weight")
        require(self.eval_context >= 2, "eval-context", self.eval_context, "must be >= 2")

    def to_dict(self) -> dict[str, Any]:
        """Every key, spelled as the CLI flag (dashes), for recipe.yaml."""
        return {_flag(name): value for name, value in asdict(self).items()}

    def trajectory(self) -> dict[str, Any]:
        """The keys a resumed run must share with the run that wrote the state."""
        return {k: v for k, v in asdict(self).items() if k not in NON_TRAJECTORY_KEYS}


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _coerce(name: str, value: Any) -> Any:
    """`value` as the key's kind; ConfigError naming the flag otherwise (YAML reads 2e-4 as a
    string, so numbers written as strings are accepted)."""
    kind = RECIPE_KEYS[name][0]
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None:
        if optional:
            return None
        raise ConfigError(_flag(name), value, f"must be a {kind}, not empty")
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(value, (str, Path)):
            return str(value)
        raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(_flag(name), value, f"must be {'an' if kind == 'int' else 'a'} {kind}") from None


def load_recipe_file(path: str | Path) -> dict[str, Any]:
    """The keys of a YAML recipe, normalised to field names; ConfigError on an unknown key."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError("recipe", str(path), f"cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("recipe", str(path), f"is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("recipe", str(path), "must be a YAML mapping of flag names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).strip().lstrip("-").replace("-", "_")
        if name not in RECIPE_KEYS:
            raise ConfigError("recipe", key, f"unknown key in {path}; the keys are the distill flag names: "
                                             f"{', '.join(_flag(k) for k in RECIPE_KEYS)}")
        out[name] = value
    return out


def add_recipe_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per recipe key. Defaults are SUPPRESS, so the namespace holds only the flags
    the user gave, which then override the recipe file."""
    defaults = DistillRecipe.__dataclass_fields__
    for name, (kind, help_text) in RECIPE_KEYS.items():
        default = defaults[name].default
        shown = f"{help_text} (default: {default})"
        if kind == "bool":
            parser.add_argument(f"--{_flag(name)}", dest=name, action="store_true", default=argparse.SUPPRESS,
                                help=shown)
            continue
        converter = {"int": int, "float": float, "str": str}[kind.rstrip("?")]
        parser.add_argument(f"--{_flag(name)}", dest=name, type=converter, default=argparse.SUPPRESS,
                            help=shown)


def recipe_from_args(args: argparse.Namespace) -> DistillRecipe:
    """Defaults <- recipe file (--recipe) <- flags given on the command line."""
    values = load_recipe_file(args.recipe) if getattr(args, "recipe", None) else {}
    values.update({name: getattr(args, name) for name in RECIPE_KEYS if hasattr(args, name)})
    return DistillRecipe(**values)


def write_recipe(recipe: DistillRecipe, path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False), encoding="utf-8")
    return path
