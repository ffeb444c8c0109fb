"""Where a server's CPU time goes during `kvforge bench serve --profile-servers PY_SPY`: a
sampling profile of the whole server (every process and Python thread, vLLM's engine core
included) taken by py-spy while the runs go on, sorted into the parts of a serving step.

py-spy (a well-kept sampling profiler, `pip install py-spy`) sees Python frames only, so a
torch op is counted on the Python line that launched it; its worker threads (OpenMP) are
not sampled and their time shows up as the launching thread's. For code compiled by
torch.compile the frame is a line of the generated module, which is read back to name the
op (`extern_kernels.mm(...)`, `torch.ops.vllm.unified_attention(...)`).

A sample is one Python thread found running at one instant (idle threads are left out), so
`ms_per_step` is CPU-thread milliseconds per engine step: parts of different threads may
overlap in wall time, and their sum can exceed the step's wall time.
"""

from __future__ import annotations

import re
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.errors import ConfigError

SAMPLE_RATE_HZ = 100
STOP_TIMEOUT_S = 60  # py-spy writes its output file after SIGINT

# (part, pattern): the first part whose pattern matches decides, tried from the innermost
# frame outwards; a stack with no model frame is placed by the serving parts below.
MODEL_PARTS = (
    ("fused decoder layers", re.compile(r"decode_layers", re.I)),  # kvforge's C++ layer run: linears + attention
    ("linear", re.compile(r"linear|\bmm\b|addmm|matmul|gemm|onednn|_mm\b", re.I)),
    ("attention", re.compile(r"attention|attn|_attend\b|paged_decode|flash", re.I)),
)
MODEL_FRAME = re.compile(r"kvforge/models/|vllm/model_executor/|torchinductor|/_inductor/|forward_step|"
                         r"kvforge/cache/|vllm/v1/attention/|execute_model")
SERVING_PARTS = (
    ("sampling", re.compile(r"sampl", re.I)),
    ("scheduler", re.compile(r"scheduler|/core/sched/|kv_cache_manager|block_pool|prefix_cache", re.I)),
    ("detokenize and outputs", re.compile(r"detokeniz|output_processor|outputs\.py|tokenizers|stop_", re.I)),
    ("HTTP and API", re.compile(r"uvicorn|starlette|fastapi|h11|httptools|kvforge/serve/|entrypoints/|asyncio|"
                                r"pydantic|anyio", re.I)),
    ("IPC", re.compile(r"zmq|msgspec|msgpack|serial_utils|multiprocessing|core_client", re.I)),
)
# Modules torch.compile writes (inductor's output code, vLLM's compile cache): their lines name the ops.
GENERATED = re.compile(r"torchinductor|torch_compile_cache|inductor_cache")
PARTS = ("fused decoder layers", "linear", "attention", "model other", *(name for name, _ in SERVING_PARTS), "other")


@dataclass
class ServerProfiler:
    """py-spy recording one server process and its children until `stop()`."""

    py_spy: str
    pid: int
    output: Path
    process: subprocess.Popen | None = None

    def start(self) -> ServerProfiler:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.py_spy, "record", "--pid", str(self.pid), "--subprocesses", "--threads", "--nonblocking",
             "--full-filenames", "--format", "raw", "--rate", str(SAMPLE_RATE_HZ), "--output", str(self.output)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def stop(self) -> str:
        """End the recording; the raw collapsed stacks ('' if py-spy wrote none, e.g. it
        was not allowed to read the server's memory: its error is raised)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        if not self.output.is_file():
            message = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            raise ConfigError("profile_servers", self.py_spy, f"py-spy recorded nothing: {' '.join(message)}")
        return self.output.read_text()


def _frame_parts(frame: str, sources: dict[str, list[str]]) -> tuple[str, str]:
    """(function name, source line) of a frame 'func (path:line)'; the source line is read
    for generated modules only (torch.compile's), whose function names say nothing."""
    match = re.match(r"(.*) \((.*):(\d+)\)$", frame)
    if not match:
        return frame, ""
    name, path, line = match.group(1), match.group(2), int(match.group(3))
    if not GENERATED.search(path):
        return name, ""
    if path not in sources:
        try:
            sources[path] = Path(path).read_text().splitlines()
        except OSError:
            sources[path] = []
    lines = sources[path]
    return name, lines[line - 1].strip() if 0 < line <= len(lines) else ""


def classify(frames: list[str], sources: dict[str, list[str]] | None = None) -> str:
    """The part of a serving step one stack (outermost frame first) belongs to: for a stack
    inside the model, the innermost frame naming a linear or an attention decides (else
    sampling, else 'model other'); otherwise the innermost frame naming a serving part."""
    sources = {} if sources is None else sources
    named = [" ".join(_frame_parts(f, sources)) for f in frames]
    if any(MODEL_FRAME.search(f) for f in frames):
        for text in reversed(named):
            for part, pattern in MODEL_PARTS:
                if pattern.search(text):
                    return part
        sampling = SERVING_PARTS[0][1]  # sampling sits beside the model in both engines
        return "sampling" if any(sampling.search(f) for f in frames) else "model other"
    for frame in reversed(frames):
        for part, pattern in SERVING_PARTS:
            if pattern.search(frame):
                return part
    return "other"


def summarize_profile(raw: str, steps: int | None, rate_hz: int = SAMPLE_RATE_HZ) -> dict[str, Any]:
    """py-spy raw output -> samples per part and per thread, and CPU-thread ms per engine
    step for each part (None when the number of steps is unknown)."""
    parts: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    sources: dict[str, list[str]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        owners = [f for f in frames if f.startswith(("process ", "thread "))]
        thread = re.sub(r"\(\d+\)|0x[0-9a-f]+|\d{3,}", "", ";".join(owners)).strip() or "?"
        threads[thread] += int(count)
        parts[classify([f for f in frames if f not in owners], sources)] += int(count)
    total = sum(parts.values())
    per_step = (lambda n: n / rate_hz * 1e3 / steps) if steps else (lambda n: None)
    return {"samples": total, "rate_hz": rate_hz, "engine_steps": steps,
            "parts": {part: {"samples": parts[part], "share": parts[part] / total if total else None,
                             "ms_per_step": per_step(parts[part])} for part in PARTS},
            "threads": dict(threads.most_common(8))}


def engine_steps(before: dict[str, float], after: dict[str, float]) -> int | None:
    """Engine steps between two scrapes of a server's /metrics (None if it does not say)."""
    if "steps" not in after:
        return None
    return int(after["steps"] - before.get("steps", 0.0))
