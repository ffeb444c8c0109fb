"""`bench serve --profile-servers`: py-spy stacks sorted into the parts of a serving step,
engine steps from /metrics, and the py-spy process's life cycle (a stand-in py-spy here)."""

from __future__ import annotations

import argparse
import stat
import sys
from pathlib import Path

import pytest

from kvforge.errors import ConfigError
from kvforge.tools.bench import serve as bench_serve
from kvforge.tools.bench import serve_server
from kvforge.tools.bench.serve_profile import ServerProfiler, classify, engine_steps, summarize_profile

ENGINE = ["thread (11): kvforge-engine", "LLMEngine._step (kvforge/engine/llm_engine.py:177)",
          "CausalLM.forward (kvforge/models/causal_lm.py:89)"]
ATTENTION_MODULE = "CachedAttention.forward (kvforge/models/layers.py:50)"


def test_the_innermost_named_op_decides_inside_the_model():
    # q_proj inside the attention module is a linear; the paged kernel under it is attention
    assert classify(ENGINE[1:] + [ATTENTION_MODULE, "_linear (kvforge/kernels/cpu_linear.py:76)"]) == "linear"
    assert classify(ENGINE[1:] + [ATTENTION_MODULE, "FullCache._attend (kvforge/cache/full/method.py:221)",
                                  "OpOverloadPacket.__call__ (torch/_ops.py:1279)"]) == "attention"
    assert classify(ENGINE[1:] + ["fused_prefix (kvforge/models/fused_decode.py:80)",
                                  "decode_layers_full (kvforge/kernels/cpu_decode_layer.py:90)"]) == "fused decoder layers"
    assert classify(ENGINE[1:] + ["GatedMLP.forward (kvforge/models/layers.py:90)",
                                  "silu_mul (kvforge/kernels/cpu_fused.py:76)"]) == "model other"


def test_serving_parts_outside_the_model():
    assert classify(["LLMEngine._step (kvforge/engine/llm_engine.py:170)",
                     "sample (kvforge/engine/sampling.py:262)"]) == "sampling"
    assert classify(["LLMEngine._step (kvforge/engine/llm_engine.py:160)",
                     "Scheduler.schedule (kvforge/engine/scheduler.py:80)"]) == "scheduler"
    assert classify(["run (asyncio/events.py:88)", "RequestResponseCycle.run_asgi (uvicorn/protocols/http/h11_impl.py:410)",
                     "stream (kvforge/serve/streams.py:40)"]) == "HTTP and API"
    assert classify(["EngineCoreProc.run_busy_loop (vllm/v1/engine/core.py:900)",
                     "Socket.recv_multipart (zmq/sugar/socket.py:800)"]) == "IPC"
    assert classify(["Thread.run (threading.py:982)", "wait (threading.py:331)"]) == "other"


def test_compiled_frames_are_named_by_their_generated_source_line(tmp_path):
    generated = tmp_path / "torchinductor_user" / "ab" / "cab.py"
    generated.parent.mkdir(parents=True)
    generated.write_text("def call(args):\n    buf1 = extern_kernels.mm(a, b)\n"
                         "    torch.ops.vllm.unified_attention_with_output(q, k, v, out)\n    cpp_fused_add_0(x)\n")
    runner = ["GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:2000)"]
    assert classify(runner + [f"call ({generated}:2)"]) == "linear"
    assert classify(runner + [f"call ({generated}:3)"]) == "attention"
    assert classify(runner + [f"call ({generated}:4)"]) == "model other"
    assert classify(runner + [f"call ({tmp_path}/torchinductor_gone/x.py:2)"]) == "model other"  # file gone


def test_summary_counts_parts_threads_and_ms_per_step():
    raw = "\n".join([";".join(ENGINE + ["_linear (kvforge/kernels/cpu_linear.py:76)"]) + " 300",
                     ";".join(ENGINE + [ATTENTION_MODULE, "chunk_attention (kvforge/cache/attention.py:69)"]) + " 100",
                     "thread (12): MainThread;run (asyncio/base_events.py:600);write (uvicorn/x.py:3) 50",
                     "garbage line", ""])
    summary = summarize_profile(raw, steps=20, rate_hz=100)
    assert summary["samples"] == 450 and summary["engine_steps"] == 20
    assert summary["parts"]["linear"]["samples"] == 300
    assert summary["parts"]["linear"]["ms_per_step"] == pytest.approx(300 / 100 * 1e3 / 20)
    assert summary["parts"]["attention"]["share"] == pytest.approx(100 / 450)
    assert summary["parts"]["HTTP and API"]["samples"] == 50
    assert summary["threads"] == {"thread : kvforge-engine": 400, "thread : MainThread": 50}
    assert summarize_profile(raw, steps=None)["parts"]["linear"]["ms_per_step"] is None


def test_engine_steps_come_from_the_difference_of_two_scrapes(monkeypatch):
    class Response:
        status_code = 200

        def __init__(self, text: str) -> None:
            self.text = text

    texts = iter([
        "# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_count{engine=\"0\"} 7.0\n",
        "# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_count{engine=\"0\"} 19.0\n",
        "# TYPE kvforge_engine_steps counter\nkvforge_engine_steps_total{model_name=\"m\"} 40.0\n",
    ])
    monkeypatch.setattr(serve_server.httpx, "get", lambda *a, **k: Response(next(texts)))
    before, after = serve_server.scrape("http://x"), serve_server.scrape("http://x")
    assert engine_steps(before, after) == 12
    assert engine_steps({}, serve_server.scrape("http://x")) == 40
    assert engine_steps({}, {}) is None


def _stand_in_py_spy(tmp_path: Path, writes: bool) -> str:
    """A py-spy that records until SIGINT and then writes its output (or fails)."""
    script = tmp_path / ("py-spy" if writes else "py-spy-broken")
    body = ("import signal, sys, time\nargs = sys.argv\nout = args[args.index('--output') + 1]\n"
            "def done(*_):\n    open(out, 'w').write('thread (1): t;f (kvforge/engine/scheduler.py:1) 5\\n')\n"
            "    sys.exit(0)\nsignal.signal(signal.SIGINT, done)\nprint('ready', flush=True)\n"
            "while True:\n    time.sleep(0.05)\n") if writes else \
        "import sys\nsys.stderr.write('Error: Permission Denied\\n')\nsys.exit(1)\n"
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_the_profiler_records_until_stopped(tmp_path):
    profiler = ServerProfiler(_stand_in_py_spy(tmp_path, True), 1, tmp_path / "out" / "stacks.txt").start()
    import time

    time.sleep(1.0)  # the stand-in installs its handler
    assert "scheduler.py" in profiler.stop()


def test_a_profiler_that_records_nothing_says_why(tmp_path):
    profiler = ServerProfiler(_stand_in_py_spy(tmp_path, False), 1, tmp_path / "stacks.txt").start()
    profiler.process.wait(30)  # py-spy fails at once when it cannot read the server
    with pytest.raises(ConfigError, match="Permission Denied"):
        profiler.stop()


def test_kvforge_servers_run_without_the_step_timer_unless_asked():
    args = argparse.Namespace(model="m", kv_budget="1GiB", dtype="float32", threads=1, max_num_batched_tokens=64,
                              max_num_seqs=4, admission="optimistic", device="cpu", swiftkv=None, step_split=False,
                              load_format="auto")
    system = bench_serve.System("kvforge[full]", "kvforge", bench_serve.parse_cache_spec("full"))
    assert "--step-timing" not in bench_serve._serve_args(args, system)
    args.step_split = True
    assert "--step-timing" in bench_serve._serve_args(args, system)
