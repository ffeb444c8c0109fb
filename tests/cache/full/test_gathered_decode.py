"""`gathered_decode_attention` (one gather + SDPA, the `full` cache's decode path on GPUs)
against the tiled `decode_attention`, and the cache choosing it. On the CPU both run in
plain PyTorch, so the GPU path's arithmetic is checked here without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from decode_cases import make_case

from kvforge.cache.attention import decode_attention, gathered_decode_attention, hidden_slots
from kvforge.cache.full.decode_kernels import resolve_decode_kernel
from kvforge.cache.full.fp8 import FP8_DTYPES, quantize_per_token
from kvforge.cache.full.plan import DecodePlan, plan_decode
from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError


def both(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return gathered_decode_attention(**case), decode_attention(**case, tile_pages=2)


@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 4), (2, 8)])
@pytest.mark.parametrize("lengths", [[37], [0, 5, 64, 300], list(range(3, 100, 6))], ids=["b1", "b4", "b17"])
def test_matches_the_tiled_path(lengths, kv_heads, group):
    out, ref = both(make_case(lengths, kv_heads, group, dim=64))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 64])
def test_sliding_window(window):
    case = make_case([3, 20, 41, 200, 777], kv_heads=2, group=3, dim=64, window=window)
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_an_empty_table_sees_only_the_own_token():
    case = make_case([0, 0], kv_heads=1, group=4, dim=32, padding=3)
    out, _ = both(case)
    torch.testing.assert_close(out, case["v_self"].repeat_interleave(4, dim=1), atol=1e-6, rtol=0)


def test_hidden_slots_holding_nan_do_not_leak():
    """Storage comes from torch.empty: slots outside the visible range (padding pages, the
    tail of the last page, pages before a window) may hold NaN bits."""
    case = make_case([9, 30, 2], kv_heads=2, group=2, dim=16, window=7, padding=3)
    visible_to, visible_from = case["visible_to"].tolist(), case["visible_from"].tolist()
    first = case["first_page_position"].tolist()
    block = case["k_pages"].shape[2]
    seen = set()  # (page, slot) visible to some row (padding ids may name another row's page)
    for row, page_ids in enumerate(case["page_table"].tolist()):
        for index, page in enumerate(page_ids):
            for slot in range(block):
                if visible_from[row] <= first[row] + index * block + slot < visible_to[row]:
                    seen.add((page, slot))
    poisoned = {key: case[key].clone() for key in ("k_pages", "v_pages")}
    hidden = [(p, s) for p in range(case["k_pages"].shape[1]) for s in range(block) if (p, s) not in seen]
    for page, slot in hidden:
        for store in poisoned.values():
            store[:, page, slot] = float("nan")
    assert len(hidden) > 10
    clean, _ = both(case)
    dirty = gathered_decode_attention(**{**case, **poisoned})
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=1e-6, rtol=0)


@pytest.mark.parametrize("storage", sorted(FP8_DTYPES))
def test_float8_storage_with_row_scales(storage):
    case = make_case([1, 17, 90], kv_heads=3, group=3, dim=64)
    for side in ("k", "v"):
        case[f"{side}_pages"], case[f"{side}_scales"] = quantize_per_token(case[f"{side}_pages"],
                                                                            FP8_DTYPES[storage])
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    unscaled = gathered_decode_attention(**{**case, "k_scales": None, "v_scales": None})
    assert (unscaled - ref).abs().max() > 1e-2  # the scales are read


def test_low_precision_queries_return_their_dtype():
    case = make_case([5, 60, 129], kv_heads=2, group=2, dim=64, storage=torch.bfloat16)
    for key in ("q", "k_self", "v_self"):
        case[key] = case[key].to(torch.bfloat16)
    out, ref = both(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_option_values():
    assert parse_cache_spec("full:decode_kernel=gather").config().decode_kernel == "gather"


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window", "gemma3_hybrid"])
def test_model_decode_same_logits_through_the_gathered_path(name, monkeypatch):
    from kvforge.cache.full import method, plan

    _, model = make_pair(name)
    calls, masks = [], []
    monkeypatch.setattr(method, "gathered_decode_attention",
                        lambda *args, **kwargs: calls.append(1) or gathered_decode_attention(*args, **kwargs))
    monkeypatch.setattr(plan, "hidden_slots", lambda *args: masks.append(1) or hidden_slots(*args))
    prompts = [list(range(3, 30)), [7, 8], list(range(40, 52))]
    logits = {kernel: decode_logits(make_runner(model, cache=f"full:block_size=4,decode_kernel={kernel}"),
                                    prompts, steps=12) for kernel in ("gather", "torch")}
    assert calls, "decode_kernel=gather did not use gathered_decode_attention"
    torch.testing.assert_close(logits["gather"], logits["torch"], atol=1e-5, rtol=0)
    if name == "llama_gqa":  # one layer group: its plan's mask is made once per step, not per layer
        assert len(calls) == len(masks) * len(model.model.layers)


def _choices(monkeypatch, spec: str, tables: list[int], device: str = "meta", q_dtype=torch.float32) -> list[str]:
    """Which path `FullCache._decode_attention` takes for tables of these page counts (the
    meta device stands in for CUDA: the choice reads shapes and q.device only)."""
    from kvforge.cache.full import method

    chosen: list[str] = []
    monkeypatch.setattr(method, "gathered_decode_attention", lambda *a, **k: chosen.append("gather"))
    monkeypatch.setattr(method, "decode_attention", lambda *a, **k: chosen.append("tiled"))
    monkeypatch.setattr(method, "paged_decode_attention_cpu", lambda *a, **k: chosen.append("cpu"))
    full = object.__new__(method.FullCache)
    full.config = parse_cache_spec(spec).config()
    full.block_size = full.config.block_size
    full.decode_kernel = resolve_decode_kernel(full.config.decode_kernel, torch.device(device), fp8_pages=False)
    width, batch = max(tables), len(tables)
    plan = DecodePlan(
        seq_ids=tuple(range(batch)), rows=torch.arange(batch), page_table=torch.zeros(batch, width, dtype=torch.long),
        first_page_position=torch.zeros(batch, dtype=torch.long), visible_from=torch.zeros(batch, dtype=torch.long),
        visible_to=torch.tensor(tables) * full.block_size, every_row=True,
        compact_tables=width * batch <= 2 * sum(tables) + batch, slots=width * full.block_size)
    q = torch.empty(batch, 6, 64, device=device, dtype=q_dtype)
    pages = torch.empty(3, 64, full.block_size, 64, device=device, dtype=q_dtype)
    full._decode_attention(plan, q, q[:, :3], q[:, :3], pages, pages, None, None, 1.0)
    return chosen


def test_auto_chooses_the_gathered_path_off_the_cpu(monkeypatch):
    assert _choices(monkeypatch, "full", [4, 5, 6]) == ["gather"]
    assert _choices(monkeypatch, "full", [4, 5, 6], device="cpu")[0] in ("cpu", "tiled")


def test_auto_keeps_the_tiled_path_for_padded_or_large_gathers(monkeypatch):
    # one long sequence among short ones: the padded gather would be ~8x the real rows
    assert _choices(monkeypatch, "full", [64, 1, 1, 1, 1, 1, 1, 1]) == ["tiled"]
    # rows x kv heads x dim x 4 bytes = 3 x 3 x 16 x 16 x 64 x 4 = 589,824 bytes
    assert _choices(monkeypatch, "full:decode_gather_max_bytes=589824", [16, 16, 16]) == ["gather"]
    assert _choices(monkeypatch, "full:decode_gather_max_bytes=589823", [16, 16, 16]) == ["tiled"]
    # forced: the limits do not apply
    assert _choices(monkeypatch, "full:decode_kernel=gather,decode_gather_max_bytes=0", [64, 1]) == ["gather"]


@pytest.mark.parametrize("lengths,compact", [([40, 36, 30], True), ([256, 4, 4, 4, 4], False)])
def test_the_plan_marks_padded_tables(lengths, compact):
    """`plan_decode` decides compact_tables from the real page lists, on the host."""
    from types import SimpleNamespace

    from kvforge.batch import SequenceSpan

    pages = SimpleNamespace(block_size=4, first_kept_token=lambda group, n: 0,
                            require_slots=lambda seq, group, start, end: list(range(-(-end // 4))))
    spans = [SequenceSpan(seq_id=i, query_start=i, query_len=1, cached_len=n) for i, n in enumerate(lengths)]
    assert plan_decode(pages, 0, spans, every_row=True).compact_tables is compact
    with pytest.raises(ConfigError, match="decode_gather_max_bytes"):
        parse_cache_spec("full:decode_gather_max_bytes=-1").config()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu/run_on_device.sh tests)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_matches_the_cpu_tiled_path(dtype, window, fp8):
    case = make_case([1, 17, 90, 700], kv_heads=3, group=3, dim=64, window=window, storage=dtype)
    for key in ("q", "k_self", "v_self"):
        case[key] = case[key].to(dtype)
    if fp8:
        for side in ("k", "v"):
            case[f"{side}_pages"], case[f"{side}_scales"] = quantize_per_token(case[f"{side}_pages"].float(),
                                                                                FP8_DTYPES["float8_e4m3fn"])
    ref = decode_attention(**case, tile_pages=2)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = gathered_decode_attention(**on_gpu).cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)
