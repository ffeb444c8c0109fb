"""The static decode step (engine/decode_graphs.py, cache/static_decode.py): decode-only
steps run from fixed buffers, rows padded to a bucket, page tables padded to a fixed width,
padding rows writing a scratch page. These tests hold it to the dynamic step's logits for
every architecture and decode path, across buckets, ragged lengths, sequences leaving and
joining, and steps that must fall back to the eager path: run eagerly, and captured once
per bucket and replayed, as CUDA runs it (on the CPU, graph_replay.py's emulation of a
capture; on CUDA, real graphs)."""

from __future__ import annotations

import gc
from contextlib import nullcontext

import pytest
import torch
from conftest import across_kv_model, make_pair, make_runner
from static_steps import Counting, Replayed
from sync_counter import SyncCounter
from triton_helpers import interpreted_or_skip

from kvforge.batch import ForwardBatch
from kvforge.cache.base import CacheMethod
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.cache.static_decode import SCRATCH_SEQ, StaticDecode
from kvforge.engine.decode_graphs import CaptureReport, DecodeGraphs, powers_of_two_up_to
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.host_sync import device_code_paths
from kvforge.tools.bench.compare import parse_compare

FULL_PATHS = ["full:block_size=4", "full:block_size=4,decode_kernel=gather", "full:block_size=4,decode_kernel=torch",
              "full:block_size=4,decode_kernel=triton",
              "full:block_size=8,storage_dtype=float8_e4m3fn"]
# R = 8, G = 4: keys flush and values leave the window during the script's decode steps
KIVI = "kivi:bits=2,group=4,residual=8"
KIVI_PATHS = [KIVI, f"{KIVI},decode_kernel=torch", f"{KIVI},decode_kernel=triton", "kivi:bits=4,group=4,residual=8,"
              "key_space=pre_rope,rotation=hadamard,decode_kernel=torch", f"{KIVI},sinks=2,decode_kernel=torch"]


def with_graphs(model, spec: str, max_num_seqs: int = 4, max_len: int = 32) -> tuple[ModelRunner, Counting]:
    runner = make_runner(model, spec)
    graphs = Counting(model, runner.cache, max_num_seqs, max_len, capture=False)
    runner.decode_graphs = graphs
    return runner, graphs


def replaying(model, spec: str) -> tuple[ModelRunner, Replayed]:
    """A runner whose decode steps are captured and replayed as on CUDA (static_steps.Replayed)."""
    runner = make_runner(model, spec)
    graphs = runner.decode_graphs = Replayed(model, runner.cache, 4, 32, capture=True)
    assert graphs.capture().graphs == len(graphs.steps) > 0
    return runner, graphs


def script(runner: ModelRunner) -> list[torch.Tensor]:
    """Ragged prompts, decode steps with 3 then 2 sequences (one freed), a prompt joining
    mid-way (a mixed step: eager), then 3 sequences again, running past the captured length."""
    out = [runner.step([StepItem(0, [1, 2, 3, 4, 5]), StepItem(1, list(range(7, 18))), StepItem(2, [9, 8, 7])])]
    token = lambda seq, step: (7 * step + 3 * seq + 1) % 90  # noqa: E731
    for step in range(4):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in range(3)]))
    runner.release(1)
    for step in range(4, 7):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in (0, 2)]))
    out.append(runner.step([StepItem(0, [token(0, 7)], decode=True), StepItem(3, [4, 5, 6, 7, 8, 9])]))
    for step in range(8, 30):
        out.append(runner.step([StepItem(seq, [token(seq, step)], decode=True) for seq in (0, 2, 3)]))
    return out


def check_same(model, spec: str, replay: bool = False) -> Counting:
    """The script's logits with decode steps from the buckets' buffers, run eagerly or
    (`replay`) captured once and replayed, equal the dynamic steps'. A replay is what CUDA
    runs; it takes CUDA's code paths, and so does its reference."""
    if "decode_kernel=triton" in spec:
        interpreted_or_skip()
    with device_code_paths() if replay else nullcontext():
        eager = script(make_runner(model, spec))
        runner, graphs = replaying(model, spec) if replay else with_graphs(model, spec)
        static = script(runner)
    assert len(static) == len(eager)
    assert not replay or ("triton" in spec) == (graphs.launches > 0)
    # Padding rows change how the CPU blocks its matmuls (last-bit differences), and KIVI's
    # stored codes follow them, so differences grow to ~3e-5 over the script; a planning
    # error moves logits by orders of magnitude more.
    for step, (a, b) in enumerate(zip(static, eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    return graphs


@pytest.mark.parametrize("spec", [FULL_PATHS[0], KIVI_PATHS[0]])
def test_static_steps_give_the_dynamic_logits(arch, spec):
    graphs = check_same(make_pair(arch)[1], spec)
    # 4 + 3 decode steps, then the ones whose sequences fit the 32-token bucket
    assert graphs.static_steps >= 10


def test_garbage_is_not_collected_during_a_capture():
    """A collection inside a capture would run finalisers there (ShadowKV's store
    unregisters its page-locked memory, which CUDA refuses while capturing)."""
    assert gc.isenabled()
    _, graphs = replaying(make_pair("llama_gqa")[1], "full:block_size=4")
    assert graphs.collecting_during_capture == [False] * len(graphs.steps) and gc.isenabled()


def test_a_step_from_the_buffers_without_a_graph_plans_afresh():
    """Without a capture each step derives its plan from the buffers anew (a plan caches
    its masks per metadata object); the gathered path on Gemma3 reads those masks."""
    graphs = check_same(make_pair("gemma3_hybrid")[1], "full:block_size=4,decode_kernel=gather")
    assert graphs.static_steps >= 10


@pytest.mark.parametrize("spec", FULL_PATHS + KIVI_PATHS)
def test_every_decode_path_of_a_replayed_step_gives_the_dynamic_logits(spec):
    """Gemma3's hybrid layers: sliding-window groups beside global ones."""
    graphs = check_same(make_pair("gemma3_hybrid")[1], spec, replay=True)
    assert graphs.static_steps >= 10


@pytest.mark.parametrize("spec", ["full:block_size=4", KIVI])
def test_replayed_steps_with_swiftkv_and_across_kv(spec):
    graphs = check_same(across_kv_model(), spec, replay=True)
    assert graphs.static_steps >= 10


def test_long_sequences_and_big_batches_run_eagerly():
    model = make_pair("llama_gqa")[1]
    runner, graphs = with_graphs(model, "full:block_size=4", max_num_seqs=2, max_len=16)
    runner.step([StepItem(seq, list(range(1, 10))) for seq in range(3)])
    runner.step([StepItem(seq, [5]) for seq in range(3)])  # 3 sequences > 2 rows
    assert graphs.static_steps == 0
    runner.step([StepItem(seq, [5]) for seq in range(2)])
    assert graphs.static_steps == 1
    runner.step([StepItem(0, list(range(8)))])  # 19 tokens > 16
    runner.step([StepItem(0, [5])])
    assert graphs.static_steps == 1


def test_padding_rows_write_only_the_scratch_page():
    model = make_pair("llama_gqa")[1]
    runner = make_runner(model, "full:block_size=4")
    cache = runner.cache
    cache.k_store.zero_(), cache.v_store.zero_()  # (torch.empty: NaN bits would never compare equal)
    runner.step([StepItem(seq, list(range(1, 6 + 3 * seq))) for seq in range(3)])
    # made after the prompts, so the scratch page is not page 0 (where zeroed slots point)
    graphs = runner.decode_graphs = Counting(model, cache, 8, 32, capture=False)
    before = cache.k_store.clone(), cache.v_store.clone()
    lengths = [cache.num_cached_tokens(seq) for seq in range(3)]
    runner.step([StepItem(seq, [5 + seq]) for seq in range(3)])  # 3 sequences in the bucket of 4
    assert graphs.static_steps == 1
    block = cache.block_size
    expected = {(cache.pages.pages(seq, 0)[n // block], n % block) for seq, n in enumerate(lengths)}
    scratch = (cache.pages.pages(SCRATCH_SEQ, 0)[0], 0)
    for store, old in zip((cache.k_store, cache.v_store), before):
        changed = {tuple(slot) for slot in (store != old).any(dim=(0, 1, 4)).nonzero().tolist()}
        assert expected <= changed <= expected | {scratch}
        assert scratch in changed  # the padding row wrote, and only there


def test_buckets():
    assert powers_of_two_up_to(1) == [1]
    assert powers_of_two_up_to(6) == [1, 2, 4, 6]
    assert powers_of_two_up_to(8) == [1, 2, 4, 8]
    assert powers_of_two_up_to(3000, 512) == [512, 1024, 2048, 3000]


def three_sequences_loaded(runner: ModelRunner, graphs: DecodeGraphs) -> tuple[ForwardBatch, StaticDecode]:
    """Three prompts prefilled, then the next decode step of all three loaded in its bucket
    (4 rows: one padding row); returns the step's batch and the bucket's static step."""
    runner.step([StepItem(seq, list(range(1, 8 + 5 * seq))) for seq in range(3)])
    cached = [runner.cache.num_cached_tokens(seq) for seq in range(3)]
    assert all(runner.cache.allocate(seq, n + 1) for seq, n in enumerate(cached))
    batch = ForwardBatch.build([0, 1, 2], [[4], [5], [6]], cached)
    step = graphs.steps[graphs.bucket(batch)]
    step.load(batch)
    return batch, step


@pytest.mark.parametrize("spec", ["full:block_size=4,decode_kernel=torch", "full:block_size=4,decode_kernel=gather",
                                  f"{KIVI},decode_kernel=torch"])
@pytest.mark.parametrize("model_of", [lambda: make_pair("gemma3_hybrid")[1], across_kv_model], ids=["gemma3", "swiftkv"])
def test_the_static_step_reads_nothing_on_the_host(spec, model_of):
    """What a capture records must read no device value on the host (CUDA's code paths)."""
    model = model_of()
    runner, graphs = with_graphs(model, spec)
    batch, step = three_sequences_loaded(runner, graphs)
    counter = SyncCounter()
    with counter.counting(device_paths=True), counter.within("forward_step"), torch.inference_mode():
        model.forward_step(runner.cache, step.make_meta())
    assert counter.syncs == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("spec", ["full:block_size=4", "full:block_size=4,decode_kernel=torch", KIVI,
                                  f"{KIVI},decode_kernel=torch"])
def test_captured_graphs_replay_the_eager_logits(spec):
    model = make_pair("llama_gqa")[1].to("cuda")

    def runner(capture: bool) -> tuple[ModelRunner, Counting | None]:
        made = ModelRunner(model, create_cache(spec, model.cache_layout(), 1 << 22, torch.float32, "cuda"))
        graphs = None
        if capture:
            graphs = made.decode_graphs = Counting(model, made.cache, 4, 32, capture=True)
            assert graphs.capture().graphs == len(graphs.steps) > 0
        return made, graphs

    eager = script(runner(False)[0])
    replaying, graphs = runner(True)
    captured = script(replaying)
    for step, (a, b) in enumerate(zip(captured, eager)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    assert graphs is not None and graphs.static_steps >= 10


def test_compare_eager_is_the_system_under_test_without_graphs():
    [system] = parse_compare(["eager"], parse_cache_spec("kivi:bits=2"))
    assert system.enforce_eager is True and system.cache == parse_cache_spec("kivi:bits=2")
    assert system.name == "kvforge[kivi:bits=2], eager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_engine_captures_on_cuda_unless_told_not_to(enforce_eager):
    model = make_pair("llama_gqa")[1].to("cuda")
    cache = create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.float32, "cuda")
    engine = LLMEngine(model, cache, config=EngineConfig(max_num_seqs=4, max_seq_len_to_capture=64,
                                                         enforce_eager=enforce_eager))
    assert (engine.runner.decode_graphs is None) == enforce_eager
    assert (engine.capture_report is None) == enforce_eager
    assert ("--enforce-eager)" in engine.graphs_report) == enforce_eager
    assert ("CUDA graphs" in engine.graphs_report) != enforce_eager


def test_the_start_up_line_says_what_was_captured_at_what_cost():
    """The line an engine on CUDA prints: the graphs, their buckets, the capture's seconds
    and memory (vLLM logs the same), or, before any capture, that the buffers run eagerly."""
    _, graphs = with_graphs(make_pair("llama_gqa")[1], "full:block_size=4", max_num_seqs=4, max_len=1024)
    line = graphs.describe(CaptureReport(graphs=6, seconds=2.34, bytes=48 * 2**20))
    assert line.startswith("decode steps replay 6 CUDA graphs (sequences [1, 2, 4] x tokens [512, 1024])"), line
    assert "in 2.3 s, 48 MiB" in line and "--enforce-eager" in line
    assert graphs.describe(CaptureReport(0, 0.0, 0)) == "decode steps run eagerly from fixed buffers (not captured)"


def test_the_start_up_line_names_why_decode_runs_eagerly():
    spec = "shadowkv:chunk=4,local=8,outliers=2,min_context=24,generated_window=8,rank=4,budget=8"
    _, graphs = with_graphs(make_pair("llama_gqa")[1], spec)
    assert not graphs.enabled
    assert graphs.describe(CaptureReport(0, 0.0, 0)) == ("decode steps run eagerly: ShadowKV's fixed decode step "
                                                         "runs its Triton kernels (CUDA, `triton` installed, kernel=1)")
    graphs.cache.sparse.triton, graphs.cache.sparse.values_in_place = True, False  # CUDA with pageable values
    assert "--cache-opt slow_store=pinned" in graphs.describe(CaptureReport(0, 0.0, 0))
    _, hybrid = with_graphs(make_pair("gemma3_hybrid")[1], spec)
    # sliding-window layers have a fixed step (their inner cache's): only the kernels decide
    assert "runs its Triton kernels" in hybrid.describe(CaptureReport(0, 0.0, 0))
    # a method without a fixed step of its own says so by default
    assert CacheMethod.why_no_static_decode(graphs.cache) == "the ShadowKVCache cache has no fixed-shape decode step"


def test_an_engine_says_how_its_decode_steps_run_at_start_up(monkeypatch):
    """LLM.start_up_lines carries the engine's line (set on CUDA only; here set by hand)."""
    from kvforge.engine.llm import LLM

    llm = LLM("llama-tiny", load_format="dummy")
    assert llm.engine.graphs_report is None  # a CPU engine captures nothing and says nothing of it
    monkeypatch.setattr(llm.engine, "graphs_report", "decode steps run eagerly (--enforce-eager)")
    assert llm.start_up_lines()[-1] == "decode steps run eagerly (--enforce-eager)"
    # the cache method's own line (ShadowKV's page-locked RAM) comes before it
    monkeypatch.setattr(llm.engine.cache, "start_up_line", lambda: "the cache's line")
    assert llm.start_up_lines()[-2:] == ["the cache's line", "decode steps run eagerly (--enforce-eager)"]


def test_kivi_hands_end_step_the_real_rows_only():
    """end_step indexes the step's K/V by the real batch's rows; on the PyTorch ring-write
    path (no C++ kernels) a padded [rows] tensor would not match the batch's slots."""
    model = make_pair("llama_gqa")[1]
    runner, graphs = with_graphs(model, KIVI)
    batch, step = three_sequences_loaded(runner, graphs)
    host = step.load(batch)  # (loaded again: load only fills buffers and plans)
    meta = step.make_meta()
    with torch.inference_mode():
        model.forward_step(runner.cache, meta)
    step.finish(host, meta, 3)
    assert step.rows == 4 and host.step_kv.keys() == meta.step_kv.keys()
    assert all(k.shape[0] == v.shape[0] == 3 for k, v in host.step_kv.values())


# ShadowKV's budget holds compressed sequences (a smaller one goes to the exact stores
# whole, and sequences stop short of min_context long before their pages run out)
@pytest.mark.parametrize("spec,budget", [("full:block_size=4", 1 << 18),
                                         ("shadowkv:chunk=4,local=8,outliers=1,min_context=24,rank=3,kernel=0",
                                          1 << 20)])
def test_the_scratch_pages_are_left_out_of_what_admission_counts(spec, budget):
    """The fixed step's scratch pages (one per layer group of each paged store) are taken
    once, and the capacity admission checks shrinks by them: a prompt admitted is one the
    cache can then hold."""
    model = make_pair("gemma3_hybrid")[1]
    cache = create_cache(spec, model.cache_layout(), budget, torch.float32)
    if hasattr(cache, "sparse"):
        cache.sparse.triton = True
    paged = [c for c in (getattr(cache, "exact", None), getattr(cache, "sliding", None)) if c is not None] or [cache]
    before = [(c.memory.capacity["fast"], c.pages.pool.num_free) for c in paged]
    longest = max(n for n in range(1, 4096) if cache.memory.fits_together([n]))
    assert cache.static_decode(2, 64) is not None and cache.static_decode(4, 64) is not None  # (taken once)
    for c, (capacity, free) in zip(paged, before):
        taken = free - c.pages.pool.num_free
        assert taken == c.pages.groups.num_groups > 0
        assert c.memory.capacity["fast"] == capacity - taken * c.page_bytes
    assert cache.memory_usage()["fast"] == 0  # (left out of usage too: idle is empty)
    admitted = max(n for n in range(1, longest + 1) if cache.memory.fits_together([n]))
    assert admitted < longest and cache.allocate(7, admitted)


def _most_held(cache: CacheMethod, num_tokens: int) -> int:
    """How many sequences of `num_tokens` tokens admission lets in at once."""
    held = 0
    while held < 1000 and cache.memory.fits_together([num_tokens] * (held + 1)):
        held += 1
    return held


def test_with_nothing_to_compress_the_scratch_pages_are_left_out_too():
    """A ShadowKV budget too small for a min_context sequence to compress (split.py: one
    chunk page, the whole budget for the exact stores): the fixed step still takes a scratch
    page from each inner cache, and admission counts it: one fewer one-page sequence fits,
    and every one admitted then allocates."""
    model = make_pair("gemma3_hybrid")[1]
    cache = create_cache("shadowkv:chunk=4,local=8,outliers=1,min_context=24,rank=3,kernel=0", model.cache_layout(),
                         1 << 18, torch.float32)
    cache.sparse.triton = True
    assert cache.split.chunk_pages == 1 and cache.split.fixed <= 4  # nothing compresses
    page = cache.exact.pages.block_size
    before = _most_held(cache, page)
    assert cache.static_decode(2, 64) is not None
    after = _most_held(cache, page)
    assert after == before - 1 > 0 and all(cache.allocate(seq, page) for seq in range(after))
