"""DecodeGraphs for tests: one that counts the steps run from fixed buffers, and one whose
CUDA graph capture is emulated on CPU tensors (graph_replay.py)."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Callable

import torch
from graph_replay import RecordedGraph, recording

from kvforge.batch import ForwardBatch
from kvforge.engine.decode_graphs import DecodeGraphs
from kvforge.host_sync import device_code_paths


class Counting(DecodeGraphs):
    """Counts the steps that ran from the fixed buffers, in all and by the step's form."""

    static_steps = 0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.by_form: Counter[str | None] = Counter()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        logits = super().run(batch)
        if logits is not None:
            self.static_steps += 1
            self.by_form[self.last_form] += 1
        return logits


class Replayed(Counting):
    """Each bucket's step captured once on its padding-only buffers after a warm-up
    (DecodeGraphs.capture and _capture_one), then replayed for every later step of the
    bucket, with graph_replay's recording (on the code paths CUDA takes) in place of
    torch.cuda.graph, and no device to wait for."""

    launches = 0  # Triton kernel launches recorded over every bucket
    collecting_during_capture: list[bool] = []  # gc.isenabled() at each bucket's record

    def _new_pool(self) -> object:
        return None

    def _wait_for_device(self) -> None:
        pass

    def _warm_up(self, forward: Callable[[], torch.Tensor]) -> None:
        with device_code_paths(), torch.inference_mode():
            forward()

    def _record(self, forward: Callable[[], torch.Tensor], pool: object  # type: ignore[override]
                ) -> tuple[RecordedGraph, torch.Tensor]:
        self.collecting_during_capture = [*self.collecting_during_capture, gc.isenabled()]
        graph = RecordedGraph()
        with device_code_paths(), torch.inference_mode(), recording(graph):
            logits = forward()
        self.launches += graph.launches
        return graph, logits
