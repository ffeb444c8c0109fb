"""CLI: clear errors for bad input, info on a tiny checkpoint, generation end to end."""

from __future__ import annotations

import json

import pytest

from kvforge.cli import main


@pytest.mark.parametrize("argv, expected", [
    (["info", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["info", "--model", "/no/such/file.gguf"], "no such file or directory"),
    (["generate", "--model", "no-such-model", "hi"], "named model"),
    (["generate", "--cache", "nope", "hi"], "known cache methods"),
    (["generate", "--dtype", "float64", "hi"], "invalid dtype='float64'"),
    (["generate", "--kv-budget", "lots", "hi"], "kv_budget"),
    (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    (["generate", "--top-p", "1.5", "hi"], "top_p"),
    (["chat", "--temperature", "-1"], "temperature"),
])
def test_bad_input_gives_clear_error(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_info_json(tmp_path, capsys):
    from kvforge.models.hf_checkpoint import CONFIG_FILE

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rope_theta": 10000.0}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    out = tmp_path / "info.json"
    assert main(["info", "--model", str(tmp_path), "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["kv_cache"]["float32"]["bytes_per_token"] == 2 * 4 * 2 * 8 * 4
    assert info["kv_cache"]["bfloat16"]["bytes_per_token"] == 2 * 4 * 2 * 8 * 2
    assert "4 heads, 2 KV heads, head_dim 8" in capsys.readouterr().out
