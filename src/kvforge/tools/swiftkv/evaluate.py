"""How close a SwiftKV student is to its teacher on held-out text.

Windows: the held-out 20% of the text file (kvforge.tools.text_data), tokenised once and cut into
non-overlapping windows of `context` tokens (BOS first for models that start every text
with it), at most `max_windows`. Each window's first context - 1 positions predict the
next token; over all of them we report

- perplexity of the teacher and of the student (exp of the mean next-token NLL),
- mean KL(teacher || student) of the next-token distributions at temperature 1 (nats),
- top-1 agreement: how often both put their maximum on the same token.

Both models run the dense forward (every token through every layer; for the student the
SwiftKV wiring), logits a chunk of positions at a time, so memory stays bounded for large
vocabularies. `gap_closed` compares two students: the share of the initial perplexity
gap to the teacher that training removed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.errors import require
from kvforge.models.causal_lm import CausalLM
from kvforge.models.dense import dense_hidden_states
from kvforge.tools.eval.perplexity import make_windows, starts_with_bos
from kvforge.tools.text_data import heldout_text


@dataclass(frozen=True)
class QualitySettings:
    context: int = 1024
    max_windows: int | None = 6
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        require(self.context >= 2, "context", self.context, "must be >= 2")
        require(self.max_windows is None or self.max_windows >= 1, "max-windows", self.max_windows, "must be >= 1")
        require(self.chunk_tokens >= 1, "chunk_tokens", self.chunk_tokens, "must be >= 1")


@dataclass(frozen=True)
class Quality:
    windows: int
    tokens: int  # predictions scored
    teacher_ppl: float
    student_ppl: float
    kl: float
    top1_agreement: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gap_closed(initial: Quality, final: Quality) -> float:
    """Fraction of the initial student's perplexity gap to the teacher that `final` removed."""
    gap = initial.student_ppl - initial.teacher_ppl
    return (initial.student_ppl - final.student_ppl) / gap if gap > 0 else math.nan


def heldout_windows(tokenizer: Any, settings: QualitySettings, text_file: str | None = None) -> list[list[int]]:
    ids = list(tokenizer.encode(heldout_text(text_file), add_special_tokens=False))
    bos = tokenizer.bos_token_id if starts_with_bos(tokenizer) else None
    windows = make_windows(ids, settings.context, settings.max_windows, bos)
    require(len(windows) > 0, "context", settings.context, f"is longer than the held-out text ({len(ids)} tokens)")
    return windows


@torch.no_grad()
def compare_all(teacher: CausalLM, students: list[CausalLM], windows: list[list[int]], chunk_tokens: int = 256,
                progress: bool = True) -> list[Quality]:
    """Quality of each student against the teacher on the same windows (the teacher's hidden
    states are computed once per window and shared)."""
    device = teacher.lm_head.weight.device
    nll_t = 0.0
    nll_s, kl, agree = [0.0] * len(students), [0.0] * len(students), [0] * len(students)
    scored = 0
    for window in tqdm(windows, desc="evaluating", unit="window", disable=not progress or len(windows) < 2):
        inputs = torch.tensor([window[:-1]], device=device)
        targets = torch.tensor(window[1:], device=device)
        hidden_t = dense_hidden_states(teacher, inputs)[0]
        for i, student in enumerate(students):
            hidden_s = dense_hidden_states(student, inputs)[0]
            for start in range(0, targets.shape[0], chunk_tokens):
                rows = slice(start, start + chunk_tokens)
                log_p = torch.log_softmax(teacher.logits(hidden_t[rows]).float(), dim=-1)
                log_q = torch.log_softmax(student.logits(hidden_s[rows]).float(), dim=-1)
                target = targets[rows].unsqueeze(-1)
                if i == 0:
                    nll_t -= float(log_p.gather(-1, target).sum(dtype=torch.float64))
                nll_s[i] -= float(log_q.gather(-1, target).sum(dtype=torch.float64))
                kl[i] += float((log_p.exp() * (log_p - log_q)).sum(dtype=torch.float64))
                agree[i] += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())
        scored += targets.shape[0]
    return [Quality(len(windows), scored, math.exp(nll_t / scored), math.exp(nll_s[i] / scored), kl[i] / scored,
                    agree[i] / scored) for i in range(len(students))]


def compare(teacher: CausalLM, student: CausalLM, windows: list[list[int]], chunk_tokens: int = 256,
            progress: bool = True) -> Quality:
    return compare_all(teacher, [student], windows, chunk_tokens, progress)[0]


def format_quality(rows: list[tuple[str, Quality]], settings: QualitySettings) -> str:
    """A markdown table: the teacher once, then one line per student."""
    from kvforge.tools.eval.report import markdown_table

    first = rows[0][1]
    table = [["teacher (base)", f"{first.teacher_ppl:.3f}", "-", "-"]]
    table += [[name, f"{q.student_ppl:.3f}", f"{q.kl:.4f}", f"{q.top1_agreement:.4f}"] for name, q in rows]
    head = (f"held-out text: {first.windows} windows of {settings.context} tokens "
            f"({first.tokens} predictions)")
    return head + "\n" + markdown_table(["model", "perplexity", "KL(teacher || student)", "top-1 agreement"], table)
