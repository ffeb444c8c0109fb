"""Bad command-line values drawn by a generator over every option of every command.

The options come from the parsers themselves (`kvforge.cli.build_full_parser()`, walked by
cli_walk.py), so a new option is covered without editing this file. For each leaf command a
hypothesis strategy picks an option and a bad value of that option's kind (bad_values.py) and
runs `kvforge.cli.main` in-process, in a scratch directory, with weight loading and process
starts booby-trapped (`Reached`).

Properties:
  * an invalid value (no option of that kind accepts it) exits 2 before any weights load or
    any process starts, with a message on stderr naming the option and the value, no
    traceback, and no file left behind;
  * an edge value (zero, huge, infinity, an empty file) either is refused that way or lets
    the command go on to load its weights; it never crashes.
Values decided only by loading a model (a context length, a layer index beyond the model)
are edge values here: the config is read before the weights, so most are refused early too.

The default suite draws a few values per command; `-m slow` draws many.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path

import pytest
import torch
from bad_values import Scratch, edge_value, invalid_value
from cli_walk import Option, all_options, leaf_parsers, option_kind
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvforge
from kvforge.cli import main
from kvforge.tools.bench.serve_server import free_loopback_port

REPO = Path(kvforge.__file__).resolve().parents[2]
CHECKPOINT = REPO / "models" / "swiftkv-smollm2-135m-l15"
CHECKPOINT_EE = REPO / "models" / "swiftkv-smollm2-135m-l15-ee"


real_set_num_threads = torch.set_num_threads


class Reached(BaseException):
    """Raised where the command would load weights or start a process: the refusal came too late
    (for invalid values) or the command accepted the value (for edge values)."""


def base_options(scratch: Scratch) -> dict[str, dict[str, str | None]]:
    """A valid command line of each leaf command: what comes before the drawn option. Options
    (with their values, None for a flag) so that the drawn option replaces its own."""
    text = str(scratch.root / "text.txt")
    evaluation = {"--text-file": text}
    return {
        "generate": {"hi": None},
        "chat": {},
        "serve": {"--port": str(free_loopback_port())},  # not 8000: another server may hold it
        "verify": {"--text-file": text},
        "info": {},
        "bench prefill": {},
        "bench decode": {},
        "bench throughput": {},
        "bench prefix": {"--text-file": text},
        "bench serve": {"--text-file": text},
        "bench soak": {"--text-file": text},
        "eval ppl": evaluation,
        "eval niah": {"--lengths": "256"},  # its default grid (up to 8,192 tokens) took 36 s to build
        "eval ruler": {"--haystack-file": text},
        "swiftkv init": {"--num-key-value-layers": "15", "--out": str(scratch.root / "init-out")},
        "swiftkv flops": {"--model": "smollm2-135m", "--num-key-value-layers": "15"},
        "swiftkv distill": {"--num-key-value-layers": "15", "--out": str(scratch.root / "distill-out"),
                            "--data": text},
        "swiftkv evaluate": {"--swiftkv": str(CHECKPOINT), "--text-file": text},
        "swiftkv compare": {"--swiftkv": str(CHECKPOINT), "--text-file": text},
        "swiftkv memory": {"--model": "smollm2-135m", "--num-key-value-layers": "15"},
        "swiftkv early-exit": {"--swiftkv": str(CHECKPOINT_EE), "--text-file": text},
        "swiftkv export": {"--swiftkv": str(CHECKPOINT), "--out": str(scratch.root / "export-out")},
        "analyze": {"all": None, "--text-file": text},
        "demo": {"--swiftkv": str(CHECKPOINT), "--text-file": text},
        "report": {str(REPO / "docs" / "results"): None, "--check": None, "--out": str(REPO / "docs" / "results.md"),
                   "--readme": str(REPO / "README.md"), "--methods": str(REPO / "docs" / "cache-methods.md")},
        "gpu-check": {"--device": "cpu", "--sizes": "real", "--skip-speed": None, "--swiftkv": str(CHECKPOINT)},
    }


# Options taken from the base command line when the drawn option is mutually exclusive with them.
EXCLUDES = {"--config": "--model"}


def command_line(option: Option, value: str, scratch: Scratch) -> list[str]:
    base = dict(base_options(scratch)[option.command])
    for flag in option.action.option_strings:
        base.pop(flag, None)
        base.pop(EXCLUDES.get(flag, ""), None)
    words = option.command.split()
    for word, word_value in base.items():
        words += [word] if word_value is None else [word, word_value]
    return words + [f"{option.flag}={value}"]  # `=`: a value starting with "-" stays a value


@contextlib.contextmanager
def booby_trapped(monkeypatch: pytest.MonkeyPatch):
    def reached(*args, **kwargs):
        raise Reached("weights loaded or a process started")

    threads = torch.get_num_threads()  # a drawn --threads must not outlive its example

    def set_num_threads(count: int) -> None:
        if isinstance(count, int) and count > 4 * (os.cpu_count() or 1):  # never start that many
            raise RuntimeError(f"the test refuses to start {count} threads")
        real_set_num_threads(count)

    with monkeypatch.context() as patch:
        patch.setattr("kvforge.models.loader.load_state_dict", reached)
        patch.setattr(subprocess, "Popen", reached)
        patch.setattr(torch, "set_num_threads", set_num_threads)
        try:
            yield
        finally:
            real_set_num_threads(threads)


def run(argv: list[str], scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> tuple[object, str]:
    """(exit status, or Reached, or the exception that escaped; stderr)."""
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(scratch.root)
    try:
        with booby_trapped(monkeypatch), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                outcome: object = main(argv)
            except SystemExit as exit_:
                outcome = exit_.code
            except Reached as reached:
                outcome = reached
            except Exception as exc:  # noqa: BLE001 - what escaped is the finding
                outcome = exc
    finally:
        os.chdir(cwd)
    return outcome, err.getvalue()


def _scratch(tmp_path: Path) -> Scratch:
    scratch = Scratch(tmp_path / "scratch")
    scratch.write()
    (scratch.root / "text.txt").write_text(" ".join(
        f"Sentence {i} of the scratch text tells of rivers, towns and the weather." for i in range(4000)))
    return scratch


OPTIONS = all_options()
KINDS = {option: option_kind(option) for option in OPTIONS}
COMMANDS = sorted(leaf_parsers())


def _drawable(command: str, tier) -> list[Option]:
    return [option for option in OPTIONS if option.command == command and KINDS[option] not in (None, "unknown")
            and (tier is invalid_value or edge_value(KINDS[option], option, Scratch(Path("/"))) is not None)]


def _mentions_value(err: str, value: str) -> bool:
    if value.strip() == "":
        return repr(value) in err or "empty" in err
    forms = {value, repr(value)}
    with contextlib.suppress(ValueError):
        number = float(value)
        forms |= {repr(number), str(number), f"{number:g}"}
        if number.is_integer():
            forms.add(str(int(number)))
    return any(form in err for form in forms)


def check_invalid(option: Option, value: str, scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> None:
    before = scratch.files()
    argv = command_line(option, value, scratch)
    outcome, err = run(argv, scratch, monkeypatch)
    shown = f"{' '.join(argv)!r} -> {outcome!r}\n{err}"
    assert outcome == 2, shown
    assert "Traceback" not in err, shown
    assert any(name in err for name in option.names), f"the option is not named: {shown}"
    assert _mentions_value(err, value), f"the value is not named: {shown}"
    assert scratch.files() == before, f"files left behind: {sorted(scratch.files() - before)}: {shown}"


def check_edge(option: Option, value: str, scratch: Scratch, monkeypatch: pytest.MonkeyPatch) -> None:
    before = scratch.files()
    argv = command_line(option, value, scratch)
    outcome, err = run(argv, scratch, monkeypatch)
    shown = f"{' '.join(argv)!r} -> {outcome!r}\n{err}"
    assert isinstance(outcome, Reached) or outcome in (0, 1, 2), shown
    assert "Traceback" not in err, shown
    if outcome == 2:
        assert "error" in err, shown
        assert scratch.files() == before, f"files left behind: {sorted(scratch.files() - before)}: {shown}"


def _draw_case(data, command: str, tier, scratch: Scratch) -> tuple[Option, str]:
    option = data.draw(st.sampled_from(_drawable(command, tier)), label="option")
    value = data.draw(tier(KINDS[option], option, scratch), label=f"{option.command} {option.flag}")
    return option, value


FAST = settings(max_examples=6, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
THOROUGH = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("command", COMMANDS)
@FAST
@given(data=st.data())
def test_an_invalid_value_is_refused_before_loading(command, data, tmp_path, monkeypatch):
    scratch = _scratch(tmp_path)
    check_invalid(*_draw_case(data, command, invalid_value, scratch), scratch, monkeypatch)


@pytest.mark.parametrize("command", [c for c in COMMANDS if _drawable(c, edge_value)])
@FAST
@given(data=st.data())
def test_an_edge_value_is_refused_cleanly_or_accepted(command, data, tmp_path, monkeypatch):
    scratch = _scratch(tmp_path)
    check_edge(*_draw_case(data, command, edge_value, scratch), scratch, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
@THOROUGH
@given(data=st.data())
def test_many_invalid_values_are_refused_before_loading(command, data, tmp_path, monkeypatch):
    scratch = _scratch(tmp_path)
    check_invalid(*_draw_case(data, command, invalid_value, scratch), scratch, monkeypatch)


def huge_edge_value(kind, option, scratch):
    return edge_value(kind, option, scratch, huge=True)


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in COMMANDS if _drawable(c, edge_value)])
@THOROUGH
@given(data=st.data())
def test_many_edge_values_are_refused_cleanly_or_accepted(command, data, tmp_path, monkeypatch):
    scratch = _scratch(tmp_path)
    check_edge(*_draw_case(data, command, huge_edge_value, scratch), scratch, monkeypatch)


# One invalid value per kind, for a sweep that tries every option of every command once
# (deterministic, so each check has a test that always reaches it).
ONE_INVALID = {"int": "-1", "float": "nan", "int_list": "1,-2", "choice": "zzz", "dtype": "int8", "device": "tpu"}


def one_invalid(kind: str, scratch: Scratch) -> str:
    return ONE_INVALID.get(kind) or {
        "in_file": str(scratch.root / "no-such-file.txt"), "in_dir": str(scratch.afile),
        "model": str(scratch.model_dir("config-partial")), "out_file": str(scratch.afile / "out.json"),
        "out_dir": str(scratch.afile / "out")}[kind]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_refuses_an_invalid_value_of_its_kind(command, tmp_path, monkeypatch):
    scratch = _scratch(tmp_path)
    for option in _drawable(command, invalid_value):
        check_invalid(option, one_invalid(KINDS[option], scratch), scratch, monkeypatch)


def test_every_option_has_a_kind():
    """A new free-text option must be classified in cli_walk (or named free text there)."""
    unknown = [f"{option.command} {option.flag}" for option in OPTIONS if KINDS[option] == "unknown"]
    assert not unknown, unknown


def test_every_command_has_a_valid_base_command_line(tmp_path):
    assert set(base_options(Scratch(tmp_path))) == set(COMMANDS)
