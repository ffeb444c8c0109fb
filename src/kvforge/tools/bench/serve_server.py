"""The servers `kvforge bench serve` measures: a `kvforge serve` process per system on a
free loopback port (or a server the user already runs, by URL), and what their /metrics
say during a run.

A started server runs in its own process group. It is stopped with SIGTERM (it aborts what
is in flight and exits 0), killed if it has not exited within 30 s, and then whatever is
left of its group (workers it forked) is killed. Its log goes to a temporary file that is shown
when it fails to start.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvforge.errors import KVForgeError

STARTUP_TIMEOUT_S = 600  # a first run may build the C++ kernels and convert a tokenizer
SERVE_LINE_PREFIX = "kvforge serve: "  # how `kvforge serve` starts each line it prints about itself
METRICS_TIMEOUT_S = 10.0  # how long a /metrics read waits by default


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServerProcess:
    base_url: str
    process: subprocess.Popen
    log_path: Path
    unwaited_cpu_s: float = 0.0

    @classmethod
    def start(cls, serve_args: list[str], label: str) -> ServerProcess:
        """`kvforge serve SERVE_ARGS --host 127.0.0.1 --port <free>`, returned once /health is up."""
        port = free_loopback_port()
        command = [sys.executable, "-m", "kvforge.cli", "serve", *serve_args, "--host", "127.0.0.1",
                   "--port", str(port), "--log-level", "warning"]
        return cls.launch(command, port, label)

    @classmethod
    def launch(cls, command: list[str], port: int, label: str, env: dict[str, str] | None = None,
               timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Run `command` (a server that will listen on 127.0.0.1:`port`) in its own process
        group, so that stopping it also stops the workers it forks; returned once /health is up."""
        log = tempfile.NamedTemporaryFile(prefix=f"kvforge-bench-serve-{port}-", suffix=".log", delete=False)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        server = cls(f"http://127.0.0.1:{port}", process, Path(log.name))
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise KVForgeError(f"the {label} server exited with code {process.returncode} before it was ready:\n"
                                   + server.log_tail())
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                server.stop()
                raise KVForgeError(f"the {label} server was not ready after {timeout_s:.0f} s:\n"
                                   + server.log_tail())
            time.sleep(0.25)

    def start_up_lines(self) -> list[str]:
        """What a `kvforge serve` printed about itself at start-up (its "kvforge serve: " lines:
        the dtype, the bf16 products' form, prepacking, malloc, the banner), so a result says
        which form of the engine produced it. Empty for a server that prints none (vLLM)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line.removeprefix(SERVE_LINE_PREFIX) for line in text.splitlines()
                if line.startswith(SERVE_LINE_PREFIX)]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> int | None:
        """Stop the server and its group. Sets `unwaited_cpu_s`: the CPU seconds of the group
        that waiting for the server did not bring into this process's children's time (a
        worker it forked and never waited for), which the load probe must not take for
        another program's."""
        group_cpu = group_cpu_seconds(self.process.pid)
        waited_before = _children_cpu_seconds()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.unwaited_cpu_s = max(0.0, group_cpu - (_children_cpu_seconds() - waited_before))
        try:  # workers the server forked (vLLM's engine core) go with it
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log_path.unlink(missing_ok=True)
        return self.process.returncode


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _group_stats(pgid: int) -> list[list[str]]:
    """The /proc stat fields after the command name (state ppid pgrp ...) of every process
    in process group `pgid` (Linux; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 14 and int(fields[2]) == pgid:
            found.append(fields)
    return found


def group_states(pgid: int) -> list[str]:
    """The state letter of every process in group `pgid` (Z: exited, not yet reaped)."""
    return [fields[0] for fields in _group_stats(pgid)]


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every live process in process group `pgid`, each with the time of the
    children it has waited for (Linux /proc; 0 elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    # utime stime cutime cstime are stat fields 14-17 (11-14 after the command name)
    return sum(sum(int(x) for x in fields[11:15]) for fields in _group_stats(pgid)) / tick


def scrape(base_url: str, headers: dict[str, str] | None = None,
           timeout: float = METRICS_TIMEOUT_S) -> dict[str, float]:
    """kvforge's serving metrics as flat keys ({} for a server without them):
    running, waiting, preemptions, kv_used:<tier>, steps:<kind>, <kind>:<part> (with
    --step-timing), steps (every engine step; vLLM's too)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{base_url}/metrics", timeout=timeout, headers=headers)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "kvforge_num_requests_running":
                out["running"] = sample.value
            elif sample.name == "kvforge_num_requests_waiting":
                out["waiting"] = sample.value
            elif sample.name == "kvforge_num_preemptions_total":
                out["preemptions"] = sample.value
            elif sample.name == "kvforge_kv_cache_bytes_used":
                out[f"kv_used:{labels['tier']}"] = sample.value
            elif sample.name == "kvforge_engine_timed_steps_total":
                out[f"steps:{labels['kind']}"] = sample.value
            elif sample.name == "kvforge_engine_step_part_seconds_total":
                out[f"{labels['kind']}:{labels['part']}"] = sample.value
            elif sample.name in ("kvforge_engine_steps_total", "vllm:iteration_tokens_total_count"):
                out["steps"] = out.get("steps", 0.0) + sample.value  # vLLM: one observation per engine step
    return out


@dataclass
class ServerWatch:
    """Polls a kvforge server's /metrics during a run: the most requests running at once,
    their mean, and the most fast-tier KV bytes in use."""

    base_url: str
    interval_s: float = 1.0
    headers: dict[str, str] | None = None
    running: list[float] = field(default_factory=list)
    kv_used_max: float = 0.0

    async def watch(self) -> None:
        while True:
            sample = await asyncio.to_thread(scrape, self.base_url, self.headers)
            if "running" in sample:
                self.running.append(sample["running"])
                self.kv_used_max = max(self.kv_used_max, sample.get("kv_used:fast", 0.0))
            await asyncio.sleep(self.interval_s)

    def summary(self) -> dict[str, float | None]:
        if not self.running:
            return {"server_running_max": None, "server_running_mean": None, "server_kv_bytes_max": None}
        return {"server_running_max": max(self.running),
                "server_running_mean": sum(self.running) / len(self.running),
                "server_kv_bytes_max": self.kv_used_max}
