"""Reading llama.cpp GGUF files: metadata -> ModelConfig, tensors -> Hugging Face state dict.

Two design decisions:

* Metadata comes from our own header reader (gguf_metadata.py, much faster than
  `gguf.GGUFReader` on large vocabularies). Tensor *data* is decoded by the `gguf`
  package (`gguf.quants.dequantize`), so every quantisation type it knows is supported.
* The state dict uses Hugging Face names and layouts (the ones `config.json` checkpoints
  use), so the models only ever see one representation:
  - llama.cpp permutes the rows of Q/K projections of some architectures (`llama`: it
    wants rotary pairs adjacent, HF keeps them half a head apart); we undo that permutation.
  - llama.cpp stores Gemma RMSNorm weights as (1 + w); HF stores w and applies (1 + w),
    so we subtract 1 from every Gemma3 `*norm.weight`.
  Which architecture needs which, its tensor names and its config defaults are its model
  family's registry entry (models/family.py: `GGUFArchitecture`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.config import ModelConfig
from kvforge.errors import ModelLoadError
from kvforge.models.family import GGUFArchitecture, gguf_index
from kvforge.models.gguf_metadata import GGUFMetadata, GGUFTensorInfo, float32_decimal, read_gguf_metadata
from kvforge.models.hf_config import config_from_hf_dict

logger = logging.getLogger(__name__)

# ======================================================================================
# Config
# ======================================================================================
def gguf_architecture(meta: GGUFMetadata) -> GGUFArchitecture:
    """What the registered families know of the file's `general.architecture`."""
    arch = meta.get("general.architecture")
    known = gguf_index()
    if arch not in known:
        raise ModelLoadError(f"{meta.path}: GGUF architecture {arch!r} is not supported; "
                             f"supported architectures are {', '.join(known)}")
    return known[arch]


def _uniform_int(meta: GGUFMetadata, key: str, default: Any = None) -> int | None:
    """An integer field that llama.cpp may also write as a per-layer array (all equal here)."""
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{meta.path}: per-layer {key}={value} is not supported "
                                 f"(kvforge needs the same value on every layer)")
        value = value[0]
    return None if value is None else int(value)


def gguf_to_hf_config_dict(meta: GGUFMetadata) -> dict[str, Any]:
    """Translate GGUF metadata into a Hugging Face config.json-style dictionary."""
    architecture = gguf_architecture(meta)
    arch = architecture.name

    def need(suffix: str) -> Any:
        key = f"{arch}.{suffix}"
        if key not in meta.fields:
            raise ModelLoadError(f"{meta.path}: GGUF metadata key {key!r} is missing")
        return meta.fields[key]

    hidden = int(need("embedding_length"))
    need("attention.head_count")
    heads = _uniform_int(meta, f"{arch}.attention.head_count")
    assert heads is not None
    kv_heads = _uniform_int(meta, f"{arch}.attention.head_count_kv", heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise ModelLoadError(f"{meta.path}: partial rotary embedding (rope.dimension_count={rope_dims}, "
                             f"head_dim={head_dim}) is not supported")

    vocab = meta.get(f"{arch}.vocab_size") or meta.array_lengths.get("tokenizer.ggml.tokens")
    if not vocab and "token_embd.weight" in meta.tensors:
        vocab = meta.tensors["token_embd.weight"].shape[0]
    if not vocab:
        raise ModelLoadError(f"{meta.path}: cannot tell the vocabulary size (no {arch}.vocab_size, "
                             "tokenizer.ggml.tokens or token_embd.weight)")

    # End-of-generation ids: eos plus end-of-turn / end-of-message when the file names them.
    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if key in meta.fields and int(meta.fields[key]) not in eos_ids:
            eos_ids.append(int(meta.fields[key]))

    config: dict[str, Any] = {
        "model_type": architecture.model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float32_decimal(need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(need("context_length")),
        "rope_theta": float32_decimal(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, arch),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
    }
    architecture.add_config(meta, config)
    return config


def _rope_scaling(meta: GGUFMetadata, arch: str) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` -> HF rope_scaling. Llama3-style scaling lives in a tensor."""
    if "rope_freqs.weight" in meta.tensors:
        # llama.cpp bakes Llama-3.1 scaling into per-frequency factors (rope_freqs) and does not
        # keep factor/low_freq_factor/high_freq_factor in the metadata. Guessing them back
        # from the tensor is fragile, so we refuse rather than run with the wrong rotary.
        raise ModelLoadError(f"{meta.path}: llama3 rope scaling from GGUF (rope_freqs tensor) is not "
                             "supported; load the Hugging Face checkpoint directory instead")
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"{meta.path}: rope scaling type {kind!r} is not supported (only linear)")
    scaling: dict[str, Any] = {"rope_type": "linear",
                               "factor": float32_decimal(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def read_gguf_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a GGUF file, from its metadata alone (fast: no tensor data is read)."""
    meta = read_gguf_metadata(path)
    return config_from_hf_dict(gguf_to_hf_config_dict(meta))


# ======================================================================================
# Tensors
# ======================================================================================
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, block_names: Mapping[str, str]) -> str | None:
    """Hugging Face name of a GGUF tensor, or None for tensors kvforge does not use;
    `block_names`: the architecture's blk.N.<part> -> HF path inside model.layers.N."""
    block = _BLOCK_RE.fullmatch(gguf_name)
    if block:
        layer, part, kind = block.groups()
        return f"model.layers.{layer}.{block_names[part]}.{kind}" if part in block_names else None
    top = _GLOBAL_RE.fullmatch(gguf_name)
    if top and top.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[top.group(1)]}.{top.group(2)}"
    return None


def unpermute_qk(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's converter permutation of Q/K rows (weights or biases).

    llama.cpp: w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(w.shape),
    i.e. within each head it interleaves the two rotary halves. Reshaping as
    (n_heads, head_dim // 2, 2, *rest) and swapping the same axes puts them back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelLoadError(f"cannot unpermute a Q/K tensor of {rows} rows into {n_heads} heads")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _dequantize(data: np.memmap, info: GGUFTensorInfo) -> np.ndarray:
    """float32 array of one tensor, in row-major (HF) shape."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError as exc:
        raise ModelLoadError(f"tensor {info.name}: unknown ggml type {info.ggml_type}") from exc
    shape = info.shape
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_bytes = int(np.prod(shape, dtype=np.int64)) * type_size // block_size
    raw = data[info.offset:info.offset + n_bytes]
    if raw.size != n_bytes:
        raise ModelLoadError(f"tensor {info.name}: file is truncated")
    try:
        values = dequantize(raw.reshape(quant_shape_to_byte_shape(shape, qtype)), qtype)
    except NotImplementedError as exc:
        raise ModelLoadError(f"tensor {info.name}: the gguf package cannot dequantize {qtype.name}") from exc
    values = values.reshape(shape)  # dequantize already returns row-major (out, in)
    if values.dtype != np.float32 or np.may_share_memory(values, data):
        values = np.array(values, dtype=np.float32)  # own, writable float32 memory
    return values


def _iter_tensors(meta: GGUFMetadata, progress: bool | None) -> Iterator[GGUFTensorInfo]:
    from tqdm.auto import tqdm

    disable = None if progress is None else not progress  # None: tqdm hides itself off a tty
    yield from tqdm(list(meta.tensors.values()), desc=f"dequantising {meta.path.name}", unit="tensor",
                    disable=disable)


def read_gguf_state_dict(path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32,
                         progress: bool | None = None) -> dict[str, torch.Tensor]:
    """Dequantise every tensor of a GGUF file into a Hugging Face-named state dict.

    Invariants of the result: names and layouts are those of the HF checkpoint of the same
    model (Q/K rows un-permuted for `llama`, Gemma norms as w not 1 + w), every tensor is
    contiguous and of `dtype`. Tensors with no HF counterpart (e.g. `rope_freqs.weight`) are
    skipped and logged: the model's own strict `load_hf_state_dict` then reports anything
    the model needed but did not get, so skipping can never hide a missing weight.
    """
    meta = read_gguf_metadata(path)
    architecture = gguf_architecture(meta)
    if meta.byte_order != "<":
        raise ModelLoadError(f"{meta.path}: big-endian GGUF tensor data is not supported")

    data = np.memmap(meta.path, dtype=np.uint8, mode="r")
    state: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    try:
        for info in _iter_tensors(meta, progress):
            name = hf_tensor_name(info.name, architecture.block_names)
            if name is None:
                skipped.append(info.name)
                continue
            values = _dequantize(data, info)
            if architecture.permuted_qk and ".attn_q." in info.name:
                values = unpermute_qk(values, config.num_heads)
            elif architecture.permuted_qk and ".attn_k." in info.name:
                values = unpermute_qk(values, config.num_kv_heads)
            elif architecture.norm_weight_offset and info.name.endswith("norm.weight"):
                values = values - architecture.norm_weight_offset
            state[name] = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
    finally:
        del data  # drop the mapping; the tensors above own their memory
    if skipped:
        logger.warning("%s: skipped %d GGUF tensors with no Hugging Face counterpart: %s",
                       meta.path.name, len(skipped), ", ".join(skipped))
    return state
