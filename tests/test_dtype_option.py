"""`--dtype`: on every command that runs a model, carried to each model it loads (checked
by `parse_dtype` at the load, before any weight file is read), and a bad value refused with
exit 2. The loaders are patched to stop the run with the dtype they were handed."""

from __future__ import annotations

import importlib

import pytest
from test_devices import COMMANDS, SWIFTKV_DIR, Reached, commands_without, no_bench_probes, reached_by  # noqa: F401

from kvforge.cli import main

# Commands whose models are not built in a --dtype: distillation trains in float32 (its
# recipe's fsdp_mixed_precision sets the compute dtype of the sharded forward), and gpu-check
# compares float32 weights on the device with float32 weights on the CPU by design.
NO_DTYPE = {("swiftkv", "distill"), ("gpu-check",)}


@pytest.fixture
def stop_at_dtype(monkeypatch, no_bench_probes):  # noqa: F811 -- test_devices' fixture
    """The dtype checks stop the run with their argument."""
    def stop(value):
        raise Reached(str(value))

    # Every module that binds parse_dtype at import is imported first (else it would bind the
    # stub for good) and patched, so the first check a command makes is the one that stops it.
    binders = ("kvforge.models.loader", "kvforge.engine.llm", "kvforge.tools.swiftkv.side_by_side", "kvforge.tools.verify",
               "kvforge.tools.eval.ruler", "kvforge.tools.eval.niah", "kvforge.tools.eval.perplexity", "kvforge.tools.bench.common")
    for where in binders:
        importlib.import_module(where)
    for where in binders:
        monkeypatch.setattr(f"{where}.parse_dtype", stop)


# Every command of test_devices that runs a kvforge model, and swiftkv early-exit
DTYPE_COMMANDS = [argv for argv in COMMANDS if argv[0] != "verify"] + [
    ["swiftkv", "early-exit", "--swiftkv", "models/swiftkv-smollm2-135m-l15-ee"]]


@pytest.mark.parametrize("argv", DTYPE_COMMANDS, ids=[" ".join(argv[:2]) for argv in DTYPE_COMMANDS])
def test_every_command_loads_its_model_in_the_dtype_asked_for(argv, stop_at_dtype):
    assert reached_by([*argv, "--dtype", "bfloat16"]) == "bfloat16"


def test_every_command_with_a_model_has_the_dtype_option():
    missing = commands_without("--dtype", NO_DTYPE)
    assert not missing, f"commands without --dtype: {missing}"


@pytest.mark.parametrize("argv", [["demo", "--swiftkv", SWIFTKV_DIR], ["swiftkv", "evaluate", "--swiftkv", SWIFTKV_DIR],
                                  ["swiftkv", "compare", "--swiftkv", SWIFTKV_DIR]],
                         ids=["demo", "swiftkv evaluate", "swiftkv compare"])
def test_a_bad_dtype_exits_2_naming_it(argv, capsys):
    assert main([*argv, "--dtype", "float64"]) == 2
    err = capsys.readouterr().err
    assert "dtype" in err and "float64" in err and "bfloat16" in err
