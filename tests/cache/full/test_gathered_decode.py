"""`gathered_decode_attention` (one gather + SDPA, the `full` cache's decode path on GPUs)
against the tiled `decode_attention`, and the cache choosing it. On the CPU both run in
plain PyTorch, so the GPU path's arithmetic is checked here without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from decode_cases import make_case

from kvforge.cache.attention import decode_attention, gathered_decode_attention
from kvforge.cache.full.fp8 import FP8_DTYPES, quantize_per_token
from kvforge.cache.registry import parse_cache_spec


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
    _, model = make_pair(name)
    monkeypatch.setattr("kvforge.kernels.cpu_decode_layer._enabled", False)
    calls = []
    monkeypatch.setattr("kvforge.cache.full.method.gathered_decode_attention",
                        lambda *args, **kwargs: calls.append(1) or gathered_decode_attention(*args, **kwargs))
    prompts = [list(range(3, 30)), [7, 8], list(range(40, 52))]
    logits = {kernel: decode_logits(make_runner(model, cache=f"full:block_size=4,decode_kernel={kernel}"),
                                    prompts, steps=12) for kernel in ("gather", "torch")}
    assert calls, "decode_kernel=gather did not use gathered_decode_attention"
    torch.testing.assert_close(logits["gather"], logits["torch"], atol=1e-5, rtol=0)


def test_auto_chooses_the_gathered_path_off_the_cpu(monkeypatch):
    """decode_kernel=auto on a non-CPU device: the meta device stands in for CUDA (the
    choice reads q.device only)."""
    from kvforge.cache.full import method

    cache = parse_cache_spec("full:block_size=4").config()
    assert cache.decode_kernel == "auto"
    chosen = []
    monkeypatch.setattr(method, "gathered_decode_attention", lambda *a, **k: chosen.append("gather"))
    monkeypatch.setattr(method, "decode_attention", lambda *a, **k: chosen.append("tiled"))
    monkeypatch.setattr(method, "paged_decode_attention_cpu", lambda *a, **k: chosen.append("cpu"))
    full = object.__new__(method.FullCache)
    full.config = cache
    full.block_size = 4
    plan = method._DecodePlan(seq_ids=(0,), rows=torch.zeros(1, dtype=torch.long),
                              page_table=torch.zeros(1, 1, dtype=torch.long),
                              first_page_position=torch.zeros(1, dtype=torch.long),
                              visible_from=torch.zeros(1, dtype=torch.long),
                              visible_to=torch.zeros(1, dtype=torch.long), every_row=True)
    for device in ("meta", "cpu"):
        q = torch.empty(1, 2, 8, device=device)
        full._decode_attention(plan, q, q[:, :1], q[:, :1], q, q, None, None, 1.0)
    assert chosen[0] == "gather" and chosen[1] in ("cpu", "tiled")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu/run_on_device.sh tests)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_the_cpu_tiled_path(dtype):
    case = make_case([1, 17, 90, 700], kv_heads=3, group=3, dim=64, window=None, storage=dtype)
    for key in ("q", "k_self", "v_self"):
        case[key] = case[key].to(dtype)
    ref = decode_attention(**case, tile_pages=2)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = gathered_decode_attention(**on_gpu).cpu()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)
