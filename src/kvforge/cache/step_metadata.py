"""The per-step metadata every cache method subclasses (cache/base.py describes the step
protocol; cache/static_decode.py the fixed-shape form of a decode step)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from kvforge.batch import ForwardBatch


@dataclass
class StepMetadata:
    """What a cache method knows of one step: built by `begin_step`, read by the step's
    `write`, `attend`, `attend_rows` and `end_step` calls, and by the fused decode op.
    Methods subclass it with their plans (page tables, slots, lengths) and the step's own
    K/V as `write` hands them over; one object lives exactly one step."""

    batch: ForwardBatch


Meta = TypeVar("Meta", bound=StepMetadata)
