"""SwiftKV checkpoints in the authors' published format, and how kvforge builds them.

Format (a Hugging Face checkpoint directory):
- config.json: a Llama config with `model_type: llama_swiftkv`,
  `architectures: ["LlamaSwiftKVForCausalLM"]`, `swiftkv: true`, `num_key_value_layers`
  (l) and `key_value_group_size` (g); a Qwen2 model (biases on q/k/v, none on o) is written
  as the authors write theirs: a Qwen2 config with `model_type: qwen2_swiftkv`,
  `architectures: ["Qwen2SwiftKVForCausalLM"]` and the same SwiftKV fields; Gemma3 as a
  Gemma3 text config with `model_type: gemma3_text_swiftkv` (kvforge's name: the authors
  publish no Gemma3 SwiftKV) and the same fields, a non-leader without `k_norm`;
- tensors: the base model's weights, plus `model.norm_swiftkv.weight`, for every later layer
  `model.layers.N.self_attn.q_proj_swiftkv.*` and for every group leader (N - l multiple of
  g) `self_attn.k_proj_swiftkv.*` / `v_proj_swiftkv.*` (`.bias` too where the model has
  q/k/v biases, initialised from the originals as the weights are). The original q/k/v_proj of later
  layers may be present (the authors keep them); inference ignores them.

kvforge also writes a *params-only* variant (the SwiftKV tensors alone, plus the base
model's name under `kvforge_base_model`), small enough to commit; loading it overlays the
tensors on the base model's weights. A params-only checkpoint may also name, under
`kvforge_extends`, another params-only checkpoint directory (relative to its own) of the
same base model and wiring: it then holds only the tensors it changes (e.g. an early-exit
head trained over a frozen model), and the other's tensors are read first.

Initialisation (as the authors start distillation): q_proj_swiftkv = q_proj of the same
layer; a leader's k/v_proj_swiftkv = mean of k/v_proj over its group; norm_swiftkv = layer
l's input_layernorm (the final norm when l = L, where it is unused).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvforge.config import EARLY_EXIT_KEY, ModelConfig, RopeConfig, SwiftKVConfig
from kvforge.errors import ModelLoadError
from kvforge.models.family import HFLayout, family_of, swiftkv_model_types
from kvforge.models.hf_checkpoint import CONFIG_FILE, SINGLE_FILE, read_hf_config_dict, read_hf_state_dict
from kvforge.models.hf_config import config_from_hf_dict

BASE_MODEL_KEY = "kvforge_base_model"
EXTENDS_KEY = "kvforge_extends"
EARLY_EXIT_TENSORS = ("model.early_exit_proj.weight",)
PARAMS_ONLY_KEY = "kvforge_params_only"
_PROJECTION_SUFFIXES = (".weight", ".bias")


def _layer(index: int) -> str:
    return f"model.layers.{index}.self_attn."


def swiftkv_tensor_names(config: ModelConfig, bias: bool | None = None) -> list[str]:
    """Names of the SwiftKV-only tensors a model with `config.swiftkv` needs."""
    swift = config.swiftkv
    with_bias = config.attention_bias if bias is None else bias
    suffixes = _PROJECTION_SUFFIXES if with_bias else (".weight",)
    names = ["model.norm_swiftkv.weight"]
    for layer in range(swift.num_key_value_layers, config.num_layers):
        projections = ["q_proj_swiftkv"] + (["k_proj_swiftkv", "v_proj_swiftkv"] if swift.is_leader(layer) else [])
        names += [_layer(layer) + p + s for p in projections for s in suffixes]
    if swift.early_exit_head:
        names += list(EARLY_EXIT_TENSORS)
    return names


def initial_swiftkv_tensors(base_state: dict[str, torch.Tensor], config: ModelConfig,
                            swift: SwiftKVConfig) -> dict[str, torch.Tensor]:
    """The SwiftKV tensors initialised from a base model's HF-named state dict."""
    swift.check_layers(config.num_layers)
    first, group = swift.num_key_value_layers, swift.key_value_group_size
    suffixes = _PROJECTION_SUFFIXES if config.attention_bias else (".weight",)
    # With l = L there is no layer l; the (unused) norm then copies the final norm.
    norm_source = f"model.layers.{first}.input_layernorm.weight" if first < config.num_layers else "model.norm.weight"
    out = {"model.norm_swiftkv.weight": base_state[norm_source].clone()}
    for layer in range(first, config.num_layers):
        for suffix in suffixes:
            out[_layer(layer) + "q_proj_swiftkv" + suffix] = base_state[_layer(layer) + "q_proj" + suffix].clone()
    for leader in swift.leaders(config.num_layers):
        for kind in ("k_proj", "v_proj"):
            for suffix in suffixes:
                members = [base_state[_layer(leader + i) + kind + suffix] for i in range(group)]
                out[_layer(leader) + kind + "_swiftkv" + suffix] = _group_mean(members)
    if swift.early_exit_head:
        out.update(initial_early_exit_tensors(config, base_state["model.norm.weight"].dtype))
    return out


def _group_mean(members: list[torch.Tensor]) -> torch.Tensor:
    """An AcrossKV group's shared K/V projection: the mean of its layers' (float32 sum,
    the members' dtype)."""
    return torch.stack([m.float() for m in members]).mean(dim=0).to(members[0].dtype)


def regroup_swiftkv_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """SingleInputKV tensors (g = 1: every later layer has its own K/V projection) -> the
    AcrossKV grouping of `config.swiftkv`: each leader's K/V projection is the mean of its
    group's, as `initial_swiftkv_tensors` does from the base model's; the rest is kept.
    Lets a distilled g = 1 model start the distillation of a g > 1 one."""
    swift = config.swiftkv
    out = {name: t for name, t in tensors.items() if "k_proj_swiftkv" not in name and "v_proj_swiftkv" not in name}
    for leader in swift.leaders(config.num_layers):
        for kind in ("k_proj_swiftkv", "v_proj_swiftkv"):
            for suffix in _PROJECTION_SUFFIXES:
                members = [tensors.get(_layer(leader + i) + kind + suffix) for i in range(swift.key_value_group_size)]
                if members[0] is None:
                    continue  # no bias on this model
                out[_layer(leader) + kind + suffix] = _group_mean(members)
    return out


def initial_early_exit_tensors(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The identity: the early-exit head starts as the final norm and head on h_l."""
    return {"model.early_exit_proj.weight": torch.eye(config.hidden_size, dtype=dtype)}


def model_state_for_swiftkv(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Keep the tensors a SwiftKV model uses: drop later layers' original q/k/v_proj and
    any K/V projection (or Gemma3 k_norm: its keys are its leader's) of a non-leader;
    ModelLoadError if a SwiftKV tensor is missing."""
    swift = config.swiftkv
    missing = [name for name in swiftkv_tensor_names(config) if name not in state]
    if missing:
        raise ModelLoadError(f"SwiftKV checkpoint (num_key_value_layers={swift.num_key_value_layers}, "
                             f"key_value_group_size={swift.key_value_group_size}) is missing {len(missing)} "
                             f"tensor(s): {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    dropped = set()
    for layer in range(swift.num_key_value_layers, config.num_layers):
        kinds = ["q_proj", "k_proj", "v_proj"] + ([] if swift.is_leader(layer)
                                                  else ["k_proj_swiftkv", "v_proj_swiftkv", "k_norm"])
        dropped.update(_layer(layer) + k + s for k in kinds for s in _PROJECTION_SUFFIXES)
    return {name: tensor for name, tensor in state.items() if name not in dropped}


# -- config.json ---------------------------------------------------------------------------
def config_layout(config: ModelConfig) -> HFLayout:
    """The config.json layout whose fields state this model (its family's `hf_layout_of`:
    e.g. `llama` or `qwen2` by where the attention biases are, `gemma3_text`); ConfigError
    when the family has none that can, or a SwiftKV config on a family without SwiftKV."""
    family = family_of(config)
    family.model_class(config.swiftkv is not None)
    return family.layout(family.hf_layout_of(config))


def config_family(config: ModelConfig) -> str:
    """The model_type of `config_layout`: `llama`, `qwen2`, `gemma3_text`, ..."""
    return config_layout(config).model_type


def _rope_scaling(rope: RopeConfig) -> dict[str, Any] | None:
    if rope.rope_type == "default":
        return None
    scaling: dict[str, Any] = {"rope_type": rope.rope_type, "factor": rope.factor}
    if rope.rope_type == "llama3":
        scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                       original_max_position_embeddings=rope.original_max_position_embeddings)
    return scaling


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """A Hugging Face config.json dictionary for a ModelConfig (SwiftKV fields included when
    set), in the layout of its family (`config_layout`): llama (`llama` / `llama_swiftkv`),
    Qwen2 (`qwen2` / `qwen2_swiftkv`, as the authors name their Qwen2 SwiftKV models) or
    Gemma3 (`gemma3_text` / `gemma3_text_swiftkv`: the authors publish no Gemma3 SwiftKV, so
    kvforge names it by their `<model_type>_swiftkv` rule). Inverse of
    `config_from_hf_dict` for these models."""
    layout = config_layout(config)
    out: dict[str, Any] = {
        "architectures": [layout.architecture],
        "model_type": layout.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope.theta,
        "rope_scaling": _rope_scaling(config.rope),
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids) if len(config.eos_token_ids) != 1 else config.eos_token_ids[0],
        "torch_dtype": "float32",
    }
    out.update(family_of(config).hf_fields_of(config, layout.model_type))
    if config.swiftkv is not None:
        out.update(architectures=[layout.swiftkv_architecture], model_type=layout.swiftkv_model_type, swiftkv=True,
                   num_key_value_layers=config.swiftkv.num_key_value_layers,
                   key_value_group_size=config.swiftkv.key_value_group_size)
        if config.swiftkv.early_exit_head:
            out[EARLY_EXIT_KEY] = True
    return out


def write_checkpoint(directory: str | Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                     dtype: torch.dtype, base_model: str | None = None) -> Path:
    """Write config.json + model.safetensors. `base_model` marks a params-only checkpoint
    (only SwiftKV tensors) that loads on top of that base model."""
    hf = hf_config_dict(config)  # refuses what has no config.json layout before writing anything
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    if base_model is not None:
        hf[BASE_MODEL_KEY] = base_model
        hf[PARAMS_ONLY_KEY] = True
    (directory / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    if config.tie_word_embeddings:  # HF convention: the tied head is not stored
        tensors = {name: t for name, t in tensors.items() if name != "lm_head.weight"}
    contiguous = {name: t.detach().to(dtype).contiguous() for name, t in sorted(tensors.items())}
    save_file(contiguous, str(directory / SINGLE_FILE), metadata={"format": "pt"})
    return directory


# -- reading -------------------------------------------------------------------------------
def is_params_only(directory: str | Path) -> bool:
    return bool(read_hf_config_dict(directory).get(PARAMS_ONLY_KEY, False))


def base_model_of(directory: str | Path) -> str | None:
    return read_hf_config_dict(directory).get(BASE_MODEL_KEY)


def overlay_config(base: ModelConfig, directory: str | Path) -> ModelConfig:
    """The base config with the SwiftKV fields of the checkpoint in `directory`; the two
    must describe the same network shape."""
    data = read_hf_config_dict(directory)
    if data.get("model_type") not in swiftkv_model_types():
        raise ModelLoadError(f"{directory} is not a SwiftKV checkpoint: config.json has model_type "
                             f"{data.get('model_type')!r}, expected one of {swiftkv_model_types()}")
    theirs = config_from_hf_dict(data)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "attention_bias", "attention_out_bias"):
        if getattr(theirs, field) != getattr(base, field):
            raise ModelLoadError(f"SwiftKV checkpoint {directory} has {field}={getattr(theirs, field)} but "
                                 f"the base model has {field}={getattr(base, field)}")
    if theirs.swiftkv is None:
        raise ModelLoadError(f"SwiftKV checkpoint {directory} has swiftkv=false")
    return replace(base, swiftkv=theirs.swiftkv)


def read_overlay_tensors(directory: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The SwiftKV checkpoint's tensors in `dtype` (whatever dtype they are stored in); with
    `kvforge_extends`, those of the checkpoint it extends with its own laid over them."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    extended = extended_checkpoint(directory)
    if extended is not None:
        tensors = read_hf_state_dict(extended, dtype=dtype)
    tensors.update(read_hf_state_dict(directory, dtype=dtype))
    return tensors


def extended_checkpoint(directory: str | Path) -> Path | None:
    """The directory `kvforge_extends` names (relative to `directory`), or None; ModelLoadError
    unless it is a params-only checkpoint of the same base model and SwiftKV wiring that
    extends none itself (one level, so a chain or a cycle cannot form)."""
    directory = Path(directory)
    ours = read_hf_config_dict(directory)
    name = ours.get(EXTENDS_KEY)
    if name is None:
        return None
    extended = directory / str(name)
    if not extended.is_dir():
        raise ModelLoadError(f"{directory}: {EXTENDS_KEY}={name!r} is not a directory ({extended})")
    theirs = read_hf_config_dict(extended)
    if EXTENDS_KEY in theirs:
        raise ModelLoadError(f"{directory}: {EXTENDS_KEY}={name!r} extends {theirs[EXTENDS_KEY]!r} in turn; "
                             f"a checkpoint may extend only one that extends none")
    for key in (BASE_MODEL_KEY, "num_key_value_layers", "key_value_group_size"):
        if ours.get(key) != theirs.get(key):
            raise ModelLoadError(f"{directory}: {EXTENDS_KEY}={name!r} has {key}={theirs.get(key)!r} but this "
                                 f"checkpoint has {key}={ours.get(key)!r}; they must be equal")
    return extended
