"""`kivi:decode_kernel=`: what each value resolves to on each device, the ConfigErrors of
kernels that cannot run, which kernel a model's decode steps actually call, and the Triton
kernel (on CUDA, or in Triton's CPU interpreter that tests/conftest.py turns on) giving the
PyTorch path's logits through the model runner."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import decode_logits, make_pair
from kivi_helpers import triton_test_device

from kvforge.cache.kivi import decode_kernels, triton_decode
from kvforge.cache.kivi.cpu_decode import cpu_kivi_kernel_available
from kvforge.cache.kivi.decode_kernels import resolve_decode_kernel
from kvforge.cache.layout import CacheLayerSpec, CacheLayout
from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.engine.runner import ModelRunner
from kvforge.errors import ConfigError

# G = 8 and R = 16 on tiny models: prompts of 37, 7 and 14 tokens then a few decode steps
# see quantised key pages and values (nk, nv > 0) beside residual tokens, a key flush during
# decode (14 -> 18 crosses R) and, on Gemma3's sliding layers (window 10), released pages.
SPEC = "kivi:bits=2,group=8,residual=16"
PROMPTS = [list(range(3, 40)), list(range(5, 12)), list(range(50, 64))]
STEPS = 5
LAYOUT = CacheLayout.one_per_layer([CacheLayerSpec(2, 32, 32 ** -0.5)])  # head_dim takes G = 32


def test_decode_kernel_option_validated() -> None:
    for kernel in ("auto", "triton", "torch", "cpp"):
        assert parse_cache_spec(f"kivi:decode_kernel={kernel}").config().decode_kernel == kernel
    with pytest.raises(ConfigError, match="decode_kernel.*must be one of"):
        parse_cache_spec("kivi:decode_kernel=cuda")


@pytest.mark.parametrize(("device", "installed", "expected"), [
    ("cpu", True, "cpp"), ("cuda", True, "triton"), ("cuda", False, "torch"), ("meta", True, "torch"),
])
def test_auto_resolution(monkeypatch, device: str, installed: bool, expected: str) -> None:
    monkeypatch.setattr(triton_decode, "triton_available", lambda: installed)
    assert resolve_decode_kernel("auto", torch.device(device)) == expected


@pytest.mark.parametrize("kernel", ["torch", "triton", "cpp"])
def test_forced_kernels_resolve_to_themselves(monkeypatch, kernel: str) -> None:
    monkeypatch.setattr(triton_decode, "triton_available", lambda: True)
    monkeypatch.setattr(triton_decode, "triton_interpreted", lambda: False)
    device = {"torch": "meta", "triton": "cuda", "cpp": "cpu"}[kernel]
    if kernel == "cpp" and not cpu_kivi_kernel_available():
        pytest.skip("the CPU KIVI kernel did not build (see the warning)")
    assert resolve_decode_kernel(kernel, torch.device(device)) == kernel


def test_forced_triton_without_the_package_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setattr(triton_decode, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match=r"decode_kernel.*triton.*not installed: pip install 'kvforge\[triton\]'"):
        create_cache("kivi:decode_kernel=triton", LAYOUT, 1 << 20, torch.float32)


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch) -> None:
    monkeypatch.setattr(triton_decode, "triton_available", lambda: True)
    monkeypatch.setattr(triton_decode, "triton_interpreted", lambda: False)
    with pytest.raises(ConfigError, match="decode_kernel.*runs on CUDA; on CPU only in Triton's interpreter.*"
                                          "TRITON_INTERPRET=1"):
        create_cache("kivi:decode_kernel=triton", LAYOUT, 1 << 20, torch.float32)
    monkeypatch.setattr(triton_decode, "triton_interpreted", lambda: True)
    assert create_cache("kivi:decode_kernel=triton", LAYOUT, 1 << 20, torch.float32).decode_kernel == "triton"
    with pytest.raises(ConfigError, match="decode_kernel.*not meta"):
        resolve_decode_kernel("triton", torch.device("meta"))


def test_forced_cpp_needs_a_cpu_and_the_built_kernel(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="decode_kernel.*CPU kernel; the cache is on cuda"):
        resolve_decode_kernel("cpp", torch.device("cuda"))
    monkeypatch.setenv("KVFORGE_DISABLE_CPU_KERNELS", "1")
    with pytest.raises(ConfigError, match="decode_kernel.*did not build or is disabled"):
        create_cache("kivi:decode_kernel=cpp", LAYOUT, 1 << 20, torch.float32)


def runner_for(model: torch.nn.Module, kernel: str, device: str) -> ModelRunner:
    cache = create_cache(f"{SPEC},decode_kernel={kernel}", model.cache_layout(), 1 << 22, torch.float32, device)
    return ModelRunner(model, cache)


def spy_on_kernels(monkeypatch) -> dict[str, list[dict]]:
    """Replace the three decode functions with wrappers that record their bound arguments
    and call the original: the record says which kernel each attend used."""
    calls: dict[str, list[dict]] = {"torch": [], "cpp": [], "triton": []}
    for name, module, attribute in (("torch", decode_kernels, "kivi_decode_attention"),
                                    ("cpp", decode_kernels, "kivi_decode_attention_cpu"),
                                    ("triton", triton_decode, "kivi_decode_attention_triton")):
        original = getattr(module, attribute)

        def spy(*args, original=original, record=calls[name], **kwargs):
            record.append(inspect.signature(original).bind(*args, **kwargs).arguments)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, attribute, spy)
    return calls


@pytest.mark.parametrize(("kernel", "expected"), [("auto", "cpp"), ("cpp", "cpp"), ("torch", "torch"),
                                                  ("triton", "triton")])
def test_cpu_decode_steps_call_the_chosen_kernel(monkeypatch, kernel: str, expected: str) -> None:
    """Every layer of every decode step goes to the resolved kernel and to no other."""
    if expected == "cpp" and not cpu_kivi_kernel_available():
        pytest.skip("the CPU KIVI kernel did not build (see the warning)")
    if expected == "triton" and triton_test_device() != "cpu":
        pytest.skip("on a CUDA machine the model runs on CUDA in test_triton_decode_matches_torch_path")
    # The fused decoder layer calls the C++ kernel from C++ (tests/kernels/test_cpu_decode_layer.py):
    # off here, so every call passes through the Python entry points spied on.
    monkeypatch.setattr("kvforge.kernels.cpu_decode_layer._enabled", False)
    _, model = make_pair("llama_gqa")
    calls = spy_on_kernels(monkeypatch)
    decode_logits(runner_for(model, kernel, "cpu"), PROMPTS[:2], steps=2)
    layers = model.cache_layout().num_cache_layers
    assert {name: len(record) for name, record in calls.items()} == \
        {name: 2 * layers if name == expected else 0 for name in calls}


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3_hybrid"])
def test_triton_decode_matches_torch_path(monkeypatch, name: str) -> None:
    """The model runner with decode_kernel=triton gives the logits (1e-5, float32) and greedy
    tokens of decode_kernel=torch, every decode attention going through the Triton kernel,
    on GQA models with quantised pages, residual tokens and (Gemma3) sliding-window layers."""
    device = triton_test_device()
    _, model = make_pair(name)
    model.to(device)
    calls = spy_on_kernels(monkeypatch)
    torch_logits = decode_logits(runner_for(model, "torch", device), PROMPTS, STEPS)
    assert not calls["triton"]
    triton_logits = decode_logits(runner_for(model, "triton", device), PROMPTS, STEPS)
    layers = model.cache_layout().num_cache_layers
    assert len(calls["triton"]) == STEPS * layers and len(calls["torch"]) == STEPS * layers
    torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(triton_logits.argmax(-1), torch_logits.argmax(-1))
    # The cases the comparison is meant to cover did occur.
    seen = calls["triton"]
    assert all(c["q"].shape[1] > c["k_self"].shape[1] for c in seen)  # GQA
    assert any(bool(((c["nk"] > 0) & (c["nv"] > 0) & (c["nk"] < c["n"])).any()) for c in seen)
    assert {int(c["nk"][2]) for c in seen} == {0, 16}  # the third prompt's keys flush during decode
    if name == "gemma3_hybrid":
        assert any(bool((c["visible_from"] > 0).any()) for c in seen)


def test_triton_decode_reads_keys_and_values_of_different_widths(monkeypatch) -> None:
    """4-bit keys and 2-bit values (the quality2 preset's widths): auto takes the Triton
    kernel on CUDA, and it gives the torch path's logits and greedy tokens."""
    monkeypatch.setattr(triton_decode, "triton_available", lambda: True)
    config = parse_cache_spec(f"{SPEC},key_bits=4,value_bits=2").config()
    assert resolve_decode_kernel("auto", torch.device("cuda"), config) == "triton"
    device = triton_test_device()
    _, model = make_pair("llama_gqa")
    model.to(device)
    calls = spy_on_kernels(monkeypatch)

    def runner(kernel: str) -> ModelRunner:
        return ModelRunner(model, create_cache(f"{SPEC},key_bits=4,value_bits=2,decode_kernel={kernel}",
                                               model.cache_layout(), 1 << 22, torch.float32, device))

    torch_logits = decode_logits(runner("torch"), PROMPTS, STEPS)
    triton_logits = decode_logits(runner("triton"), PROMPTS, STEPS)
    assert calls["triton"] and {(c["bits"], c["value_bits"]) for c in calls["triton"]} == {(4, 2)}
    torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(triton_logits.argmax(-1), torch_logits.argmax(-1))


@pytest.mark.parametrize(("options", "expected"), [
    ("key_space=pre_rope", "cpp"), ("key_space=pre_rope,sinks=4,key_bits=4,value_bits=2", "cpp"),
    ("key_space=pre_rope,rotation=hadamard_values", "cpp"),
    ("key_space=pre_rope,rotation=hadamard", "torch"), ("key_space=pre_rope,rotation=hadamard_keys", "torch"),
])
def test_auto_takes_the_cpu_kernel_for_pre_rope_keys_unless_they_are_rotated(options: str, expected: str) -> None:
    """The C++ kernel RoPEs pre-RoPE keys itself; keys stored rotated must be unrotated
    first, which only the PyTorch path does."""
    if expected == "cpp" and not cpu_kivi_kernel_available():
        pytest.skip("the CPU KIVI kernel did not build (see the warning)")
    config = parse_cache_spec(f"kivi:{options}").config()
    assert resolve_decode_kernel("auto", torch.device("cpu"), config) == expected
