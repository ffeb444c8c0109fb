"""`--load-format dummy` on the command line: info reports a shape's KV bytes without weights,
a bench at a tiny shape runs kvforge and transformers on the same random weights and says so,
swiftkv init writes a params-only checkpoint of a dummy base that loads over it, bench serve
measures a started server of a dummy model on random token ids, and the verbs that need text
refuse a dummy model, naming the option."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model
from kvforge.tools.bench import peak


@pytest.fixture
def small_peak(monkeypatch):
    monkeypatch.setattr(peak, "MATMUL_SIZE", 256)
    monkeypatch.setattr(peak, "READ_BYTES", 8 * 2**20)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_info_reports_the_kv_bytes_of_llama_31_8b_without_weights(tmp_path, capsys):
    out = tmp_path / "info.json"
    assert main(["info", "--load-format", "dummy", "--model", "llama-3.1-8b", "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    # 2 (K and V) x 32 layers x 8 KV heads x head_dim 128 x 2 bytes
    assert info["kv_cache"]["bfloat16"]["bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert info["parameters"] == 8_030_261_248 and info["weights"] == "dummy (random, seed 0)"
    assert "dummy (random, seed 0)" in capsys.readouterr().out


def test_bench_prefill_runs_against_transformers(small_peak, tmp_path):
    """The transformers peer in `bench prefill` (a dummy model: transformers' own loading of the
    real GGUF file, 20 s here, runs in the README's `bench decode --compare hf` example)."""
    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--load-format", "dummy", "--model", "llama-tiny", "--compare", "hf",
                 "--prompt-len", "16", "--repeats", "1", "--warmup", "0", "--threads", "1", "--kv-budget", "16MiB",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "prefill" and result["headline_metric"] == "prompt_tokens_per_s"
    assert [(s["name"], s["kind"]) for s in result["systems"]] == [("kvforge[full]", "kvforge"), ("hf", "hf")]
    assert all(s["prompt_tokens_per_s"] > 0 for s in result["systems"])


def test_bench_decode_runs_a_dummy_model_against_transformers_on_the_same_weights(small_peak, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--load-format", "dummy", "--model", "llama-tiny", "--compare", "hf",
                 "--batch", "2", "--context", "16", "--gen", "3", "--repeats", "1", "--warmup", "0",
                 "--threads", "1", "--kv-budget", "16MiB", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == "dummy (random, seed 0)"
    assert [s["name"] for s in result["systems"]] == ["kvforge[full]", "hf"]
    assert all(s["tokens"] == 2 * 2 for s in result["systems"])
    assert "weights: dummy (random, seed 0): speed only" in capsys.readouterr().out


def test_swiftkv_init_of_a_dummy_base_is_params_only_and_loads_over_it(tmp_path, capsys):
    out = tmp_path / "swiftkv"
    assert main(["swiftkv", "init", "--load-format", "dummy", "--model", "llama-tiny",
                 "--num-key-value-layers", "2", "--params-only", "--out", str(out)]) == 0
    model, _ = load_model("llama-tiny", load_format="dummy", swiftkv=out)
    base, _ = load_model("llama-tiny", load_format="dummy")
    assert model.config.swiftkv.num_key_value_layers == 2
    assert torch.equal(model.get_parameter("model.layers.3.self_attn.k_proj_swiftkv.weight"),
                       base.get_parameter("model.layers.3.self_attn.k_proj.weight"))
    assert main(["swiftkv", "init", "--load-format", "dummy", "--model", "llama-tiny",
                 "--num-key-value-layers", "2", "--out", str(tmp_path / "full")]) == 2
    assert "--params-only" in capsys.readouterr().err and not (tmp_path / "full").exists()


@pytest.mark.parametrize("argv", [["generate", "hello"], ["chat"]], ids=["generate", "chat"])
def test_verbs_of_text_refuse_a_dummy_model_naming_the_option(argv, capsys):
    assert main([*argv, "--load-format", "dummy", "--model", "llama-tiny"]) == 2
    err = capsys.readouterr().err
    assert "load_format='dummy'" in err and "no tokenizer" in err


def test_an_unknown_load_format_or_shape_is_refused_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--load-format", "safetensors", "--model", "llama-tiny"])
    assert exit_info.value.code == 2 and "--load-format" in capsys.readouterr().err
    assert main(["bench", "decode", "--load-format", "dummy", "--model", "llama-9b"]) == 2
    assert "invalid model='llama-9b'" in capsys.readouterr().err


def test_bench_serve_measures_a_served_dummy_model_on_random_token_ids(tmp_path):
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--load-format", "dummy", "--model", "llama-tiny", "--num-prompts", "2",
                 "--input-len", "16", "--output-len", "3", "--request-rate", "inf", "--threads", "1",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == "dummy (random, seed 0)"
    (rate,) = result["systems"][0]["rates"]
    assert rate["completed"] == 2 and rate["failed"] == 0 and rate["output_tokens"] == 6
    assert rate["prompt_tokens"] == 32
    # the server's own start-up lines travel with the result: which form of the engine ran
    start_up = result["systems"][0]["server_start_up"]
    assert any("dtype float32" in line and "on http://127.0.0.1:" in line for line in start_up), start_up
    assert any("malloc" in line for line in start_up), start_up


def test_bench_serve_of_a_dummy_model_refuses_text_prompts_and_the_vllm_peer(capsys):
    from kvforge.cli import build_parser
    from kvforge.tools.bench import serve as bench_serve

    def plan(*argv: str):
        return bench_serve._plan(build_parser(["bench"]).parse_args(
            ["bench", "serve", "--load-format", "dummy", "--model", "llama-tiny", "--input-len", "40", *argv]))

    prompts = plan("--num-prompts", "3").prompts[0]
    assert [len(p) for p in prompts] == [40, 40, 40] and all(0 <= i < 1024 for p in prompts for i in p)
    assert plan("--num-prompts", "3").prompts == plan("--num-prompts", "3").prompts  # seeded
    with pytest.raises(ConfigError, match="prompt_format"):
        plan("--prompt-format", "text")
    with pytest.raises(ConfigError, match="load_format"):
        plan("--compare", "vllm", "--vllm-python", sys.executable)

