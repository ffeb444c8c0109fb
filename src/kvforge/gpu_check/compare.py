"""Device traces against the reference trace: logit differences, argmax agreement and
greedy tokens, judged against one row's tolerance (see rows.py for the near-tie rule)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.gpu_check.drive import Trace


@dataclass(frozen=True)
class Comparison:
    max_abs_diff: float
    mean_abs_diff: float
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    rows_compared: int
    argmax_agreement: float
    # argmax differences where the reference's top-two margin exceeds the tie margin. Reported,
    # not judged: flipping a margin above 2 x tolerance moves a logit by more than the
    # tolerance, so such a row already fails on max_abs_diff.
    unexplained_argmax_mismatches: int
    greedy_match: bool
    # first greedy divergence: sequence, token index, the reference's margin there, excused
    greedy_divergence: dict[str, Any] | None
    tolerance: float
    tie_margin: float

    @property
    def passed(self) -> bool:
        greedy_ok = self.greedy_match or bool(self.greedy_divergence and self.greedy_divergence["excused"])
        return self.max_abs_diff <= self.tolerance and greedy_ok

    def failures(self) -> list[str]:
        """Why the row failed, in words (empty when it passed)."""
        out = []
        if not self.max_abs_diff <= self.tolerance:
            out.append(f"max |logit diff| {self.max_abs_diff:.3e} > tolerance {self.tolerance:.0e}")
        if not self.greedy_match and not (self.greedy_divergence and self.greedy_divergence["excused"]):
            d = self.greedy_divergence or {}
            out.append(f"greedy tokens diverge at sequence {d.get('sequence')} token {d.get('token')} "
                       f"(reference margin {d.get('reference_margin', float('nan')):.3e})")
        return out


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 logit of each row."""
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def compare(reference: Trace, forced: Trace, greedy: Trace, tolerance: float) -> Comparison:
    """`forced`: the device fed the reference's tokens (same inputs, row by row); `greedy`:
    the device on its own greedy path."""
    tie_margin = 2 * tolerance
    ref = torch.cat(reference.logits)
    dev = torch.cat(forced.logits)
    if ref.shape != dev.shape:
        raise ValueError(f"device trace has {tuple(dev.shape)} logit rows, reference {tuple(ref.shape)}")
    diff = (ref - dev).abs().amax(dim=-1)
    is_prefill = torch.cat([torch.arange(r.shape[0]) < n for r, n in zip(reference.logits, reference.prefill_rows)])
    mismatch = ref.argmax(-1) != dev.argmax(-1)
    unexplained = int((mismatch & (top2_margin(ref) > tie_margin)).sum())
    divergence = _greedy_divergence(reference, greedy, tie_margin)
    return Comparison(
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        mean_abs_diff=float((ref - dev).abs().mean()) if diff.numel() else 0.0,
        prefill_max_abs_diff=_max(diff[is_prefill]),
        decode_max_abs_diff=_max(diff[~is_prefill]),
        rows_compared=int(diff.numel()),
        argmax_agreement=1.0 - float(mismatch.float().mean()) if diff.numel() else 1.0,
        unexplained_argmax_mismatches=unexplained,
        greedy_match=divergence is None,
        greedy_divergence=divergence,
        tolerance=tolerance,
        tie_margin=tie_margin,
    )


def _max(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0


def _greedy_divergence(reference: Trace, greedy: Trace, tie_margin: float) -> dict[str, Any] | None:
    """The first token where the device's greedy path leaves the reference's, or None."""
    for seq, (want, got) in enumerate(zip(reference.tokens, greedy.tokens)):
        for index, (a, b) in enumerate(zip(want, got)):
            if a != b:
                # Token `index` came from the last prefill row (index 0) or decode row index - 1.
                row = reference.logits[seq][reference.prefill_rows[seq] - 1 + index]
                margin = float(top2_margin(row))
                return {"sequence": seq, "token": index, "reference_margin": margin,
                        "excused": margin <= tie_margin, "reference": a, "device": b}
    return None
