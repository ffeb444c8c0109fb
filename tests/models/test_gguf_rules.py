"""What a GGUF file's metadata says, read as a config: the rules beyond the tiny models of
test_loaders.py. Per-layer head counts are refused unless equal, partial rotary embeddings
are refused, a Mistral window slides every layer, linear RoPE scaling is read, the
vocabulary comes from the embedding when nothing else states it, and Gemma3's fields GGUF
does not carry (layer pattern, attention scalar: hidden/heads for the 62-layer 27B) are
filled as transformers does. Metadata alone: no tensor data is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvforge.config import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig
from kvforge.errors import ModelLoadError
from kvforge.models.gguf_checkpoint import read_gguf_config

F, S = FULL_ATTENTION, SLIDING_ATTENTION


def write(path: Path, arch: str, layers: int = 4, tensors: dict[str, np.ndarray] | None = None,
          **fields: Any) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    values = dict(block_count=layers, context_length=256, embedding_length=64, feed_forward_length=96,
                  head_count=4, head_count_kv=2, layer_norm_rms_eps=1e-6, vocab_size=40) | fields
    for method, value in values.items():
        if value is not None:
            getattr(writer, f"add_{method}")(value)
    for name, tensor in (tensors or {"token_embd.weight": np.zeros((40, 64), np.float32)}).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_per_layer_head_counts_must_agree(tmp_path):
    config = read_gguf_config(write(tmp_path / "equal.gguf", "llama", head_count_kv=[2, 2, 2, 2]))
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    with pytest.raises(ModelLoadError, match=r"per-layer llama.attention.head_count_kv=\[2, 2, 1, 1\] is not "
                                             r"supported"):
        read_gguf_config(write(tmp_path / "mixed.gguf", "llama", head_count_kv=[2, 2, 1, 1]))


def test_partial_rotary_embeddings_are_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=r"partial rotary embedding \(rope.dimension_count=8, head_dim=16\)"):
        read_gguf_config(write(tmp_path / "partial.gguf", "llama", rope_dimension_count=8))


def test_a_llama_window_slides_every_layer_and_qwen2_ignores_it(tmp_path):
    config = read_gguf_config(write(tmp_path / "mistral.gguf", "llama", sliding_window=16))
    assert config.sliding_window == 16 and config.layer_types == (S,) * 4
    config = read_gguf_config(write(tmp_path / "qwen2.gguf", "qwen2", sliding_window=16))
    assert config.sliding_window is None and config.layer_types == (F,) * 4


def test_linear_rope_scaling_is_read(tmp_path):
    config = read_gguf_config(write(tmp_path / "linear.gguf", "llama", rope_freq_base=500.0, rope_scaling_type=gguf.RopeScalingType.LINEAR,
                                    rope_scaling_factor=4.0))
    assert config.rope == RopeConfig(500.0, "linear", factor=4.0)
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn' is not supported"):
        read_gguf_config(write(tmp_path / "yarn.gguf", "llama", rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=4.0))


def test_the_vocabulary_comes_from_the_embedding_when_nothing_states_it(tmp_path):
    config = read_gguf_config(write(tmp_path / "v.gguf", "llama", vocab_size=None,
                                    tensors={"token_embd.weight": np.zeros((33, 64), np.float32)}))
    assert config.vocab_size == 33 and config.tie_word_embeddings


@pytest.mark.parametrize(("layers", "scalar"), [(6, 256.0), (62, 16.0)])
def test_gemma3_fields_gguf_does_not_carry(tmp_path, layers, scalar):
    config = read_gguf_config(write(tmp_path / "gemma3.gguf", "gemma3", layers=layers, key_length=16,
                                    rope_freq_base=1e6))
    assert config.architecture == "gemma3" and config.qk_norm and config.query_pre_attn_scalar == scalar
    assert config.layer_types == ((S,) * 5 + (F,)) * (layers // 6) + (S,) * (layers % 6)
    assert (config.sliding_window, config.local_rope, config.rope) == (4096, RopeConfig(10000.0), RopeConfig(1e6))


def test_a_gemma3_layer_pattern_may_be_one_flag_per_layer(tmp_path):
    path = tmp_path / "flags.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for method, value in dict(block_count=4, context_length=256, embedding_length=64, feed_forward_length=96,
                              head_count=4, head_count_kv=1, layer_norm_rms_eps=1e-6, vocab_size=40).items():
        getattr(writer, f"add_{method}")(value)
    writer.add_array("gemma3.attention.sliding_window_pattern", [True, False, False, True])
    writer.add_tensor("token_embd.weight", np.zeros((40, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_gguf_config(path).layer_types == (S, F, F, S)
