"""Packed projections (models/packed_projections.py): q/k/v and gate/up as one GEMM each,
with the parameters re-pointed at slices of the packed tensors. Packing must keep the
state dict and the logits, add no memory, follow in-place updates, and step aside (to
the separate GEMMs, never a stale copy) when a part gets new storage or autograd needs
the parts themselves."""

from __future__ import annotations

import pytest
import torch
from conftest import decode_logits, make_pair, make_runner
from torch import nn

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner
from kvforge.errors import ConfigError
from kvforge.kernels.build import DISABLE_ENV
from kvforge.models.dense import dense_logits
from kvforge.models.layers import CachedAttention, GatedMLP, pack_projections
from kvforge.models.packed_projections import (
    PACKED_PROJECTIONS_ENV,
    PackedLinear,
    pack_linears,
    packs_projections,
)

PROMPTS = [list(range(3, 20)), [7, 8, 9]]


@pytest.fixture(autouse=True)
def eager_layers(monkeypatch) -> None:
    """Every step through the layers' own forwards: the compiled CPU decode layer (which
    reads each projection's weight, packed or not) would take the decode steps."""
    monkeypatch.setenv(DISABLE_ENV, "1")


def logits(model, spec: str = "full:block_size=4") -> torch.Tensor:
    """Prefill and 3 decode steps of PROMPTS, on the model's device."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return decode_logits(make_runner(model, spec), PROMPTS, steps=3)
    cache = create_cache(spec, model.cache_layout(), 1 << 22, torch.float32, device)
    return decode_logits(ModelRunner(model, cache), PROMPTS, steps=3).cpu()


def packs_used(monkeypatch) -> list[int]:
    """Counts the packed GEMMs the layers run (one per `PackedLinear.split`)."""
    used: list[int] = []
    split = PackedLinear.split
    monkeypatch.setattr(PackedLinear, "split", lambda self, out: used.append(1) or split(self, out))
    return used


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "gemma3_hybrid"])
@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_packing_keeps_the_state_dict_and_the_logits_and_adds_no_memory(name, cpu_kernels, monkeypatch):
    if cpu_kernels:  # the C++ RoPE and SiLU-gate on the packed slices; decode steps in the compiled layer
        monkeypatch.delenv(DISABLE_ENV)
    model = make_pair(name)[1]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expected = logits(model)
    layers = len(model.model.layers)
    qk_norm = name == "gemma3_hybrid"  # QK-norm attention keeps its three GEMMs
    assert pack_projections(model) == layers * (1 if qk_norm else 2)
    assert pack_projections(model) == 0  # still packed: nothing to do
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for module in model.modules():
        if isinstance(module, GatedMLP) or (isinstance(module, CachedAttention) and not qk_norm):
            packed = module.packed_gate_up if isinstance(module, GatedMLP) else module.packed_qkv
            # the parts are views of the packed tensors: one storage, no copy kept
            for part in packed.parts:
                assert part.weight.untyped_storage().data_ptr() == packed.weight.untyped_storage().data_ptr()
                if part.bias is not None:
                    assert part.bias.untyped_storage().data_ptr() == packed.bias.untyped_storage().data_ptr()
            assert (packed.bias is not None) == (name == "qwen2_bias" and isinstance(module, CachedAttention))
    used = packs_used(monkeypatch)
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    steps = 1 if cpu_kernels and not qk_norm else 4  # the compiled decode layer reads the parts' views
    assert len(used) == steps * (1 if qk_norm else 2) * layers  # every eager step and layer: the packed GEMMs


def test_an_in_place_update_of_a_part_is_an_update_of_the_pack(monkeypatch):
    model, fresh = make_pair("llama_gqa")[1], make_pair("llama_gqa", seed=1)[1]
    pack_projections(model)
    model.load_state_dict(fresh.state_dict())  # copies into the parameters, in place
    used = packs_used(monkeypatch)
    torch.testing.assert_close(logits(model), logits(fresh), rtol=1e-5, atol=1e-5)
    assert used


def test_a_part_with_new_storage_is_used_as_it_is_never_a_stale_pack(monkeypatch):
    model = make_pair("llama_gqa")[1]
    pack_projections(model)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[2].mlp
    first = model.model.layers[0].self_attn
    with torch.no_grad():
        attention.v_proj.weight = nn.Parameter(attention.v_proj.weight * 3)  # a new Parameter
        mlp.up_proj.weight = nn.Parameter(mlp.up_proj.weight.clone())
        mlp.up_proj.weight[:4] = 0
        first.k_proj.weight.data = first.k_proj.weight.data * 2  # the same Parameter, new data
    assert not attention.packed_qkv.usable() and not mlp.packed_gate_up.usable() and not first.packed_qkv.usable()
    expected = make_pair("llama_gqa")[1]
    expected.load_state_dict(model.state_dict())
    used = packs_used(monkeypatch)
    torch.testing.assert_close(logits(model), logits(expected), rtol=1e-5, atol=1e-5)
    assert len(used) == 4 * (2 * 3 - 3)  # the three changed layers run their parts separately
    assert pack_projections(model) == 3  # and packing again packs them


def test_a_move_or_cast_drops_the_pack_and_the_model_runs_on():
    model = make_pair("llama_gqa")[1]
    expected = logits(model)
    pack_projections(model)
    model.double()
    assert all(m.packed_qkv is None for m in model.modules() if isinstance(m, CachedAttention))
    assert all(m.packed_gate_up is None for m in model.modules() if isinstance(m, GatedMLP))
    model.float()
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)
    model.float()  # a no-op conversion leaves a fresh pack in place
    pack_projections(model)
    model.float()
    assert all(m.packed_gate_up is not None for m in model.modules() if isinstance(m, GatedMLP))


def test_training_goes_through_the_parts_so_their_gradients_flow(monkeypatch):
    model = make_pair("llama_gqa")[1]
    pack_projections(model)
    used = packs_used(monkeypatch)
    expected = dense_logits(make_pair("llama_gqa")[1], torch.tensor([[3, 4, 5, 6, 7]]))
    out = dense_logits(model, torch.tensor([[3, 4, 5, 6, 7]]))
    torch.testing.assert_close(out, expected)
    out.float().square().mean().backward()
    layer = model.model.layers[0]
    for part in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.mlp.gate_proj,
                 layer.mlp.up_proj):
        assert part.weight.grad is not None and part.weight.grad.abs().sum() > 0
    assert used == []


def test_parts_that_cannot_share_a_gemm_are_not_packed():
    a, b = nn.Linear(8, 4), nn.Linear(8, 6, bias=False)
    assert pack_linears((a, b)) is None
    assert pack_linears((a, nn.Linear(9, 4))) is None
    assert pack_linears((a, nn.Linear(8, 4, dtype=torch.float64))) is None
    weights = (a.weight, b.weight)
    assert pack_linears((a, nn.Linear(8, 4))) is not None and b.weight is weights[1]


@pytest.mark.parametrize("setting,device,packs", [("", "cuda", True), ("", "cpu", False), ("0", "cuda", False),
                                                  ("1", "cpu", True), (" 1 ", "cpu", True)])
def test_the_engine_packs_on_cuda_unless_told(setting, device, packs, monkeypatch):
    monkeypatch.setenv(PACKED_PROJECTIONS_ENV, setting)
    assert packs_projections(torch.device(device)) is packs


def test_a_mistyped_setting_is_refused_naming_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv(PACKED_PROJECTIONS_ENV, "yes")
    with pytest.raises(ConfigError, match=r"KVFORGE_PACKED_PROJECTIONS.*'yes'.*must be 0 .* 1 .* or unset"):
        packs_projections(torch.device("cuda"))


@pytest.mark.parametrize("setting", ["1", "0"])
def test_a_runner_packs_its_model_by_the_rule(setting, monkeypatch):
    monkeypatch.setenv(PACKED_PROJECTIONS_ENV, setting)
    model = make_pair("llama_gqa")[1]
    ModelRunner(model, make_runner(model).cache)
    packed = [m.packed_qkv for m in model.modules() if isinstance(m, CachedAttention)]
    assert all((p is not None) == (setting == "1") for p in packed) and packed


def test_a_device_without_room_for_the_pack_keeps_the_parts_apart(monkeypatch):
    parts = (nn.Linear(8, 4), nn.Linear(8, 6))
    weights = [part.weight for part in parts]

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "cat", no_room)
    assert pack_linears(parts) is None
    assert all(part.weight is weight and weight.is_contiguous() for part, weight in zip(parts, weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the engine packs there by default")
@pytest.mark.parametrize("spec", ["full:block_size=4", "kivi:bits=2,group=4,residual=8"])
def test_on_cuda_the_packed_model_gives_the_logits_of_its_parts_apart(spec, monkeypatch):
    """On a GPU, where one GEMM replaces three (cuBLAS may pick other kernels for the wider
    product), the Triton RoPE and SiLU-gate read the slices in place."""
    monkeypatch.delenv(DISABLE_ENV)
    monkeypatch.setenv(PACKED_PROJECTIONS_ENV, "0")
    apart = logits(make_pair("llama_gqa")[1].cuda(), spec)
    monkeypatch.delenv(PACKED_PROJECTIONS_ENV)
    model = make_pair("llama_gqa")[1].cuda()
    used = packs_used(monkeypatch)
    packed = logits(model, spec)
    assert len(used) == 4 * 2 * len(model.model.layers)  # every step of every layer, prefill and decode
    torch.testing.assert_close(packed, apart, rtol=1e-4, atol=1e-4)
