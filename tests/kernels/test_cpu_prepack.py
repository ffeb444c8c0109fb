"""oneDNN-packed linear weights (kvforge/kernels/cpu_prepack.py): used only while the weight is
unchanged and the call qualifies, equal to F.linear up to rounding, made under the policy's
memory rule, and made by the engine on a CPU for the weights its prefill multiplies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import across_kv_model, make_pair

from kvforge.cache.registry import create_cache
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError
from kvforge.kernels import cpu_linear, cpu_prepack
from kvforge.kernels.cpu_prepack import (
    AUTO_MEMORY_SHARE,
    available_memory_bytes,
    drop_packed,
    onednn_packs,
    packed_linear,
    prepack_available,
    prepack_weights,
)

pytestmark = pytest.mark.skipif(not prepack_available(), reason="this torch build has no oneDNN packed linear ops")

PLENTY = 1 << 40


def _weights(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(96, 64, generator=generator) * 0.1).to(dtype)
    bias = (torch.randn(96, generator=generator) * 0.1).to(dtype)
    return weight, bias


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(40, 64), (3, 50, 64)])
def test_a_packed_weight_gives_f_linear_up_to_rounding(dtype, tolerance, shape):
    weight, bias = _weights(dtype)
    x = torch.randn(*shape).to(dtype)
    report = prepack_weights([weight], "on", PLENTY)
    if not onednn_packs(dtype):  # bf16 on an AVX2-only CPU: nothing packed, F.linear runs
        assert report.weights == 0 and "can pack on this CPU" in report.skipped
        assert packed_linear(x, weight, bias) is None
        return
    assert report.weights == 1 and report.bytes == weight.numel() * weight.element_size()
    for b in (bias, None):
        out = packed_linear(x, weight, b)
        assert out is not None and out.dtype == dtype and out.shape == (*shape[:-1], 96)
        reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
        assert torch.allclose(out.double(), reference, atol=tolerance, rtol=tolerance)


def test_bf16_is_packed_only_where_the_cpu_has_onednn_bf16(monkeypatch):
    """An AVX2-only CPU (an AMD EPYC here) refuses oneDNN's bf16 reorder with a RuntimeError
    that took every bf16 prefill down: a bf16 weight is then left to F.linear, or packed
    widened to float32 when asked, while float32 weights pack as before. Simulated on any CPU
    by a oneDNN without bf16."""
    real = onednn_packs
    monkeypatch.setattr(cpu_prepack, "onednn_packs", lambda dtype: dtype != torch.bfloat16 and real(dtype))
    native, _ = _weights(torch.bfloat16)
    wide, _ = _weights(torch.bfloat16)
    full, _ = _weights(torch.float32)
    x = torch.randn(40, 64).bfloat16()
    report = prepack_weights([native, full], "on", PLENTY)
    assert report.weights == 1 and packed_linear(x, native, None) is None
    assert packed_linear(x.float(), full, None) is not None
    report = prepack_weights([wide], "auto", PLENTY, widen_bf16=True)
    assert report.widened == 1 and packed_linear(x, wide, None).dtype == torch.bfloat16
    too_small = int(wide.numel() * 2 / AUTO_MEMORY_SHARE) + 1  # holds a bf16 copy, not a float32 one
    drop_packed([wide])
    assert prepack_weights([wide], "auto", too_small, widen_bf16=True).weights == 0  # no bf16 copy to fall back on


def test_the_linear_helper_takes_the_packed_copy_for_prefill_rows_only(monkeypatch):
    weight, bias = _weights()
    prepack_weights([weight], "on", PLENTY)
    calls = []
    monkeypatch.setattr(cpu_linear, "packed_linear", lambda *a: calls.append(a[0].shape[0]) or packed_linear(*a))
    rows = cpu_linear.MAX_ROWS + 1
    with torch.no_grad():
        cpu_linear.linear(torch.randn(rows, 64), weight, bias)
        cpu_linear.linear(torch.randn(2, 64), weight, bias)
    assert calls == [rows] or (calls == [rows, 2] and not cpu_linear.small_m_linear_available())


def test_a_changed_weight_is_never_computed_from_its_stale_copy():
    weight, bias = _weights()
    x = torch.randn(40, 64)
    prepack_weights([weight], "on", PLENTY)
    with torch.no_grad():
        weight.mul_(2)  # in place: the version counter moves
    assert packed_linear(x, weight, bias) is None
    prepack_weights([weight], "on", PLENTY)
    assert torch.allclose(packed_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5)
    # `.data =` keeps the version counter: the storage tells
    weight.data = weight.data * 3
    assert packed_linear(x, weight, bias) is None


def test_an_unchanged_weight_keeps_the_copy_an_earlier_engine_made():
    weight, bias = _weights()
    prepack_weights([weight], "on", PLENTY)
    first = cpu_prepack._current_copy(weight)[0]
    report = prepack_weights([weight], "on", PLENTY)  # a second engine on the same model
    assert cpu_prepack._current_copy(weight)[0] is first and report.weights == 1 and report.reused == 1
    assert "1 of them an earlier engine's copies kept" in report.describe()
    with torch.no_grad():
        weight.add_(1)
    report = prepack_weights([weight], "on", PLENTY)
    assert cpu_prepack._current_copy(weight)[0] is not first and report.reused == 0  # changed since: packed anew
    assert "earlier engine" not in report.describe()
    x = torch.randn(40, 64)
    assert torch.allclose(packed_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5)


def test_calls_that_do_not_qualify_run_f_linear():
    weight, bias = _weights()
    prepack_weights([weight], "on", PLENTY)
    assert packed_linear(torch.randn(40, 64, dtype=torch.float64), weight, bias) is None
    assert packed_linear(torch.randn(40, 64), weight, bias.double()) is None
    assert packed_linear(torch.randn(40, 64, requires_grad=True), weight, bias) is None
    other, _ = _weights(seed=1)
    assert packed_linear(torch.randn(40, 64), other, bias) is None  # never packed
    parameter = torch.nn.Parameter(weight.clone())
    prepack_weights([parameter], "on", PLENTY)
    assert packed_linear(torch.randn(40, 64), parameter, None) is None  # autograd wants F.linear
    with torch.no_grad():
        assert packed_linear(torch.randn(40, 64), parameter, None) is not None


def test_off_drops_copies_and_a_tied_weight_is_packed_once():
    weight, _ = _weights()
    report = prepack_weights([weight, weight], "on", PLENTY)
    assert report.weights == 1
    off = prepack_weights([weight], "off", PLENTY)
    assert off.weights == 0 and "--prepack-weights off" in off.describe()
    assert packed_linear(torch.randn(40, 64), weight, None) is None


def test_auto_packs_only_within_its_share_of_the_available_memory():
    weight, _ = _weights()
    size = weight.numel() * weight.element_size()
    fits = int(size / AUTO_MEMORY_SHARE) + 1
    assert prepack_weights([weight], "auto", fits).weights == 1
    drop_packed([weight])
    refused = prepack_weights([weight], "auto", fits - 8)
    assert refused.weights == 0 and "25%" in refused.describe() and packed_linear(torch.randn(40, 64), weight, None) is None
    unknown = prepack_weights([weight], "auto", None)
    assert unknown.weights == 0 and "unknown" in unknown.skipped
    assert prepack_weights([weight], "on", 1).weights == 1  # "on" ignores the rule


def test_only_float32_and_bfloat16_cpu_weights_are_packed():
    assert prepack_weights([torch.randn(8, 8, dtype=torch.float64)], "on", PLENTY).weights == 0
    with torch.inference_mode():
        inference = torch.randn(8, 8)
    assert prepack_weights([inference], "on", PLENTY).weights == 0  # no version counter to check


def test_a_policy_outside_the_list_is_refused_by_name():
    with pytest.raises(ConfigError, match="prepack_weights"):
        prepack_weights([], "always", PLENTY)
    with pytest.raises(ConfigError, match="prepack_weights.*'auto', 'on', 'off'"):
        EngineConfig(prepack_weights="yes")


def test_available_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:  2048 kB\n")
    assert available_memory_bytes(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:  100 kB\n")
    assert available_memory_bytes(meminfo) is None
    assert available_memory_bytes(tmp_path / "absent") is None


def _engine(model, policy: str) -> LLMEngine:
    cache = create_cache("full:block_size=4", model.cache_layout(), 1 << 22, torch.float32)
    return LLMEngine(model, cache, None, EngineConfig(1 << 22, max_num_batched_tokens=128, prepack_weights=policy))


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
    return [finished[key] for key in sorted(finished, key=int)]


@torch.no_grad()  # the weights are parameters: with gradients on, F.linear runs (autograd)
def test_the_engine_packs_what_its_prefill_multiplies_and_a_cast_drops_it():
    model = make_pair("llama_gqa")[1]
    engine = _engine(model, "on")
    weights = model.prefill_linear_weights()
    assert engine.prepack_report.weights == len(weights) == 7 * model.config.num_layers
    assert all(packed_linear(torch.randn(40, w.shape[1]), w, None) is not None for w in weights)
    head = model.lm_head.weight
    assert packed_linear(torch.randn(40, head.shape[1]), head, None) is None  # logit rows only: not packed
    model.to(torch.bfloat16)
    assert all(packed_linear(torch.randn(40, w.shape[1], dtype=torch.bfloat16), w, None) is None for w in weights)
    # and the stale copies (with the float32 data they hold on to) are freed, not kept
    assert not any(hasattr(w, "_kvforge_onednn_packed") for w in weights)


def test_packed_and_plain_engines_pick_the_same_greedy_tokens():
    model = make_pair("llama_gqa")[1]
    prompts = [[(7 * i + 3) % 90 for i in range(70)], [(5 * i + 1) % 90 for i in range(45)]]
    plain = _greedy(_engine(model, "off"), prompts)
    packed = _greedy(_engine(model, "on"), prompts)
    assert packed == plain


@torch.no_grad()
def test_a_swiftkv_prefill_packs_its_earlier_layers_and_its_fused_kv_weight():
    model = across_kv_model()
    engine = _engine(model, "on")
    weights = model.prefill_linear_weights()
    fused = model.fused_kv_projection()[0]
    assert any(w is fused for w in weights)
    assert engine.prepack_report.weights == 7 * model.swiftkv.num_key_value_layers + 1
    assert packed_linear(torch.randn(40, fused.shape[1]), fused, None) is not None


@pytest.mark.parametrize("policy", ["off", "on"])
def test_bench_serve_starts_kvforge_servers_with_its_prepack_policy(policy):
    from kvforge.cache.registry import parse_cache_spec
    from kvforge.cli import build_full_parser
    from kvforge.tools.bench.serve import _serve_args
    from kvforge.tools.bench.systems import System

    args = build_full_parser().parse_args(["bench", "serve", "--prepack-weights", policy])
    argv = _serve_args(args, System("s", "kvforge", parse_cache_spec("full")))
    assert argv[argv.index("--prepack-weights") + 1] == policy
    served = build_full_parser().parse_args(["serve", *argv])
    assert served.prepack_weights == policy
