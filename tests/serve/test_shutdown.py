"""Signals: SIGTERM or SIGINT stops accepting, aborts the streams in flight and exits 0.
And the checks `kvforge serve` makes before loading anything."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

from kvforge.cli import main
from kvforge.serve.server import is_loopback


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_aborts_streams_in_flight_and_exits_zero(sig):
    port = free_port()
    here = Path(__file__).parent
    process = subprocess.Popen([sys.executable, str(here / "tiny_server_main.py"), str(port)], cwd=here.parent,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        lines: list[str] = []
        started = threading.Event()

        def read_stream() -> None:
            body = {"prompt": "abc", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        started.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert started.wait(30)
        process.send_signal(sig)
        assert process.wait(timeout=30) == 0
        reader.join(30)
        output = process.stdout.read()
        assert "server exited cleanly" in output
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
        assert len(lines) < 400  # ended early, not at max_tokens
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_refuses_a_busy_port_before_loading_the_model(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--port", str(port), "--model", "no-such-model"]) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert f"invalid port={port}" in err and "choose a free --port" in err


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("example.com")


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                               ("127.0.0.1", None, False)])
def test_non_loopback_host_without_key_warns(monkeypatch, capsys, host, key, warned):
    import kvforge.engine.llm as llm_module

    class Stop(Exception):
        pass

    def refuse(**kwargs):
        raise Stop()  # the model would load here: the warning must be out by now

    monkeypatch.setattr(llm_module, "LLM", refuse)
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    args = ["serve", "--host", host, "--port", str(free_port())] + (["--api-key", key] if key else [])
    with pytest.raises(Stop):
        main(args)
    assert ("reachable from other machines" in capsys.readouterr().err) == warned
