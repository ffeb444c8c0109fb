"""What a vLLM user meets first: --threads refused with its rule, `kvforge --version`,
`kvforge serve MODEL`, Hugging Face Hub ids (offline refusal, online through
huggingface_hub with the download patched to a local directory), and defaults stated in
every option's --help."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_walk import all_options

import kvforge
from kvforge.cli import main
from kvforge.errors import ConfigError

REPO = Path(kvforge.__file__).resolve().parents[2]
CHECKPOINT = REPO / "models" / "swiftkv-smollm2-135m-l15"
THREADED = [["generate", "hi"], ["chat"], ["serve"], ["verify"], ["info"], ["bench", "prefill"], ["eval", "ppl"],
            ["analyze", "all"], ["demo"], ["swiftkv", "evaluate", "--swiftkv", "x"]]


def _exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.mark.parametrize("value", ["-1", "0", "10000000"])
@pytest.mark.parametrize("command", THREADED, ids=" ".join)
def test_threads_out_of_range_exits_2_naming_threads_value_and_rule(command, value, capsys):
    assert _exit_status(command + ["--threads", value]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and value in err and ">= 1" in err, err


def test_threads_set_by_a_recipe_is_checked_too():
    from kvforge.cli_checks import check_threads

    with pytest.raises(ConfigError, match=r"threads=0.*>= 1"):
        check_threads(0)
    check_threads(1)


def test_version_prints_the_package_version_without_torch():
    probe = ("import sys\nfrom kvforge.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as exc:\n"
             "    assert exc.code == 0, exc.code\nassert 'torch' not in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": str(Path(kvforge.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"kvforge {importlib.metadata.version('kvforge')}"


@pytest.fixture
def served(monkeypatch):
    """The parsed namespace `kvforge serve` would run with (the server itself is not started)."""
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr("kvforge.serve.server.run_serve", lambda args: seen.append(args) or 0)
    return seen


@pytest.mark.parametrize("argv, model", [
    (["serve", "gemma3-270m"], "gemma3-270m"),
    (["serve", "--model", "gemma3-270m"], "gemma3-270m"),
    (["serve", "gemma3-270m", "--model", "gemma3-270m"], "gemma3-270m"),
    (["serve"], "smollm2-135m"),
])
def test_serve_takes_the_model_positionally_as_vllm(argv, model, served):
    assert main(argv) == 0
    assert served[0].model == model


def test_serve_refuses_two_different_models(served, capsys):
    assert main(["serve", "gemma3-270m", "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "gemma3-270m" in err and "--model smollm2-135m" in err and "not both" in err
    assert not served


HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_hub_id_offline_exits_2_naming_what_works_offline(tmp_path):
    """A fresh process, offline and with an empty hub cache: one message, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(kvforge.__file__).parents[1]), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run([sys.executable, "-m", "kvforge", "info", "--model", HUB_ID], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    from kvforge.models.named_models import named_model_names

    for text in (HUB_ID, "Hugging Face Hub", *named_model_names(), "local checkpoint directory", ".gguf file"):
        assert text in done.stderr, (text, done.stderr)


def test_a_hub_id_unreachable_exits_2_naming_what_works_offline(monkeypatch, capsys):
    def unreachable(repo_id, **kwargs):
        raise ConnectionError(f"cannot reach huggingface.co for {repo_id}")

    monkeypatch.setattr("huggingface_hub.snapshot_download", unreachable)
    assert main(["info", "--model", HUB_ID]) == 2
    err = capsys.readouterr().err
    assert "ConnectionError" in err and "a named model (" in err and ".gguf file" in err, err


def test_a_hub_id_online_loads_the_downloaded_checkpoint(monkeypatch, capsys):
    """snapshot_download patched to return a checkpoint directory of this repository."""
    asked: list[str] = []

    def download(repo_id, **kwargs):
        asked.append(repo_id)
        return str(CHECKPOINT)

    monkeypatch.setattr("huggingface_hub.snapshot_download", download)
    from kvforge.models.loader import resolve_model_source

    source = resolve_model_source("owner/some-checkpoint")
    assert (source.kind, source.path, source.name) == ("hf_dir", CHECKPOINT, "some-checkpoint")
    assert main(["info", "--model", "owner/some-checkpoint"]) == 0
    assert asked[-1] == "owner/some-checkpoint"
    assert "layers" in capsys.readouterr().out


def test_a_local_path_is_not_taken_for_a_hub_id(monkeypatch, tmp_path):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("the hub was asked"))
    monkeypatch.chdir(tmp_path)
    from kvforge.errors import ModelLoadError
    from kvforge.models.loader import resolve_model_source

    for text in ("./owner/name", "/owner/name", "owner/name.gguf", "~/owner"):
        with pytest.raises(ModelLoadError, match="no such file or directory"):
            resolve_model_source(text)


# Options whose help need not state the default: what the default is, is the option's meaning.
HELP_DEFAULT_EXEMPT = {
    "--cache-opt": "repeatable; none unless given",
    "--stop": "repeatable; none unless given",
    "--compare": "repeatable; none unless given",
    "--no-prefix-caching": "a flag; its help says what it turns off",
    "--no-step-split": "a flag; its help says what it turns off",
    "--no-activation-checkpointing": "a flag; its help says what it turns off",
}


HELP_DEFAULT_EXEMPT_COMMANDS: set[str] = set()  # every command states its defaults


def _states_default(action: argparse.Action) -> bool:
    shown = (action.help or "") % {"default": action.default, "prog": "kvforge"} if "%(" in (action.help or "") \
        else (action.help or "").replace("%%", "%")
    default = action.default
    forms = {str(default)}
    if isinstance(default, list):  # a comma-separated option's parsed default
        forms.add(",".join(map(str, default)))
    if isinstance(default, float):
        forms |= {f"{default:g}", str(int(default)) if default.is_integer() else str(default)}
    return any(form in shown for form in forms) or "default" in shown


def test_every_option_with_a_default_states_it_in_its_help():
    missing = []
    for option in all_options():
        action = option.action
        if (not action.option_strings or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, argparse._HelpAction) or action.option_strings[-1] in HELP_DEFAULT_EXEMPT
                or option.command.split()[0] in HELP_DEFAULT_EXEMPT_COMMANDS):
            continue
        if not _states_default(action):
            missing.append(f"{option.command} {option.flag} (default {action.default!r}): {action.help!r}")
    assert not missing, "\n".join(missing)
