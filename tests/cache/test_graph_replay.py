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


def test_a_capture_writes_nothing_into_existing_memory():
    """A CUDA capture executes no kernel: what the recorded operations wrote into tensors
    that existed before is undone (the replay writes it)."""
    store, counter = torch.zeros(4), torch.zeros(1, dtype=torch.long)

    def step(b: torch.Tensor) -> None:
        store[1:3].add_(b)
        torch.add(counter, 1, out=counter)

    buffer = torch.ones(2)
    graph = RecordedGraph()
    with recording(graph):
        step(buffer)
    assert store.tolist() == [0, 0, 0, 0] and counter.tolist() == [0]
    graph.replay()
    graph.replay()
    assert store.tolist() == [0, 2, 2, 0] and counter.tolist() == [2]


def test_an_allocation_keeps_its_garbage_on_replay():
    """Replaying an allocation writes nothing: memory a kernel leaves unwritten keeps
    whatever was there (here the capture's garbage), never fresh zeros."""
    buffer = torch.ones(3)
    graph = RecordedGraph()
    with recording(graph):
        out = torch.empty(5)
        out[:3] = buffer * 2
    graph.replay()
    assert out[:3].tolist() == [2, 2, 2] and out[3:].isnan().all()


def test_results_of_many_outputs_and_out_arguments_are_replayed():
    values, target = torch.zeros(4), torch.zeros(4)
    graph = RecordedGraph()
    with recording(graph):
        top, ids = torch.sort(values, descending=True)
        torch.mul(top, 10, out=target)
    values.copy_(torch.tensor([1.0, 4.0, 2.0, 3.0]))
    graph.replay()
    assert ids.tolist() == [1, 3, 2, 0] and target.tolist() == [40, 30, 20, 10]


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
                                  lambda t: t[t > 0], lambda t: torch.arange(3).repeat_interleave(t.long())],
                         ids=["item", "bool", "nonzero", "mask", "repeat_interleave"])
def test_reading_a_device_value_on_the_host_fails_the_capture(read):
    with pytest.raises(CaptureError, match="may not read device values on the host"), recording(RecordedGraph()):
        read(torch.ones(3))
