"""`kvforge swiftkv early-exit`: what SwiftKV's early exit (paper App. E/F) does on held-out
prompts, against the same model without it.

Prompts: `prompts` consecutive `prompt_tokens`-token pieces of the held-out WikiText text
(never trained on), continued greedily for `max_tokens` tokens without a chat template.

1. Observation run (nothing exits): for every decode token, the early-exit head's top
   probability and argmax beside the final argmax. From it: the share of tokens at or above
   the threshold (the exit rate the threshold would give on these tokens) and, among them,
   how often the early argmax equals the final one (the paper's Fig. D.1 agreement).
2. Early-exit run: the same prompts with exits on. Greedy-output agreement: prompts whose
   whole continuation is identical, and tokens that agree before the first divergence.
3. Speed: decode tokens/s with and without exits, one prompt at a time (`speed_prompts` of
   them, batch 1, where skipping layers matters most), alternated, `repeats` each; medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvforge.engine.llm import LLM
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import require
from kvforge.tools.text_data import heldout_text


@dataclass(frozen=True)
class EarlyExitSettings:
    threshold: float = 0.95
    prompts: int = 50
    prompt_tokens: int = 64
    max_tokens: int = 64
    speed_prompts: int = 4
    repeats: int = 3

    def __post_init__(self) -> None:
        require(0.0 < self.threshold <= 1.0, "threshold", self.threshold, "must be a probability in (0, 1]")
        for name in ("prompts", "prompt_tokens", "max_tokens", "speed_prompts", "repeats"):
            require(getattr(self, name) >= 1, name.replace("_", "-"), getattr(self, name), "must be >= 1")
        require(self.speed_prompts <= self.prompts, "speed-prompts", self.speed_prompts,
                f"must be <= prompts={self.prompts}")


def heldout_prompts(llm: LLM, count: int, length: int, text_file: str | None = None) -> list[list[int]]:
    ids = llm.encode(heldout_text(text_file).lstrip())
    require(len(ids) >= count * length, "prompts", count,
            f"x {length} tokens must fit the held-out text's {len(ids)} tokens")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def _decode_rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Generated tokens per second of `prompts` run one at a time (the prefill excluded:
    each prompt's time to first token is subtracted)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        total = time.perf_counter() - start
        tokens += len(out.token_ids) - 1
        seconds += total - out.metrics.time_to_first_token
    return tokens / seconds


def agreement_before_divergence(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return min(len(a), len(b))


def run_early_exit_eval(llm: LLM, settings: EarlyExitSettings, text_file: str | None = None) -> dict[str, Any]:
    model = llm.model
    require(getattr(model, "set_early_exit", None) is not None and model.swiftkv.early_exit_head, "swiftkv",
            "checkpoint", "needs a SwiftKV model with an early-exit head (distill one with --early-exit-head)")
    prompts = heldout_prompts(llm, settings.prompts, settings.prompt_tokens, text_file)
    model.set_early_exit(None)
    model.early_exit_probe = []
    plain = _greedy(llm, prompts, settings.max_tokens)
    probe, model.early_exit_probe = model.early_exit_probe, None
    above = [(early, final) for top, early, final in probe if top >= settings.threshold]
    model.set_early_exit(settings.threshold)
    counts_before = (model.early_exit_counts.decode_rows, model.early_exit_counts.exited)
    exited = _greedy(llm, prompts, settings.max_tokens)
    decode_rows = model.early_exit_counts.decode_rows - counts_before[0]
    exits = model.early_exit_counts.exited - counts_before[1]
    prefix = [agreement_before_divergence(a, b) for a, b in zip(plain, exited)]

    speed_prompts = prompts[:settings.speed_prompts]
    rates: dict[str, list[float]] = {"without": [], "with": []}
    model.set_early_exit(None)
    _decode_rate(llm, speed_prompts[:1], 8)  # warm-up
    for _ in range(settings.repeats):
        for name, threshold in (("without", None), ("with", settings.threshold)):
            model.set_early_exit(threshold)
            rates[name].append(_decode_rate(llm, speed_prompts, settings.max_tokens))
    model.set_early_exit(None)
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "settings": asdict(settings),
        "decode_tokens_observed": len(probe),
        "share_at_or_above_threshold": len(above) / len(probe) if probe else 0.0,
        "agreement_above_threshold": sum(e == f for e, f in above) / len(above) if above else None,
        "agreement_all_tokens": sum(e == f for _, e, f in probe) / len(probe) if probe else None,
        "exit_rate": exits / decode_rows if decode_rows else 0.0,
        "identical_outputs": sum(a == b for a, b in zip(plain, exited)),
        "prompts": len(prompts),
        "tokens_before_first_divergence_mean": statistics.fmean(prefix),
        "token_agreement_positionwise": sum(x == y for a, b in zip(plain, exited) for x, y in zip(a, b))
        / sum(len(a) for a in plain),
        "decode_tokens_per_s": {"without": median["without"], "with": median["with"],
                                "runs_without": rates["without"], "runs_with": rates["with"]},
        "decode_speedup": median["with"] / median["without"],
    }


def format_early_exit(result: dict[str, Any]) -> str:
    s = result["settings"]
    speed = result["decode_tokens_per_s"]
    agree = result["agreement_above_threshold"]
    return "\n".join([
        f"early exit at top probability >= {s['threshold']}: {result['prompts']} held-out prompts of "
        f"{s['prompt_tokens']} tokens, {s['max_tokens']} greedy tokens each",
        f"  observed (nothing exits): {result['share_at_or_above_threshold']:.1%} of "
        f"{result['decode_tokens_observed']} decode tokens at or above the threshold; early argmax = final "
        f"argmax on {'-' if agree is None else f'{agree:.1%}'} of them ({result['agreement_all_tokens']:.1%} of all)",
        f"  with exits: exit rate {result['exit_rate']:.1%}; identical outputs {result['identical_outputs']}/"
        f"{result['prompts']}; {result['tokens_before_first_divergence_mean']:.1f} tokens agree before the first "
        f"divergence on average; position-wise agreement {result['token_agreement_positionwise']:.1%}",
        f"  decode, batch 1: {speed['with']:.1f} tokens/s with, {speed['without']:.1f} without "
        f"({result['decode_speedup']:.2f}x; medians of {s['repeats']})",
    ])
