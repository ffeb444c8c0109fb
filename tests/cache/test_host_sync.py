"""The decode step of every cache method, on the code path CUDA takes, reads nothing from
the device inside the layer loop (sync_counter.py says what is counted and what cannot
be seen). Counted per region: each cache layer's `write` / `attend`, `begin_step` (the
host-built plan and its one copy), `end_step`, and the model around them.

- `full` and `kivi` (decode_kernel=torch: the PyTorch paths, which are what CUDA runs;
  KIVICache.attend has no Triton routing yet): no synchronisation anywhere in a decode
  step, also through `attend_rows` (SwiftKV's later layers, `full`).
- `shadowkv` (kernel=0: the PyTorch sparse path; compressed sequences): exactly one per
  global layer, the copy of the missed chunks' pages to the host, which gathers their
  values from the slow tier (host memory); none elsewhere, except that a step that folds
  chunks writes their values to the slow tier (`ChunkStore.write`, at `end_step`).
  Its Triton path with the values read in place (`slow_store=pinned` on CUDA; run here in
  Triton's interpreter): none in the layer loop either.

The CUDA code paths give the CPU path's logits, and the counter is shown to see the reads
the CPU path makes on purpose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from sync_counter import SyncCounter

from kvforge import host_sync
from kvforge.config import SwiftKVConfig
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import initial_swiftkv_tensors, model_state_for_swiftkv

PROMPTS = [list(range(3, 43)), list(range(5, 70)), list(range(1, 31))]  # 40, 65 and 30 tokens
SHADOWKV = "shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=3,budget=8,kernel=0"


def _watch(runner: ModelRunner, counter: SyncCounter) -> None:
    """Attribute what happens inside the cache's step calls to regions of the counter."""
    cache = runner.cache
    for name in ("begin_step", "end_step", "write", "attend", "attend_rows"):
        setattr(cache, name, _within(counter, name, getattr(cache, name)))


def _within(counter: SyncCounter, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(first: Any, *args: Any) -> Any:
        region = name if name.endswith("_step") else f"layer {first} {name}"
        with counter.within(region):
            return call(first, *args)
    return wrapped


def _decode_syncs(spec: str, steps: int, arch: str = "llama_gqa", device_paths: bool = True,
                  model: torch.nn.Module | None = None) -> tuple[SyncCounter, ModelRunner]:
    runner = make_runner(model if model is not None else make_pair(arch)[1], cache=spec)
    runner.step([StepItem(seq, prompt) for seq, prompt in enumerate(PROMPTS)])
    counter = SyncCounter()
    _watch(runner, counter)
    with counter.counting(device_paths=device_paths):
        for step in range(steps):
            runner.step([StepItem(seq, [(7 * step + seq) % 90]) for seq in range(len(PROMPTS))])
    return counter, runner


def _swiftkv_model() -> torch.nn.Module:
    """A 5-layer SwiftKV llama (l = 1, AcrossKV groups of 2): later layers use attend_rows."""
    base = make_pair("llama_gqa")[1]
    config = replace(base.config, num_layers=5, layer_types=(), swiftkv=SwiftKVConfig(1, 2))
    plain = build_model(replace(config, swiftkv=None))
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    state.update(initial_swiftkv_tensors(state, plain.config, config.swiftkv))
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(state, config))
    return model


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
@pytest.mark.parametrize("spec", ["full:block_size=4,decode_kernel=torch",
                                  "kivi:bits=2,group=4,residual=8,decode_kernel=torch"])
def test_full_and_kivi_decode_steps_never_synchronise(spec, arch):
    """Nine steps: KIVI flushes its key residual (R = 8) during them."""
    counter, _ = _decode_syncs(spec, 9, arch)
    assert counter.syncs == []


def test_full_decode_through_attend_rows_never_synchronises():
    counter, _ = _decode_syncs("full:block_size=4,decode_kernel=torch", 3, model=_swiftkv_model())
    assert counter.syncs == []


def test_shadowkv_sparse_decode_synchronises_once_per_global_layer():
    counter, runner = _decode_syncs(SHADOWKV, 9)
    cache = runner.cache
    stats = cache.statistics()
    assert stats["compressed_sequences"] == 3 and stats["chunk_hits"] > 0 and stats["chunk_misses"] > 0
    layers = len(cache.global_layers)
    per_layer = Counter(s.region for s in counter.in_regions("layer"))
    assert per_layer == {f"layer {layer} attend": 9 for layer in range(layers)}
    assert {(s.op, s.where.split(":")[0]) for s in counter.in_regions("layer")} == {
        ("Tensor.tolist", "kvforge/host_sync.py")}
    assert counter.in_regions("begin_step") == [] and counter.in_regions("model") == []
    # Folding writes values to the slow tier (host memory): the only other transfers, one
    # page list and one values copy per global layer of each fold.
    folds = counter.in_regions("end_step")
    assert stats["folded_chunks"] > 0 and len(folds) == 2 * layers * stats["folded_chunks"]
    assert {(s.op, s.where.split(":")[0]) for s in folds} == {
        ("Tensor.cpu", "kvforge/cache/shadowkv/store.py"), ("Tensor.to", "kvforge/cache/shadowkv/store.py")}


def test_shadowkv_triton_decode_reading_values_in_place_never_synchronises():
    """The Triton path (forced on CPU tensors, interpreted) with the slow tier read by the
    kernel: the layer loop reads nothing from the device; the hit and miss counts stay there
    until the statistics are read, and equal the staged path's (the same picks)."""
    from triton_helpers import kernel_device

    if kernel_device() != "cpu":
        pytest.skip("counts the CUDA code path on CPU tensors in Triton's interpreter")
    runner = make_runner(make_pair("llama_gqa")[1], cache=SHADOWKV)
    staged = make_runner(make_pair("llama_gqa")[1], cache=SHADOWKV)
    for r, in_place in ((runner, True), (staged, False)):
        r.cache.sparse.triton, r.cache.sparse.values_in_place = True, in_place
        r.step([StepItem(seq, prompt) for seq, prompt in enumerate(PROMPTS)])
    counter = SyncCounter()
    _watch(runner, counter)
    with counter.counting(device_paths=True):
        for step in range(9):
            items = [StepItem(seq, [(7 * step + seq) % 90]) for seq in range(len(PROMPTS))]
            runner.step(items)
    for step in range(9):
        staged.step([StepItem(seq, [(7 * step + seq) % 90]) for seq in range(len(PROMPTS))])
    assert counter.in_regions("layer") == [] and counter.in_regions("begin_step") == []
    assert runner.cache.stats._pending.tolist() != [0, 0]  # counted on the device, not yet read
    stats, expected = runner.cache.statistics(), staged.cache.statistics()
    assert stats["compressed_sequences"] == 3 and stats["chunk_misses"] > 0 and stats["chunk_hits"] > 0
    assert (stats["chunk_hits"], stats["chunk_misses"]) == (expected["chunk_hits"], expected["chunk_misses"])


@pytest.mark.parametrize("spec", [
    "full:block_size=4,decode_kernel=torch",
    # one page per tile: sequences of different lengths leave whole tiles hidden
    "kivi:bits=2,group=4,residual=8,decode_kernel=torch,decode_tile_tokens=4",
    SHADOWKV])
def test_device_code_paths_give_the_cpu_logits(spec):
    """Masks instead of early-outs (KIVI's hidden tiles and ring merges, the quantiser's
    rounding fix) and plans packed into one buffer give the logits of the CPU's own path."""
    _, model = make_pair("gemma3_hybrid")
    prompts = [list(range(3, 43)), list(range(5, 30)), list(range(1, 27))]
    cpu = decode_logits(make_runner(model, cache=spec), prompts, 10)
    with host_sync.device_code_paths():
        device = decode_logits(make_runner(model, cache=spec), prompts, 10)
    torch.testing.assert_close(device, cpu, atol=1e-6, rtol=0)


def test_the_counter_sees_the_cpu_early_outs():
    """On the CPU's own path KIVI skips tiles nobody sees by reading the device: the counter
    catches those reads, so the zero counts above are not blindness."""
    counter, _ = _decode_syncs("kivi:bits=2,group=4,residual=8,decode_kernel=torch", 2, device_paths=False)
    reads = counter.in_regions("layer")
    assert reads and {s.op for s in reads} <= {"_local_scalar_dense", "is_nonzero"}
    assert {s.where.split(":")[0] for s in reads} == {"kvforge/cache/kivi/attention.py"}


def test_device_code_paths_switch_host_memory_off():
    cpu = torch.device("cpu")
    assert host_sync.host_memory(cpu)
    with host_sync.device_code_paths():
        assert not host_sync.host_memory(cpu)
    assert host_sync.host_memory(cpu) and not host_sync.host_memory(torch.device("meta"))


def test_host_copy_on_the_cpu_is_the_tensor():
    assert host_sync.HostCopy(torch.tensor([3, 1, 2])).tolist() == [3, 1, 2]
