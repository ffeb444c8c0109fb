"""The compiled CPU paged decode attention against `decode_attention` (the PyTorch path it
replaces), and the `full` cache using it end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from decode_cases import make_case

from kvforge.cache.attention import decode_attention
from kvforge.cache.full import cpu_decode as cpu_paged_attention
from kvforge.cache.full.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kvforge.cache.full.fp8 import FP8_DTYPES, quantize_per_token
from kvforge.cache.registry import parse_cache_spec
from kvforge.errors import ConfigError

requires_kernel = pytest.mark.skipif(
    not cpu_kernels_available(),
    reason="the CPU paged attention kernel could not be built (see the logged warning) or "
           "KVFORGE_DISABLE_CPU_KERNELS is set")


def both(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, reference output); the reference reads small tiles to exercise its tiling."""
    return paged_decode_attention_cpu(**case), decode_attention(**case, tile_pages=2)


@requires_kernel
@pytest.mark.parametrize("dim", [64, 256])
# groups up to 4 take the group-fused tile path, larger ones the widening path
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (3, 3), (1, 4), (2, 4), (1, 5), (2, 8)])
@pytest.mark.parametrize("lengths", [[37], [1500], [0, 5, 64, 300], list(range(3, 100, 6))],
                         ids=["b1", "b1-long-split", "b4", "b17"])
def test_matches_reference_fp32(lengths, kv_heads, group, dim):
    out, ref = both(make_case(lengths, kv_heads, group, dim))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@requires_kernel
@pytest.mark.parametrize("width", [0, 3])
def test_empty_tables_see_only_the_own_token(width):
    case = make_case([0, 0, 0], kv_heads=1, group=4, dim=64, padding=width)
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # only the own token is visible: softmax over one key returns its value
    torch.testing.assert_close(out, case["v_self"].repeat_interleave(4, dim=1), atol=1e-6, rtol=0)


@requires_kernel
@pytest.mark.parametrize("window", [1, 5, 13, 64])
def test_sliding_window(window):
    case = make_case([3, 20, 41, 200, 777], kv_heads=2, group=3, dim=64, window=window)
    assert (case["first_page_position"] > 0).any() and (case["visible_from"] > case["first_page_position"]).any()
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@requires_kernel
def test_padding_entries_are_ignored():
    case = make_case([9, 30, 2], kv_heads=2, group=2, dim=64, padding=5)
    out = paged_decode_attention_cpu(**case)
    visible_pages = [-(-n // 4) for n in case["visible_to"].tolist()]
    table = case["page_table"].clone()
    for row, used in enumerate(visible_pages):
        table[row, used:] = (table[row, used:] + 1) % case["k_pages"].shape[1]
    torch.testing.assert_close(paged_decode_attention_cpu(**{**case, "page_table": table}), out, atol=0, rtol=0)


@requires_kernel
@pytest.mark.parametrize("storage", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 256])
@pytest.mark.parametrize("group", [3, 6])
def test_low_precision_storage(storage, dim, group):
    # Both paths widen the same stored values to float32, so only summation order differs.
    out, ref = both(make_case([1, 17, 90, 400], kv_heads=3, group=group, dim=dim, storage=storage))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@requires_kernel
@pytest.mark.parametrize("storage", sorted(FP8_DTYPES))
@pytest.mark.parametrize("dim", [64, 256, 40])
def test_float8_storage_with_row_scales(storage, dim):
    """float8 codes with a scale per row (fp8.py): the kernel widens them in registers, the
    PyTorch path dequantises tiles; a head dim off the vector width takes the portable path."""
    case = make_case([1, 17, 90, 400], kv_heads=3, group=3, dim=dim, window=None)
    for side in ("k", "v"):
        codes, scales = quantize_per_token(case[f"{side}_pages"], FP8_DTYPES[storage])
        case[f"{side}_pages"], case[f"{side}_scales"] = codes, scales
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the scales are read: without them the rows would be the codes alone
    unscaled = decode_attention(**{**case, "k_scales": None, "v_scales": None}, tile_pages=2)
    assert (unscaled - ref).abs().max() > 1e-2


@requires_kernel
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16])
def test_low_precision_queries(compute):
    """The widening float path (bf16 over bf16 pages also has a dot path, tested in
    test_full_cpu_decode_bf16_dot.py; switched off here)."""
    case = make_case([5, 60, 129], kv_heads=2, group=2, dim=64, storage=compute)
    for key in ("q", "k_self", "v_self"):
        case[key] = case[key].to(compute)
    with cpu_paged_attention.bf16_dot(False):
        out, ref = both(case)
    assert out.dtype == compute
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)  # 16-bit output rounding
    # 16-bit q/k_self/v_self are widened exactly inside the op and the float32 result is
    # rounded once: bitwise the float32 call on the same values, then cast
    widened = {**case, **{key: case[key].float() for key in ("q", "k_self", "v_self")}}
    assert torch.equal(out, paged_decode_attention_cpu(**widened).to(compute))


@requires_kernel
def test_strided_storage_views():
    case = make_case([7, 33, 64], kv_heads=2, group=3, dim=64)
    # pages interleaved with unrelated ones: strides differ from a contiguous layout
    for key in ("k_pages", "v_pages"):
        wide = torch.randn(2, case[key].shape[1] * 2, 4, 64)
        wide[:, ::2] = case[key]
        case[key] = wide[:, ::2]
        assert not case[key].is_contiguous()
    out, ref = both(case)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    # no unit stride along head_dim: handled by a copy in the wrapper
    case["k_pages"] = case["k_pages"].transpose(-1, -2).contiguous().transpose(-1, -2)
    torch.testing.assert_close(paged_decode_attention_cpu(**case), ref, atol=1e-5, rtol=0)


@requires_kernel
@pytest.mark.parametrize("dim", [20, 40])
def test_other_head_dims_use_the_portable_paths(dim):
    out, ref = both(make_case([3, 50, 260], kv_heads=1, group=2, dim=dim))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@requires_kernel
def test_bad_inputs_raise():
    case = make_case([9, 10], kv_heads=1, group=2, dim=64)
    bad = case["page_table"].clone()
    bad[0, 0] = 10_000
    with pytest.raises(RuntimeError, match="page id"):
        paged_decode_attention_cpu(**{**case, "page_table": bad})
    with pytest.raises(ValueError, match="CPU tensors only"):
        paged_decode_attention_cpu(**{**case, "q": case["q"].to("meta")})


@requires_kernel
def test_disable_env_forces_fallback(monkeypatch):
    monkeypatch.setenv(cpu_paged_attention.DISABLE_ENV, "1")
    assert not cpu_kernels_available()
    with pytest.raises(RuntimeError, match="not available"):
        paged_decode_attention_cpu(**make_case([3], kv_heads=1, group=1, dim=64))


def test_decode_kernel_option_validated():
    assert parse_cache_spec("full:decode_kernel=torch").config().decode_kernel == "torch"
    with pytest.raises(ConfigError, match="decode_kernel.*must be one of"):
        parse_cache_spec("full:decode_kernel=cuda")


@requires_kernel
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window", "gemma3_hybrid"])
def test_model_decode_same_logits_with_and_without_kernel(name, monkeypatch):
    _, model = make_pair(name)
    # The eager layer's path (the fused decoder-layer op calls the kernel from C++ instead;
    # tests/kernels/test_cpu_decode_layer.py holds the two together).
    monkeypatch.setattr("kvforge.kernels.cpu_decode_layer._enabled", False)
    calls = []
    original = cpu_paged_attention.paged_decode_attention_cpu
    monkeypatch.setattr("kvforge.cache.full.method.paged_decode_attention_cpu",
                        lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    prompts = [list(range(3, 30)), [7, 8], list(range(40, 52))]
    logits = {}
    for kernel in ("auto", "torch"):
        runner = make_runner(model, cache=f"full:block_size=4,decode_kernel={kernel}")
        logits[kernel] = decode_logits(runner, prompts, steps=16)
    assert calls, "the kernel was not used by decode_kernel=auto"
    torch.testing.assert_close(logits["auto"], logits["torch"], atol=1e-5, rtol=0)


def test_build_failure_is_a_warning_and_a_fallback(tmp_path):
    # A fresh build directory and a compiler that always fails: no exception, one warning.
    script = ("from kvforge.cache.full.cpu_decode import cpu_kernels_available as ok; "
              "print(ok(), ok())")
    env = {"PATH": "/usr/bin:/bin", "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]
    assert done.stderr.count("kvforge CPU kernels disabled") == 1
