"""ShadowKV's fixed-shape decode step (cache/shadowkv/static_decode.py): the step a CUDA
graph captures when the Triton kernels read the slow tier in place, over exact and
compressed sequences in any mix, and sliding-window layers. Here it runs eagerly on CPU
tensors in Triton's interpreter (exactly what a capture records) and is held to the
dynamic step's logits, chunk reuse and folds across buckets, sequences leaving, joining
and compressing, and the steps that must stay eager; it reads nothing on the host. The
main tests capture their steps: on CUDA in graphs, here in the CPU emulation of a capture
and its replays (graph_replay.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair
from static_steps import Counting, Replayed
from sync_counter import SyncCounter
from triton_helpers import kernel_device

from kvforge.cache.registry import create_cache
from kvforge.engine.decode_graphs import CaptureReport
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.host_sync import device_code_paths

# compressed at the end of a prompt of >= 24 tokens; folds every 4 tokens past an exact tail
# of 8 + 8; k (chunks selected per head) 10% of the prompt in whole chunks: 1 at 30 or 40
# tokens, 2 at 65, while the 128-token bucket selects 4 (a sequence's own k masks the rest)
SPEC = ("shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=3,budget=paper,budget_floor=4,"
        "budget_fraction=0.1,kernel=0")


def _runner(model, device: str, static: bool, spec: str = SPEC, capture: bool = False
            ) -> tuple[ModelRunner, Counting | None]:
    """`static`: decode steps from the buckets' buffers, run eagerly or, with `capture`,
    captured (on CUDA) or recorded and replayed (on the CPU, static_steps.Replayed)."""
    if device == "cuda":
        spec += ",slow_store=pinned"  # values read in place: what the fixed step needs on CUDA
    runner = ModelRunner(model, create_cache(spec, model.cache_layout(), 1 << 22, torch.float32, device))
    runner.cache.sparse.triton = True  # kernel=0 keeps the fused C++ kernel off on the CPU
    graphs = None
    if static:
        kind = Replayed if capture and device == "cpu" else Counting
        graphs = runner.decode_graphs = kind(model, runner.cache, 4, 128, capture=capture)
        if capture:
            report = graphs.capture()
            assert report.graphs == sum(len(step.forms) for step in graphs.steps.values()) > 0
            assert "x forms ['any', 'compressed'])" in graphs.describe(report)  # (the start-up line)
    return runner, graphs


def _script(runner: ModelRunner) -> list[torch.Tensor]:
    """Three prompts (compressed at their end) and a 14-token one (exact); decode steps with
    4 sequences (the exact one last), then 3 (one freed: the exact one beside a padding
    row); prompts joining (a prefill step, eager; a 30-token one compressed at its end, a
    13-token one exact); then 4 again, the exact one first, until it compresses at 24
    tokens (an eager step) and decodes compressed beside the others (every sequence
    compressed: the fixed step's form "compressed")."""
    token = lambda seq, step: (7 * step + 3 * seq + 1) % 90  # noqa: E731
    out = [runner.step([StepItem(0, list(range(1, 41))), StepItem(1, list(range(7, 72))),
                        StepItem(2, list(range(9, 39))), StepItem(4, list(range(2, 16)))])]
    for step in range(5):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in (0, 1, 2, 4)]))
    runner.release(1)
    for step in range(5, 9):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in (0, 2, 4)]))
    runner.release(4)
    out.append(runner.step([StepItem(0, [token(0, 9)], decode=True), StepItem(3, list(range(4, 34))),
                            StepItem(5, list(range(3, 16)))]))
    for step in range(10, 26):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in (5, 0, 2, 3)]))
    return out


# Both run every step twice in Triton's interpreter on the CPU; the GQA model's (every layer
# compressed) takes twice the hybrid's, so it runs in the slow suite and in the mutation
# runs (which take the slow tests of a mutation's files), the hybrid in the default one.
@pytest.mark.parametrize("architecture", [pytest.param("llama_gqa", marks=pytest.mark.slow), "gemma3_hybrid"])
def test_static_steps_give_the_dynamic_logits_chunk_reuse_and_folds(architecture):
    device = kernel_device()
    model = make_pair(architecture)[1].to(device)
    eager_runner, _ = _runner(model, device, static=False)
    eager = _script(eager_runner)
    runner, graphs = _runner(model, device, static=True, capture=True)
    assert graphs is not None and graphs.enabled
    assert device != "cpu" or isinstance(graphs, Replayed) and graphs.launches > 0
    with device_code_paths():  # (the branches CUDA takes around the replays too)
        static = _script(runner)
    assert [runner.cache._seqs[seq].compressed.chunks_per_step for seq in (0, 2, 3, 5)] == [1, 1, 1, 1]
    assert runner.cache.num_cached_tokens(5) == 29  # compressed at 24
    assert graphs.steps[4, 128].slots == 4 and eager_runner.cache._seqs[0].compressed.chunks_per_step == 1
    assert len(static) == len(eager)
    for step, (a, b) in enumerate(zip(static, eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    # every decode step but the one compressing sequence 5: 5 + 4 + 15 (the prefill steps
    # are eager), the last 5 with every sequence compressed
    assert graphs.static_steps == 24 and graphs.by_form == {"any": 19, "compressed": 5}
    got, expected = runner.cache.statistics(), eager_runner.cache.statistics()
    assert got["folded_chunks"] == expected["folded_chunks"] > 0
    assert (got["chunk_hits"], got["chunk_misses"]) == (expected["chunk_hits"], expected["chunk_misses"])
    assert got["chunk_hits"] > 0 and got["chunk_misses"] > 0
    for seq in (0, 2, 3):  # the same reuse slots in every layer
        for ours, theirs in zip(runner.cache._seqs[seq].compressed.layers,
                                eager_runner.cache._seqs[seq].compressed.layers):
            assert torch.equal(ours.slot_ids, theirs.slot_ids)


def test_steps_that_compress_or_do_not_fit_run_eagerly():
    device = kernel_device()
    if device != "cpu":
        pytest.skip("counts static steps without capture")
    model = make_pair("llama_gqa")[1]
    runner, graphs = _runner(model, device, static=True)
    runner.step([StepItem(0, list(range(1, 41))), StepItem(1, list(range(1, 23)))])  # 22 tokens: stays exact
    runner.step([StepItem(seq, [5]) for seq in (0, 1)])
    assert graphs.static_steps == 1  # an exact sequence decodes beside a compressed one
    runner.step([StepItem(seq, [5]) for seq in (0, 1)])  # sequence 1 reaches min_context: compresses
    assert graphs.static_steps == 1 and runner.cache.is_compressed(1)
    runner.release(1)
    runner.step([StepItem(0, [5])])
    assert graphs.static_steps == 2
    runner.step([StepItem(2, [1 + i % 89 for i in range(139)])])
    runner.step([StepItem(2, [5])])  # 140 tokens > the 128-token bucket
    assert graphs.static_steps == 2


def test_no_static_form_without_in_place_values_or_the_triton_path():
    model = make_pair("llama_gqa")[1]
    cache = create_cache(SPEC, model.cache_layout(), 1 << 22, torch.float32)
    assert cache.static_decode(4, 128) is None  # the PyTorch path
    cache.sparse.triton = True
    assert cache.static_decode(4, 128) is not None
    cache.sparse.values_in_place = False  # the host gathers the misses' values
    assert cache.static_decode(4, 128) is None
    assert "--cache-opt slow_store=pinned" in Counting(model, cache, 2, 128, capture=False).describe(
        CaptureReport(0, 0.0, 0))
    hybrid = make_pair("gemma3_hybrid")[1]
    sliding = create_cache(SPEC, hybrid.cache_layout(), 1 << 22, torch.float32)
    sliding.sparse.triton = True
    step = sliding.static_decode(4, 128)  # sliding-window layers: their inner cache's fixed buffers
    assert step is not None and step.sliding is not None and step.make_meta().sliding is not None


def test_the_static_step_reads_nothing_on_the_host():
    """What a capture records (the loaded step's forward) must read no device value on the
    host, on the code paths CUDA takes."""
    if kernel_device() != "cpu":
        pytest.skip("counts the CUDA code path on CPU tensors")
    model = make_pair("llama_gqa")[1]
    runner, graphs = _runner(model, "cpu", static=True)
    # three compressed sequences and an exact one (11 tokens)
    runner.step([StepItem(seq, list(range(1 + seq, 41 + 9 * seq))) for seq in range(3)]
                + [StepItem(3, list(range(1, 12)))])
    cache = runner.cache
    from kvforge.batch import ForwardBatch

    cached = [cache.num_cached_tokens(seq) for seq in range(4)]
    assert all(cache.allocate(seq, n + 1) for seq, n in enumerate(cached))
    batch = ForwardBatch.build([0, 1, 2, 3], [[4], [5], [6], [7]], cached)
    step = graphs.steps[graphs.bucket(batch)]
    assert step.load(batch) is not None
    assert step.forms == ("any", "compressed")
    for form in step.forms:  # (the compressed form over these buffers: its exact row reads a scratch state)
        counter = SyncCounter()
        with counter.counting(device_paths=True), counter.within("forward_step"), torch.inference_mode():
            model.forward_step(cache, step.make_meta(form))
        assert counter.syncs == [], form
    with pytest.raises(ValueError, match="form 'exact'"):
        step.make_meta("exact")


def test_a_bucket_shorter_than_min_context_is_its_inner_caches_step_alone():
    """No compressed sequence fits a bucket shorter than min_context: its fixed step (slots
    0) has no sparse buffers or kernels, and decodes exact sequences as the dynamic step does."""
    if kernel_device() != "cpu":
        pytest.skip("counts static steps without capture")
    model = make_pair("gemma3_hybrid")[1]
    spec = SPEC.replace("min_context=24", "min_context=600")

    def decode(static: bool) -> tuple[list[torch.Tensor], Counting | None]:
        runner, graphs = _runner(model, "cpu", static=False, spec=spec)
        if static:
            graphs = runner.decode_graphs = Counting(model, runner.cache, 2, 1024, capture=False)
        out = [runner.step([StepItem(0, list(range(1, 21))), StepItem(1, list(range(5, 35)))])]
        out += [runner.step([StepItem(seq, [3 + step + seq], decode=True) for seq in (0, 1)]) for step in range(3)]
        return out, graphs

    static, graphs = decode(True)
    eager, _ = decode(False)
    assert graphs is not None and sorted(graphs.steps) == [(1, 512), (1, 1024), (2, 512), (2, 1024)]
    short = graphs.steps[2, 512]
    assert short.slots == 0 and "0.info" not in short.buffers.tensors and graphs.steps[2, 1024].slots > 0
    assert short.make_meta().groups == () and graphs.static_steps == 3
    for a, b in zip(static, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
