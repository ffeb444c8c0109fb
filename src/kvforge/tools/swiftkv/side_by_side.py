"""`kvforge swiftkv compare`: one prompt through the base model and through a SwiftKV
checkpoint laid over it, on the same engine, reported side by side.

The prompt is the start of the held-out WikiText text (never trained on), cut to
`prompt_tokens` tokens, continued greedily without a chat template, so the two
continuations can be compared token by token. Prefill time is the time to first token
of a `max_tokens=1` request, the best of `repeats` runs of each system after one warm-up
(these CPUs are noisy; the best run is the least disturbed one). The prefill ratio is
base / SwiftKV: above 1 means SwiftKV reached its first token sooner.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from kvforge.devices import resolve_device
from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import require
from kvforge.models.loader import parse_dtype
from kvforge.tools.text_data import heldout_text


@dataclass(frozen=True)
class SideBySideSettings:
    prompt_tokens: int = 1024
    max_tokens: int = 32
    repeats: int = 3
    kv_budget: str = "256MiB"
    device: str = "cpu"  # of both systems
    dtype: str = "float32"  # weights and compute of both systems

    def __post_init__(self) -> None:
        resolve_device(self.device)
        parse_dtype(self.dtype)
        require(self.prompt_tokens >= 1, "prompt-tokens", self.prompt_tokens, "must be >= 1")
        require(self.max_tokens >= 1, "max-tokens", self.max_tokens, "must be >= 1")
        require(self.repeats >= 1, "repeats", self.repeats, "must be >= 1")


@dataclass(frozen=True)
class SystemRun:
    name: str
    prefill_s: float  # best time to first token over the repeats
    prefill_runs: tuple[float, ...]
    token_ids: tuple[int, ...]  # greedy continuation
    text: str


def heldout_prompt(llm: LLM, prompt_tokens: int, text_file: str | None = None) -> list[int]:
    """The first `prompt_tokens` tokens of the held-out text (the raw tokenisation)."""
    ids = llm.encode(heldout_text(text_file).lstrip())
    require(len(ids) >= prompt_tokens, "prompt-tokens", prompt_tokens,
            f"must be <= the held-out text's {len(ids)} tokens")
    return ids[:prompt_tokens]


def run_system(name: str, llm: LLM, prompt: list[int], settings: SideBySideSettings) -> SystemRun:
    first_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([prompt[:64]], first_token, use_tqdm=False)  # warm-up: kernels, allocations
    times = []
    for _ in range(settings.repeats):
        (output,) = llm.generate([prompt], first_token, use_tqdm=False)
        times.append(output.metrics.time_to_first_token)
    greedy = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    (output,) = llm.generate([prompt], greedy, use_tqdm=False)
    return SystemRun(name, min(times), tuple(times), tuple(output.token_ids), output.text)


def compare_side_by_side(model: str, swiftkv: str, settings: SideBySideSettings,
                         text_file: str | None = None) -> tuple[list[int], list[SystemRun]]:
    """Base first, then SwiftKV; one model in memory at a time."""
    base = LLM(model=model, kv_budget=settings.kv_budget, device=settings.device, dtype=settings.dtype)
    prompt = heldout_prompt(base, settings.prompt_tokens, text_file)
    runs = [run_system("base", base, prompt, settings)]
    del base
    student = LLM(model=model, swiftkv=swiftkv, kv_budget=settings.kv_budget, device=settings.device,
                  dtype=settings.dtype)
    runs.append(run_system("swiftkv", student, prompt, settings))
    return prompt, runs


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def format_side_by_side(model: str, swiftkv: str, prompt: list[int], runs: list[SystemRun]) -> str:
    base, student = runs
    lines = [f"SwiftKV side by side: {model} vs {model} + {swiftkv}",
             f"prompt: the first {len(prompt)} tokens of the held-out WikiText text, greedy continuation",
             "",
             "| system | prefill (best of runs) | runs (s) | prefill speed-up |",
             "|---|---|---|---|"]
    for run in runs:
        ratio = base.prefill_s / run.prefill_s if run.prefill_s > 0 else float("nan")
        spread = ", ".join(f"{t:.3f}" for t in run.prefill_runs)
        lines.append(f"| {run.name} | {run.prefill_s:.3f} s | {spread} | {ratio:.2f}x |")
    agree = common_prefix(base.token_ids, student.token_ids)
    same = sum(x == y for x, y in zip(base.token_ids, student.token_ids))
    lines += ["",
              f"generated tokens: {len(base.token_ids)}; identical leading tokens: {agree}; "
              f"same token at the same position: {same}",
              f"median prefill, base / swiftkv: "
              f"{statistics.median(base.prefill_runs) / statistics.median(student.prefill_runs):.2f}x"]
    for run in runs:
        lines += ["", f"--- {run.name} continuation ---", run.text.strip()]
    return "\n".join(lines)
