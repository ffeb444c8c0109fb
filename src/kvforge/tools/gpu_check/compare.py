"""Device traces against the reference trace: logit differences, argmax agreement and
greedy tokens, judged against one row's tolerance (see rows.py for the near-tie rule).

Lossy rows (KIVI, sparse ShadowKV) that miss the tolerance get a second judgement.
Quantisation and top-k selection are discontinuous in their inputs: a one-ulp difference
in a key (cuBLAS and the CPU round matrix products differently) moves a code into the next
bin or swaps a near-tied chunk, and the logits of a correct device drift far past any
rounding tolerance (rounding-sized noise on the weights alone does that on the CPU, and the
first H200 run showed the same; docs/benchmarks.md#measurements-behind-design-choices). Such
a row passes when both hold:
- `RoundingFloor`: the device is no farther from the reference (mean |logit difference|)
  than `FLOOR_FACTOR` x the distance that rounding-sized noise on the reference's own
  weights produces (models.ROUNDING_NOISE), the largest over up to `FLOOR_DRAWS` noise
  draws (drawn one at a time while they can change the verdict; it is that of all the
  draws, since a larger floor only passes more);
- `MethodError`: the method is as lossy on the device as on the reference: each side's
  mean |logit difference| from its own full cache on the same tokens, their ratio within
  `ERROR_RATIO_BAND` (a device that skipped the quantisation would be too exact).
A wrong kernel moves the logits by far more than rounding does: on the CPU with tiny
KIVI-2/4, a device's own rounding-sized noise lands well below the floor and noise added to
the attention output far above it. (A floor from 1e-5 noise was too loose: flips grow
faster than linearly, and noise on the attention output then stood out too little.)

Why several draws: one draw's floor is itself a handful of bin flips, so single floors
spread widely, and an H200 running the right kernels failed against a single draw. Against
the largest of several draws, a device's distance grows with how far its weights are off.
Hence `FLOOR_FACTOR` = 20: above every correct device seen, below every TF32-like one
(devices with weights off by 1e-3). The check separates rounding from a device 100x less
precise only in part, and from anything coarser fully; a wrong kernel is coarser still
(first paragraph). The figures behind each of these:
docs/benchmarks.md#measurements-behind-design-choices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvforge.tools.gpu_check.drive import Trace

# device error / reference error of a lossy method must lie in this band
ERROR_RATIO_BAND = (2 / 3, 3 / 2)
# mean |device - reference| may be at most this many times the rounding floor
FLOOR_FACTOR = 20.0
# the floor is the largest distance of up to this many rounding-noise draws
FLOOR_DRAWS = 8
# A reference error (mean |logit diff| from full) below this is no error to compare: the
# method is exact on this workload, and the row keeps the tolerance rule.
EXACT_ERROR = 1e-4


@dataclass(frozen=True)
class MethodError:
    """Mean |logit difference| of a lossy method from the full cache, on each side, with the
    reference's tokens fed to all four runs."""

    reference: float
    device: float

    @property
    def ratio(self) -> float:
        return self.device / self.reference if self.reference > 0 else float("inf")

    @property
    def judged(self) -> bool:
        return self.reference >= EXACT_ERROR

    @property
    def within_band(self) -> bool:
        low, high = ERROR_RATIO_BAND
        return low <= self.ratio <= high


@dataclass(frozen=True)
class RoundingFloor:
    """Mean |logit difference| from the reference: of the device, and (the largest over
    `draws` draws) of the reference run again with rounding-sized noise on its weights (the
    same tokens fed to all)."""

    floor: float
    device: float
    draws: int = 1

    @property
    def ratio(self) -> float:
        return self.device / self.floor if self.floor > 0 else (0.0 if self.device == 0 else float("inf"))

    @property
    def within(self) -> bool:
        return self.ratio <= FLOOR_FACTOR

    def with_draw(self, reference: Trace, perturbed: Trace) -> RoundingFloor:
        """This floor with one more noise draw: the largest distance so far."""
        return RoundingFloor(max(self.floor, mean_distance(perturbed, reference)), self.device, self.draws + 1)


def _draws(count: int) -> str:
    return "one draw" if count == 1 else f"the largest of {count} draws"


def mean_distance(a: Trace, b: Trace) -> float:
    return float((torch.cat(a.logits) - torch.cat(b.logits)).abs().mean())


def rounding_floor(reference: Trace, perturbed: Trace, device: Trace) -> RoundingFloor:
    """The floor of one noise draw (`perturbed`); `RoundingFloor.with_draw` adds more."""
    return RoundingFloor(mean_distance(perturbed, reference), mean_distance(device, reference))


def method_error(reference: Trace, reference_full: Trace, device: Trace, device_full: Trace) -> MethodError:
    """`reference`/`device`: the method's runs; `*_full`: the full cache fed the same tokens."""
    return MethodError(mean_distance(reference, reference_full), mean_distance(device, device_full))


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
    # lossy rows: the second judgement (module docstring), when the tolerance rule fails
    method_error: MethodError | None = None
    floor: RoundingFloor | None = None

    @property
    def within_tolerance(self) -> bool:
        greedy_ok = self.greedy_match or bool(self.greedy_divergence and self.greedy_divergence["excused"])
        return self.max_abs_diff <= self.tolerance and greedy_ok

    @property
    def lossy_judgement(self) -> bool:
        """Both lossy conditions hold (False when the row has none)."""
        return (self.method_error is not None and self.floor is not None and self.method_error.judged
                and self.method_error.within_band and self.floor.within)

    @property
    def passed(self) -> bool:
        return self.within_tolerance or self.lossy_judgement

    def failures(self) -> list[str]:
        """Why the row failed, in words (empty when it passed)."""
        if self.passed:
            return []
        out = []
        if self.method_error is not None and self.floor is not None and self.method_error.judged:
            e, f = self.method_error, self.floor
            if not f.within:
                out.append(f"mean |logit diff| {f.device:.3e} is {f.ratio:.1f}x the rounding floor {f.floor:.3e} "
                           f"({_draws(f.draws)}; at most {FLOOR_FACTOR:g}x)")
            if not e.within_band:
                out.append(f"error against the full cache {e.device:.3e} on the device, {e.reference:.3e} on the "
                           f"reference: ratio {e.ratio:.3f} outside {ERROR_RATIO_BAND[0]:.3f}..{ERROR_RATIO_BAND[1]:.3f}")
            return out
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


def compare(reference: Trace, forced: Trace, greedy: Trace, tolerance: float,
            error: MethodError | None = None, floor: RoundingFloor | None = None) -> Comparison:
    """`forced`: the device fed the reference's tokens (same inputs, row by row); `greedy`:
    the device on its own greedy path; `error`, `floor`: a lossy row's second judgement."""
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
        method_error=error,
        floor=floor,
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
