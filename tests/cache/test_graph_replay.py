"""The CPU emulation of a CUDA graph's capture and replay (graph_replay.py) catches what a
graph gets wrong and replays what it gets right. The static decode tests use it
(test_static_decode.py, test_shadowkv_static_decode.py: static_steps.Replayed)."""

from __future__ import annotations

import pytest
import torch
from graph_replay import CaptureError, RecordedGraph, recording

# -- the emulation catches what a graph gets wrong ---------------------------------------

def _replayed(step, before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`step(buffer)` recorded with the buffer holding `before`, replayed holding `after`;
    returns the replayed result and what running `step` eagerly on `after` gives."""
    buffer = before.clone()
    graph = RecordedGraph()
    with recording(graph):
        out = step(buffer)
    buffer.copy_(after)
    graph.replay()
    return out, step(after.clone())


def test_a_step_reading_its_buffer_replays_the_new_values():
    weight = torch.randn(4, 3)
    replayed, eager = _replayed(lambda b: torch.softmax(b @ weight, -1).cumsum(-1)[1:],
                                torch.zeros(5, 4), torch.randn(5, 4))
    torch.testing.assert_close(replayed, eager)


def test_in_place_writes_to_fixed_memory_are_replayed():
    store = torch.zeros(8)

    def step(b: torch.Tensor) -> torch.Tensor:
        store.index_copy_(0, b[:2].long(), b[2:4])  # the scratch slot at capture, real slots on replay
        return store.clone()

    replayed, _ = _replayed(step, torch.tensor([7.0, 7.0, 0.0, 0.0]), torch.tensor([1.0, 3.0, 5.0, 6.0]))
    assert replayed.tolist() == [0, 5, 0, 6, 0, 0, 0, 0]


def test_state_made_during_a_capture_holds_garbage_until_a_replay():
    """A capture executes nothing: a tensor it allocated and Python kept (a lazy init left
    for the capture instead of the warm-up) is garbage for eager steps until a replay."""
    state: dict[str, torch.Tensor] = {}

    def step(b: torch.Tensor) -> torch.Tensor:
        scale = state.setdefault("scale", torch.full((1,), 2.0) + b[:1] * 0)
        return b * scale

    graph = RecordedGraph()
    with recording(graph):
        step(torch.ones(2))
    assert state["scale"].isnan().all()
    graph.replay()
    assert state["scale"].tolist() == [2.0]


def test_a_host_value_baked_into_the_step_is_caught():
    """A length read as a Python int at capture stays that length on every replay."""
    lengths = [2]

    def step(b: torch.Tensor) -> torch.Tensor:
        return b[:lengths[0]].sum().reshape(1)

    buffer = torch.ones(6)
    graph = RecordedGraph()
    with recording(graph):
        out = step(buffer)
    lengths[0] = 5
    graph.replay()
    assert out.item() == 2 != step(buffer).item()


def test_a_tensor_made_from_python_data_fails_the_capture():
    with pytest.raises(CaptureError, match="from Python data"), recording(RecordedGraph()):
        torch.arange(4.0)[torch.tensor([1, 2])]


def test_a_tensor_made_for_one_step_is_stale_on_replay():
    host = {"slots": torch.tensor([0, 1])}
    values = torch.arange(10.0)

    def step(b: torch.Tensor) -> torch.Tensor:
        return values[host["slots"]] + b

    buffer = torch.zeros(2)
    graph = RecordedGraph()
    with recording(graph):
        out = step(buffer)
    host["slots"] = torch.tensor([4, 9])  # planned afresh instead of written into a fixed buffer
    graph.replay()
    assert out.tolist() == [0, 1] != step(buffer).tolist()


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: bool(t.any()), lambda t: t.nonzero(),
                                  lambda t: t[t > 0]], ids=["item", "bool", "nonzero", "mask"])
def test_reading_a_device_value_on_the_host_fails_the_capture(read):
    with pytest.raises(CaptureError, match="may not read device values on the host"), recording(RecordedGraph()):
        read(torch.ones(3))
