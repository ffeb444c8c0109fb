"""Plan tensors reach the device in one copy per dtype: `pack` keeps every value and shape
in views of one buffer; `upload` replaces the CPU tensors of nested plans (frozen
dataclasses, tuples, lists, dicts) and leaves everything else as it was."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.host_sync import device_code_paths
from kvforge.step_plan import pack, upload


@dataclass(frozen=True)
class _Inner:
    ids: torch.Tensor
    name: str


@dataclass(frozen=True)
class _Plan:
    rows: torch.Tensor
    parts: tuple[_Inner, ...]
    lookup: dict[int, torch.Tensor]
    optional: torch.Tensor | None


def _plan() -> _Plan:
    return _Plan(torch.tensor([4, 5, 6]), (_Inner(torch.tensor([[1, 2], [3, 4]]), "a"), _Inner(torch.tensor([]).long(), "b")),
                 {7: torch.tensor([True, False])}, None)


def test_pack_makes_views_of_one_buffer_per_dtype():
    tensors = [torch.tensor([1, 2, 3]), torch.tensor([True, False]), torch.tensor([[7, 8], [9, 10]])]
    packed = pack(tensors, torch.device("cpu"))
    for got, want in zip(packed, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
    longs = {packed[0].untyped_storage().data_ptr(), packed[2].untyped_storage().data_ptr()}
    assert len(longs) == 1 and packed[1].untyped_storage().data_ptr() not in longs


def test_upload_keeps_the_plan_on_the_cpu_and_copies_it_elsewhere():
    plan = _plan()
    assert upload(plan, torch.device("cpu")) is plan  # host memory: nothing to copy
    moved = upload(plan, torch.device("meta"))
    assert moved.rows.device.type == "meta" and moved.rows.shape == (3,)
    assert [p.ids.shape for p in moved.parts] == [(2, 2), (0,)] and [p.name for p in moved.parts] == ["a", "b"]
    assert moved.lookup[7].device.type == "meta" and moved.lookup[7].dtype == torch.bool
    assert moved.optional is None and plan.rows.device.type == "cpu"  # the original is unchanged


def test_upload_on_device_code_paths_copies_with_the_same_values():
    plan = _plan()
    with device_code_paths():
        moved = upload(plan, torch.device("cpu"))
    assert moved is not plan and moved.rows.untyped_storage().data_ptr() == moved.parts[0].ids.untyped_storage().data_ptr()
    assert torch.equal(moved.rows, plan.rows) and torch.equal(moved.parts[0].ids, plan.parts[0].ids)
    assert torch.equal(moved.lookup[7], plan.lookup[7])
