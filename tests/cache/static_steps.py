"""DecodeGraphs for tests: one that counts the steps run from fixed buffers, and one whose
CUDA graph capture is emulated on CPU tensors (graph_replay.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from graph_replay import RecordedGraph, recording

from kvforge.batch import ForwardBatch
from kvforge.engine.decode_graphs import CaptureReport, DecodeGraphs
from kvforge.host_sync import device_code_paths


class Counting(DecodeGraphs):
    """Counts the steps that ran from the fixed buffers."""

    static_steps = 0

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        logits = super().run(batch)
        self.static_steps += logits is not None
        return logits


class Replayed(Counting):
    """Each bucket's step captured once on its padding-only buffers after a warm-up
    (DecodeGraphs._capture_one), then replayed for every later step of the bucket, with
    graph_replay's recording (on the code paths CUDA takes) in place of torch.cuda.graph."""

    launches = 0  # Triton kernel launches recorded over every bucket

    def capture(self) -> CaptureReport:
        for key in sorted(self.steps, reverse=True):
            self._graphs[key] = self._capture_one(self.steps[key], None)
        return CaptureReport(len(self._graphs), 0.0, 0)

    def _warm_up(self, forward: Callable[[], torch.Tensor]) -> None:
        with device_code_paths(), torch.inference_mode():
            forward()

    def _record(self, forward: Callable[[], torch.Tensor], pool: object  # type: ignore[override]
                ) -> tuple[RecordedGraph, torch.Tensor]:
        graph = RecordedGraph()
        with device_code_paths(), torch.inference_mode(), recording(graph):
            logits = forward()
        self.launches += graph.launches
        return graph, logits
