"""ShadowKV's Triton decode path (sparse.py, triton_decode.py) against the PyTorch path
(its reference): the same chunk picks, slot ids, slot contents, hit/miss counts and
outputs, step after step (chunk reuse), on groups of sequences of different lengths, ranks
and k, GQA, with and without a sequence that has fewer candidates than k (the slot mask).
On CUDA the kernels run compiled; without a GPU in Triton's CPU interpreter (tests/conftest.py
turns it on); skipped without the `triton` package. One test needs CUDA: the cache end to
end on a tiny model with and without the Triton path."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair
from triton_helpers import kernel_device, warps_of_launches

from kvforge.cache.registry import create_cache
from kvforge.cache.shadowkv.compress import compress_layer
from kvforge.cache.shadowkv.sparse import SparseAttention, SparseGroup
from kvforge.cache.shadowkv.state import CompressedSequence, buffer_rows
from kvforge.cache.shadowkv.stats import ShadowKVStats
from kvforge.cache.shadowkv.store import ChunkStore
from kvforge.config import RopeConfig
from kvforge.engine.runner import ModelRunner
from kvforge.kernels.triton_runtime import triton_installed
from kvforge.rope import PositionedRope, RotaryEmbedding

CAPACITY = 24  # window capacity of the test buffers (no folding within a test)
CHUNK, OUTLIERS, LOCAL = 4, 2, 8




def _rope(dim: int, device: str | torch.device = "cpu") -> PositionedRope:
    return RotaryEmbedding(dim, RopeConfig(theta=10000.0), device).at(torch.arange(1, device=device), torch.float32)


def _build(lengths: list[int], kv_heads: int, dim: int, ranks: list[int], ks: list[int], dtype: torch.dtype,
           device: str, triton: bool, seed: int = 0, in_place: bool = True
           ) -> tuple[SparseAttention, list[CompressedSequence], ShadowKVStats]:
    """One compressed layer per sequence (k its own), from random post-RoPE keys and values
    (compressed in float32, then stored in `dtype`), chunk pages scattered over the store.
    Same seed: identical inputs for both paths. `in_place`: the Triton path reads the
    misses' values from the slow tier itself (else: the host gathers them, one staged copy)."""
    generator = torch.Generator().manual_seed(seed)
    chunks = [(n - LOCAL) // CHUNK for n in lengths]
    pages = 2 * sum(chunks) + 3
    store = ChunkStore(1, kv_heads, dim, CHUNK, pages, dtype, torch.device(device), "memory", None)
    order = torch.randperm(pages, generator=generator).tolist()
    states = []
    for n, count, r, k in zip(lengths, chunks, ranks, ks):
        base = torch.randn(kv_heads, 1, dim, generator=generator)  # a shared direction: landmarks differ in scale
        keys = base + torch.randn(kv_heads, n, dim, generator=generator)
        values = torch.randn(kv_heads, n, dim, generator=generator)
        layer, data = compress_layer(keys, values, _rope(dim), count * CHUNK, lambda _, r=r: r, CHUNK, OUTLIERS,
                                     CAPACITY, k)
        for name in ("basis", "coefficients", "keys", "values"):
            setattr(layer, name, getattr(layer, name).to(device, dtype))
        for name in ("outliers", "slot_ids", "candidates"):
            setattr(layer, name, getattr(layer, name).to(device))
        ids, order = order[:count], order[count:]
        table = torch.tensor(ids, dtype=torch.long)
        store.write(0, table.to(device), data.landmarks.to(device), data.values)
        used = layer.outliers.shape[1]
        states.append(CompressedSequence(pages=ids, page_table=table.to(device), window=n - count * CHUNK,
                                         chunks_per_step=k, num_outliers=used,
                                         slots_start=buffer_rows(used, CHUNK, CAPACITY, k)[0], fixed_bytes=0,
                                         layers=[layer]))
    stats = ShadowKVStats(device_type=device)
    sparse = SparseAttention(store, CHUNK, stats, reuse=True, device=torch.device(device), kernel=False,
                             triton=triton)
    sparse.values_in_place = in_place
    return sparse, states, stats


def _step(sparse: SparseAttention, states: list[CompressedSequence], q: torch.Tensor, own_k: torch.Tensor,
          own_v: torch.Tensor) -> tuple[torch.Tensor, SparseGroup]:
    """One decode step as the cache runs it: the token into each window (by `write`, or by
    the Triton path itself), attend, window + 1."""
    group = SparseGroup.build(states, list(range(len(states))), 1, True, CHUNK, q.device)
    assert sparse.writes_own_tokens(group) == sparse.triton
    for b, state in enumerate(states):
        layer = state.layers[0]
        row = state.window_start(CHUNK) + state.window
        if not sparse.writes_own_tokens(group):
            layer.keys[:, row], layer.values[:, row] = own_k[b], own_v[b]
    out = sparse.attend(0, group, q[:, None], own_k[:, None], own_v[:, None], _rope(q.shape[-1], q.device), 0.37)
    for state in states:
        state.window += 1
    return out[:, 0], group


def _packed_slice(v: torch.Tensor) -> torch.Tensor:
    """v [B, H, D] as the layer hands it over when its q/k/v projections are packed: the
    middle slice of one wider row per sequence (rows apart, each row contiguous)."""
    batch, heads, dim = v.shape
    wide = torch.zeros(batch, 3 * heads * dim, dtype=v.dtype, device=v.device)
    view = wide[:, heads * dim:2 * heads * dim].view(batch, heads, dim)
    view.copy_(v)
    assert not view.is_contiguous()
    return view


def tolerance(dtype: torch.dtype) -> dict:
    # float32: both paths compute in float32, in other orders. bfloat16: the PyTorch path
    # rounds the rebuilt keys to bfloat16 before RoPE and after each RoPE operation, the
    # kernel once after RoPE (one or two bfloat16 ulps of a key).
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


CASES = {
    # GQA (3 query heads per KV head), each sequence its own length, rank and k; the last
    # has 3 candidate chunks < k = 4: some slots stay empty and attention masks them.
    "masked": dict(lengths=[72, 104, 28], kv_heads=2, heads=6, dim=16, ranks=[5, 11, 2], ks=[4, 3, 4]),
    # every sequence has at least k candidates: no slot mask (slots_full)
    "full": dict(lengths=[60, 88, 48], kv_heads=2, heads=4, dim=32, ranks=[7, 3, 20], ks=[3, 2, 3]),
}


@pytest.mark.parametrize("in_place", [True, False], ids=["values-in-place", "values-staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_path_equals_the_pytorch_path(case, dtype, in_place):
    device = kernel_device()
    if in_place and device == "cuda":
        pytest.skip("the slow tier of this test is pageable; test_cuda_cache_logits_equal_with_and_without_triton "
                    "reads a pinned one in place")
    spec = CASES[case]
    args = (spec["lengths"], spec["kv_heads"], spec["dim"], spec["ranks"], spec["ks"], dtype, device)
    ref, ref_states, ref_stats = _build(*args, triton=False)
    fast, fast_states, fast_stats = _build(*args, triton=True, in_place=in_place)
    generator = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, dim = len(spec["lengths"]), spec["heads"], spec["kv_heads"], spec["dim"]
    q = torch.randn(batch, heads, dim, generator=generator)
    misses = []
    for _ in range(3):
        q = q + 0.5 * torch.randn(batch, heads, dim, generator=generator)  # drifting queries: hits and misses
        own_k, own_v = torch.randn(2, batch, kv_heads, dim, generator=generator)
        step = [t.to(device, dtype) for t in (q, own_k, own_v)]
        expected, group = _step(ref, ref_states, *step)
        got, _ = _step(fast, fast_states, *step[:2], _packed_slice(step[2]))
        assert group.slots_full == (case == "full")
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))
        for ref_state, fast_state in zip(ref_states, fast_states):
            ref_layer, fast_layer = ref_state.layers[0], fast_state.layers[0]
            assert torch.equal(fast_layer.slot_ids, ref_layer.slot_ids)  # same picks, same slots
            used = ref_state.window_start(CHUNK) + ref_state.window  # the step's token included
            torch.testing.assert_close(fast_layer.keys[:, :used].float(), ref_layer.keys[:, :used].float(),
                                       **tolerance(dtype))
            assert torch.equal(fast_layer.values[:, :used], ref_layer.values[:, :used])
        assert (fast_stats.chunk_hits, fast_stats.chunk_misses) == (ref_stats.chunk_hits, ref_stats.chunk_misses)
        misses.append(fast_stats.chunk_misses)
    assert fast_stats.chunk_hits > 0 and misses[-1] > misses[0] > 0  # later steps both hit and miss
    if case == "masked":
        assert (fast_states[-1].layers[0].slot_ids == -1).any()  # an empty slot, masked


def test_the_decode_warps_knob_reaches_the_scores_and_attention_launches(monkeypatch):
    """KVFORGE_TRITON_DECODE_WARPS sets the warps per program of both decode kernels."""
    from kvforge.cache.shadowkv import triton_decode
    from kvforge.kernels.triton_runtime import DECODE_WARPS_ENV

    device = kernel_device()
    warps = {name: warps_of_launches(monkeypatch, triton_decode, name) for name in ("_scores_kernel", "_attention_kernel")}
    monkeypatch.setenv(DECODE_WARPS_ENV, "8")
    spec = CASES["full"]
    sparse, states, _ = _build(spec["lengths"], spec["kv_heads"], spec["dim"], spec["ranks"], spec["ks"],
                               torch.float32, device, triton=True, in_place=device == "cpu")
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(len(states), spec["heads"], spec["dim"], generator=generator)
    own_k, own_v = torch.randn(2, len(states), spec["kv_heads"], spec["dim"], generator=generator)
    _step(sparse, states, *(t.to(device) for t in (q, own_k, own_v)))
    assert warps == {"_scores_kernel": [8], "_attention_kernel": [8]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_landmark_scores_equal_the_reference(dtype):
    """The scoring kernel alone against `select.chunk_scores` on a padded group."""
    device = kernel_device()
    from kvforge.cache.shadowkv.pointer_table import sequence_info
    from kvforge.cache.shadowkv.select import chunk_scores
    from kvforge.cache.shadowkv.triton_decode import landmark_scores

    spec = CASES["masked"]
    sparse, states, _ = _build(spec["lengths"], spec["kv_heads"], spec["dim"], spec["ranks"], spec["ks"], dtype,
                               device, triton=True)
    group = SparseGroup.build(states, [0, 1, 2], 1, True, CHUNK, torch.device(device))
    q = torch.randn(3, spec["heads"], spec["dim"], generator=torch.Generator().manual_seed(2)).to(device, dtype)
    layers = [s.layers[0] for s in states]
    info = sequence_info(layers, group.meta, torch.device(device))
    got = landmark_scores(q, sparse.store.landmarks[0], group.table, info, 0.37)
    lm = [sparse.store.sequence_landmarks(0, s.page_table, s.run_start) for s in states]
    expected = chunk_scores(q[:, None], lm, group.candidates(0), 0.37)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))  # non-candidates and padding
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton path's dispatch on a GPU)")
@pytest.mark.parametrize("slow_store", ["memory", "pinned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_cache_logits_equal_with_and_without_triton(dtype, slow_store):
    """The cache on CUDA, end to end (compression, batched decode with folding; the fetch
    side stream with `memory`, the kernel reading the page-locked slow tier at its host
    address with `pinned`): `kernel=1` (the Triton path) against `kernel=0` (the PyTorch path)."""
    import copy

    if not triton_installed():
        pytest.skip("the `triton` package is not installed")
    _, model = make_pair("llama_gqa")
    model = copy.deepcopy(model).to("cuda", dtype)
    prompts = [list(range(3, 60)), list(range(5, 90)), list(range(7, 40))]
    spec = "shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=3,budget=8"
    runners = [ModelRunner(model, create_cache(spec + f",kernel={on},slow_store={slow_store}", model.cache_layout(),
                                               1 << 22, dtype, device="cuda")) for on in (0, 1)]
    assert not runners[0].cache.sparse.triton and runners[1].cache.sparse.triton
    assert runners[1].cache.sparse.values_in_place == (slow_store == "pinned")
    expected, got = (decode_logits(runner, prompts, 16).float().cpu() for runner in runners)
    ref_stats, fast_stats = (runner.cache.statistics() for runner in runners)
    assert fast_stats["chunk_misses"] > 0 and fast_stats["folded_chunks"] > 0
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        assert fast_stats["chunk_misses"] == ref_stats["chunk_misses"]
    else:
        # bfloat16: the paths round rebuilt keys differently (see `tolerance`), which moves
        # hidden states by bfloat16 ulps from layer to layer, and a near tie between two
        # chunks may then go the other way: the logits agree to bfloat16 accuracy of a few
        # layers, not bit for bit, and the miss counts may differ.
        torch.testing.assert_close(got, expected, atol=1e-1, rtol=5e-2)


def test_cache_logits_equal_with_the_triton_path_forced():
    """The cache end to end (compression, batched decode with folding, `write` leaving the
    decode token to the kernel) with the Triton path forced on its CPU tensors (interpreted)
    against the PyTorch path."""
    if kernel_device() != "cpu":
        pytest.skip("runs the interpreter on CPU tensors; CUDA runs test_cuda_cache_logits_equal_with_and_without_triton")
    _, model = make_pair("llama_gqa")
    prompts = [list(range(3, 50)), list(range(5, 70)), list(range(7, 40))]
    spec = "shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=4,rank=3,budget=8,kernel=0"
    runners = [ModelRunner(model, create_cache(spec, model.cache_layout(), 1 << 22, torch.float32)) for _ in "ab"]
    runners[1].cache.sparse.triton = True
    expected, got = (decode_logits(runner, prompts, 8) for runner in runners)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    ref_stats, fast_stats = (runner.cache.statistics() for runner in runners)
    assert fast_stats["chunk_misses"] == ref_stats["chunk_misses"] > 0
    assert fast_stats["chunk_hits"] == ref_stats["chunk_hits"] > 0
    assert fast_stats["folded_chunks"] > 0


@pytest.mark.parametrize("slots, picks, tile", [(4, 4, 4096), (5, 3, 4096), (6, 6, 8), (7, 5, 16)],
                         ids=["one-tile", "fewer-picks-than-slots", "one-pick-a-tile", "two-picks-a-tile"])
@pytest.mark.parametrize("reuse", [True, False])
def test_the_fused_match_equals_match_slots(reuse, slots, picks, tile):
    """`match_in_place` (one launch: validity, held ids, the reuse rule, write-back, counts)
    against slots.match_slots on random held ids and scores: sequences of different k (slots
    past a sequence's k never take a miss), empty slots, picks with score -inf (fewer
    candidates than k), slot counts that are not powers of two, fewer picks than slots (a
    narrow table), picks taken a tile at a time, with and without reuse."""
    device = kernel_device()
    from kvforge.cache.shadowkv.pointer_table import pointer_tables
    from kvforge.cache.shadowkv.select import top_chunks
    from kvforge.cache.shadowkv.slots import match_slots
    from kvforge.cache.shadowkv.state import LayerState
    from kvforge.cache.shadowkv.triton_slots import match_in_place

    generator = torch.Generator().manual_seed(5)
    heads, chunks = 3, picks  # the table is as wide as the picks: top-k of every chunk
    ks = [slots, 2, 3, 1, slots]
    layers = []
    for k in ks:
        held = torch.stack([torch.randperm(chunks + slots, generator=generator)[:k] for _ in range(heads)])
        held[held >= chunks] = -1  # chunk ids the table no longer has room for stand for empty slots
        held[torch.rand(held.shape, generator=generator) < 0.3] = -1  # empty slots
        tiny = torch.zeros((heads, 1, 1))
        layers.append(LayerState(basis=tiny[0], coefficients=tiny, outliers=held[:, :0], keys=tiny, values=tiny,
                                 slot_ids=held.to(device), candidates=torch.zeros((heads, 1), dtype=torch.bool)))
    held = torch.full((len(ks), heads, slots), -2, dtype=torch.long)
    for b, layer in enumerate(layers):
        held[b, :, :ks[b]] = layer.slot_ids.cpu()
    scores = torch.rand((len(ks), heads, chunks), generator=generator)
    scores[torch.rand(scores.shape, generator=generator) < 0.5] = float("-inf")  # some heads: fewer than k
    top, valid = top_chunks(scores, slots)
    assert top.shape[-1] == picks
    k = torch.tensor(ks)
    valid &= (torch.arange(picks)[None, :] < k[:, None])[:, None, :]
    expected = match_slots(held, top, valid, torch.zeros((len(ks), chunks), dtype=torch.long), reuse)
    info = pointer_tables([layers], torch.zeros((len(ks), 3), dtype=torch.long))[0].to(device)
    counts = torch.zeros(2, dtype=torch.long, device=device)
    top_scores, top_ids = torch.topk(scores, picks, dim=-1)
    new_ids, filled = match_in_place(info, top_scores.to(device), top_ids.to(device), k.to(device), slots, reuse,
                                     counts, tile=tile)
    assert torch.equal(new_ids.cpu(), expected.new_ids) and torch.equal(filled.cpu(), expected.filled)
    for b, layer in enumerate(layers):  # written back into each sequence's own ids
        assert torch.equal(layer.slot_ids.cpu(), expected.new_ids[b, :, :ks[b]])
    assert counts.tolist() == expected.to_host.tolist()[:2] and counts[0] > 0 and (counts[1] > 0) == reuse


def test_every_tensor_the_pointer_table_addresses_is_16_byte_aligned():
    """The kernels tell the compiler that each pointer of the table is 16-byte aligned
    (`table_pointer`: vector loads); a tensor that is not (a view at an offset) is replaced by
    an aligned copy of the same values when its row is made, and the table points at it."""
    from kvforge.cache.shadowkv.pointer_table import ALIGNMENT_BYTES, FIELDS, sequence_info

    spec = CASES["masked"]
    _, states, _ = _build(spec["lengths"], spec["kv_heads"], spec["dim"], spec["ranks"], spec["ks"], torch.float32,
                          "cpu", triton=True)
    layer = states[0].layers[0]
    names = ("keys", "values", "basis", "coefficients", "candidates", "slot_ids")
    expected = {}
    for name in names:  # each tensor moved to one element past a 16-byte boundary
        t = getattr(layer, name)
        spare = torch.empty(t.numel() + ALIGNMENT_BYTES, dtype=t.dtype)
        start = next(i for i in range(1, ALIGNMENT_BYTES) if (spare.data_ptr() + i * t.element_size()) % 16)
        shifted = spare[start:start + t.numel()].view(t.shape)
        shifted.copy_(t)
        setattr(layer, name, shifted)
        assert shifted.data_ptr() % ALIGNMENT_BYTES
        expected[name] = t.clone()
    info = sequence_info([layer], torch.zeros((1, 3), dtype=torch.long), None)
    assert info.shape == (1, FIELDS)
    for column, name in enumerate(names):
        t = getattr(layer, name)
        assert t.data_ptr() % ALIGNMENT_BYTES == 0 and info[0, column].item() == t.data_ptr(), name
        assert torch.equal(t, expected[name]), name


def test_values_read_in_place_need_an_aligned_slow_layer():
    """The in-place value read takes the slow layer's host address as 16-byte aligned (vector
    reads over the bus); a layer that is not is refused, naming it, before any launch."""
    from kvforge.cache.shadowkv.pointer_table import ALIGNMENT_BYTES
    from kvforge.cache.shadowkv.triton_slots import read_values_in_place
    from kvforge.errors import ConfigError

    kv_heads, pages, chunk, dim = 2, 3, 8, 16
    spare = torch.empty(kv_heads * pages * chunk * dim + ALIGNMENT_BYTES, dtype=torch.float32)
    start = next(i for i in range(1, ALIGNMENT_BYTES) if (spare.data_ptr() + 4 * i) % ALIGNMENT_BYTES)
    slow = spare[start:start + kv_heads * pages * chunk * dim].view(kv_heads, pages, chunk, dim)
    assert slow.is_contiguous() and slow.data_ptr() % ALIGNMENT_BYTES
    ids = torch.zeros((1, kv_heads, 4), dtype=torch.long)
    with pytest.raises(ConfigError, match="slow.*16-byte boundary"):
        read_values_in_place(torch.zeros((1, 13), dtype=torch.long), torch.zeros(1), slow, ids,
                             torch.zeros_like(ids, dtype=torch.bool), torch.zeros((1, pages), dtype=torch.long))
