"""`--device`: one option shared by every command that runs a model, checked before anything
loads (tests/test_bad_input.py has the refusals, exit 2), and carried to every model that
command builds, the transformers peer included.

`meta` passes the check on any torch, so the carrying is followed on this CPU-only machine:
the loaders are patched to stop the run with the device they were handed."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvforge.cli import build_full_parser, main
from kvforge.devices import resolve_device
from kvforge.errors import ConfigError
from kvforge.tools.bench.serve_server import free_loopback_port

SWIFTKV_DIR = "models/swiftkv-smollm2-135m-l15"  # tests run from the repository root


class Reached(Exception):
    """A patched loader was called; `args[0]` is the device it was given."""


def _stop(value, *args, **kwargs):
    raise Reached(str(value))


@pytest.fixture
def no_bench_probes(monkeypatch):
    """Benchmarks skip the kernel builds and peak probes that precede loading; the thread
    count, which the commands set, is restored."""
    from kvforge.tools.bench.peak import MachinePeak

    monkeypatch.setattr("kvforge.prebuild.build_cpu_kernels", lambda: ({}, 0.0))
    peak = MachinePeak(matmul_gflops=1.0, matmul_size=1, matmul_dtype="float32", read_gbps=1.0, threads=1)
    monkeypatch.setattr("kvforge.tools.bench.peak.measure_peak", lambda dtype, device=None: peak)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stop_at_load(monkeypatch, no_bench_probes):
    """kvforge models stop at load_model's and LLM's device check, transformers models at
    their loader."""
    monkeypatch.setattr("kvforge.models.loader.resolve_device", _stop)
    monkeypatch.setattr("kvforge.engine.llm.resolve_device", _stop)
    monkeypatch.setattr("kvforge.tools.verify.load_transformers_model", lambda source, device, dtype=None: _stop(device))


# Every command that runs a model, as far as its first model load.
COMMANDS = [
    ["generate", "hi"],
    ["chat"],
    ["serve"],  # a free --port is added
    ["verify"],
    ["bench", "prefill", "--prompt-len", "8", "--repeats", "1", "--threads", "1"],
    ["bench", "decode", "--context", "8", "--gen", "2", "--repeats", "1", "--threads", "1"],
    ["bench", "throughput", "--num-requests", "1", "--input-len", "8", "--output-len", "2", "--threads", "1"],
    ["bench", "prefix", "--shared-prefix", "16", "--turns", "2", "--threads", "1"],
    ["eval", "ppl", "--context", "128", "--max-windows", "1", "--threads", "1"],
    ["eval", "niah", "--lengths", "256", "--depths", "1", "--threads", "1"],
    ["eval", "ruler", "--lengths", "512", "--tasks", "niah_single_1", "--samples", "1", "--threads", "1"],
    ["analyze", "all", "--tokens", "64", "--threads", "1"],
    ["demo", "--swiftkv", SWIFTKV_DIR],
    ["swiftkv", "evaluate", "--swiftkv", SWIFTKV_DIR],
    ["swiftkv", "compare", "--swiftkv", SWIFTKV_DIR],
]


def reached_by(argv: list[str]) -> str:
    """Run a command (a free --port for serve) until a patched loader stops it; what it got."""
    extra = ["--port", str(free_loopback_port())] if argv[0] == "serve" else []
    with pytest.raises(Reached) as reached:
        main([*argv, *extra])
    return reached.value.args[0]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(argv[:2]) for argv in COMMANDS])
def test_every_command_loads_its_model_on_the_device_asked_for(argv, stop_at_load):
    assert reached_by([*argv, "--device", "meta"]) == "meta"


def _parsed(argv: list[str]) -> argparse.Namespace:
    return build_full_parser().parse_args(argv)


def test_the_transformers_peer_of_bench_and_eval_runs_on_the_same_device(stop_at_load):
    from kvforge.tools.bench.common import prepare
    from kvforge.tools.eval.context import EvalContext

    bench = prepare(_parsed(["bench", "decode", "--device", "meta", "--compare", "hf", "--threads", "1"]), 16)
    with pytest.raises(Reached, match="meta"):
        bench.hf_model()
    with pytest.raises(Reached, match="meta"):
        EvalContext("smollm2-135m", torch.float32, 1 << 20, device="meta").hf_model()


def test_bench_serve_starts_its_servers_on_its_device():
    from kvforge.cache.registry import parse_cache_spec
    from kvforge.tools.bench.serve import _serve_args
    from kvforge.tools.bench.systems import System

    args = _parsed(["bench", "serve", "--device", "cuda:1"])
    server_argv = _serve_args(args, System("s", "kvforge", parse_cache_spec("full")))
    assert server_argv[server_argv.index("--device") + 1] == "cuda:1"


def _verbs(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) of every leaf command."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not actions:
        yield path, parser
        return
    for name, sub in actions[0].choices.items():
        yield from _verbs(sub, (*path, name))


# Commands with --model that build no model: config and byte counts (info, swiftkv memory),
# checkpoint writing (swiftkv init, export), FLOP accounting; lm-eval takes lm_eval's own arguments.
NO_MODEL_RUN = {("info",), ("swiftkv", "init"), ("swiftkv", "flops"), ("swiftkv", "memory"), ("swiftkv", "export")}


def commands_without(option: str, exempt: set[tuple[str, ...]]) -> list[str]:
    """Commands with --model (model-running ones: not NO_MODEL_RUN, not `exempt`) lacking `option`."""
    missing = []
    for path, parser in _verbs(build_full_parser()):
        options = {flag for action in parser._actions for flag in action.option_strings}
        if "--model" in options and path not in NO_MODEL_RUN | exempt and option not in options:
            missing.append(" ".join(path))
    return missing


def test_every_command_with_a_model_has_the_device_option():
    missing = commands_without("--device", set())
    assert not missing, f"commands without --device: {missing}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch or a machine without CUDA")
def test_llm_and_load_model_on_cuda_without_a_gpu_are_config_errors(monkeypatch):
    from kvforge.engine.llm import LLM
    from kvforge.models.loader import load_model

    def refuse(*args, **kwargs):
        raise AssertionError("weights were read before the device was checked")

    monkeypatch.setattr("kvforge.models.loader.load_state_dict", refuse)
    for make in (lambda: LLM(device="cuda"), lambda: load_model("smollm2-135m", device="cuda:0")):
        with pytest.raises(ConfigError) as error:
            make()
        assert error.value.parameter == "device" and "CUDA GPU" in error.value.rule


def test_resolve_device_names_parameter_value_and_rule(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("meta")) == torch.device("meta")
    with pytest.raises(ConfigError, match=r"invalid device='tpu': must be cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match=r"invalid gpu='cuda:-1'"):
        resolve_device("cuda:-1", parameter="gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"invalid device='cuda:7': must name one of the 2 visible CUDA devices"):
        resolve_device("cuda:7")
