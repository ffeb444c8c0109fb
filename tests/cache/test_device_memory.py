"""Device memory is the KV budget: every cache method, built on the meta device (standing in
for CUDA, where `torch.empty` costs its whole size at once), holds at most `kv_budget`
bytes on the compute device plus the fixed overhead its module states. The bytes are found
by walking the cache object (not taken from its own accounting); on the host, the slow tier
of ShadowKV is never pinned as a whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvforge.cache.base import CacheMethod
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache

MiB = 1 << 20


def smollm2_layout() -> CacheLayout:
    """smollm2-135m: 30 layers, 3 KV heads, head_dim 64, all global."""
    return CacheLayout.one_per_layer([CacheLayerSpec(3, 64, 64 ** -0.5)] * 30)


def gemma3_layout() -> CacheLayout:
    """gemma3-270m: 18 layers, 1 KV head, head_dim 256, window 512 on 5 of every 6 layers."""
    return CacheLayout.one_per_layer([CacheLayerSpec(1, 256, 256 ** -0.5, None if (i + 1) % 6 == 0 else 512)
                                      for i in range(18)])


def swiftkv_layout() -> CacheLayout:
    """SwiftKV on smollm2-135m, l = 15, AcrossKV g = 2: 15 + 8 cache layers."""
    return CacheLayout(tuple(i if i < 15 else 15 + (i - 15) // 2 for i in range(30)),
                       tuple([CacheLayerSpec(3, 64, 64 ** -0.5)] * 23))


LAYOUTS = {"smollm2": smollm2_layout, "gemma3": gemma3_layout, "swiftkv": swiftkv_layout}
METHODS = ["full", "full:storage_dtype=float16", "kivi:bits=2", "kivi:bits=4", "shadowkv"]


def device_storage_bytes(root: Any, device: torch.device) -> int:
    """Bytes of every distinct tensor storage on `device` reachable from `root` through
    attributes, containers and dataclass fields (a storage shared by views counts once)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device.type:
                storage = obj.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def device_bytes(spec: str, layout: CacheLayout, budget: int, dtype: torch.dtype) -> tuple[int, int]:
    """(device bytes of a fresh cache, its fast capacity)."""
    meta = torch.device("meta")
    cache = create_cache(spec, layout, budget, dtype, meta)
    assert isinstance(cache, CacheMethod)
    return device_storage_bytes(cache, meta), cache.memory.capacity["fast"]


def device_ratio(spec: str, layout: CacheLayout, budget: int, dtype: torch.dtype) -> float:
    return device_bytes(spec, layout, budget, dtype)[0] / budget


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("budget", [64 * MiB, 256 * MiB, 1024 * MiB])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("spec", METHODS)
def test_device_bytes_stay_within_the_budget(spec, layout, budget, dtype):
    """No overhead beyond the budget: what a fresh cache allocates fits in the capacity it
    reports, and that in the budget. (ShadowKV's per-sequence state is allocated when a
    sequence is compressed, within the share `allocate` checks: tests/cache/shadowkv.)"""
    held, capacity = device_bytes(spec, LAYOUTS[layout](), budget, dtype)
    assert held <= capacity <= budget


def test_the_walk_finds_every_storage_once():
    """The helper the bound rests on: views of one storage count once, nested containers
    and objects are walked, tensors on other devices are not counted."""
    base = torch.empty(10, 4, device="meta")
    holder = type("Holder", (), {})()
    holder.views = [base[2:], {"again": base.view(40)}]
    holder.other = (torch.empty(3, 3, device="meta", dtype=torch.float16), torch.zeros(1000))
    assert device_storage_bytes(holder, torch.device("meta")) == 10 * 4 * 4 + 3 * 3 * 2


def test_shadowkv_slow_tier_is_never_pinned_whole(monkeypatch):
    """Built for CUDA (tensors redirected to the meta device, pinning recorded instead of
    done): the chunk store pins no host memory up front; its values stay pageable."""
    from kvforge.cache.shadowkv.store import ChunkStore

    real_empty = torch.empty
    pinned: list[int] = []

    def empty(*shape, dtype=None, device=None, pin_memory=False, **kwargs):
        tensor = real_empty(*shape, dtype=dtype, device="meta" if torch.device(device or "cpu").type == "cuda"
                            else device, **kwargs)
        if pin_memory:
            pinned.append(tensor.untyped_storage().nbytes())
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    store = ChunkStore(30, 3, 64, 8, 4096, torch.bfloat16, torch.device("cuda"), "memory", None)
    assert store.values.device.type == "cpu" and store.landmarks.device.type == "meta"
    assert pinned == []
