"""Kernels a captured decode step launches per decoder layer, counted in graph_replay's
emulation of a capture on the CPU (on CUDA code paths): Triton launches, and aten
operations that write or make a tensor (views, aliases and no-op casts launch nothing).
On CPU the projections, RMSNorm, RoPE and SiLU-and-multiply are one operation each, as
their CUDA counterparts are one kernel each (a GEMM, the fused Triton ops), so the counts
are what a GPU's profiler would see in the layer, give or take a split-K reduction; the
GPU profile (benchmarks/gpu/profile_decode.py) is the measurement, this is the guard.

Per-step work must run once per step, not once per layer: a layer after the first may
launch at most the layer's own kernels, and the first only the few per-step ones more
(KIVI's residual split, ShadowKV's row choice)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair, make_runner
from graph_replay import active_graph
from static_steps import Replayed
from triton_helpers import interpreted_or_skip

from kvforge.cache.registry import create_cache
from kvforge.engine.runner import ModelRunner
from kvforge.host_sync import device_code_paths
from kvforge.kernels import cuda_fused
from kvforge.kernels.cpu_fused import fused_ops_available
from kvforge.kernels.cpu_linear import small_m_linear_available
from kvforge.models.layers import pack_projections

SHADOWKV = ("shadowkv:chunk=4,local=8,outliers=1,min_context=24,generated_window=8,rank=3,budget=paper,"
            "budget_floor=4,budget_fraction=0.1,kernel=0")
# (spec, the step's form) -> (kernels of a layer after the first, more in the first layer)
# full: norm, q, k, v, RoPE of k with both page writes (one launch: cache/full/triton_store.py),
# RoPE of q, paged attention, o, add with the norm after it (one launch), gate, up, SiLU-and-multiply, down with
# the add after it (one GEMM: models/layers.py GatedMLP.add_into)
BUDGETS = {("full:block_size=4,decode_kernel=triton", "any"): (13, 0),
           ("kivi:bits=2,group=4,residual=8,decode_kernel=triton", "any"): (13, 4),  # its stores run after the step
           # exact and compressed sequences: full's layer and the sparse kernels (scores, top-k,
           # reuse match, key rebuild, values read in place, attention), each row keeping its own
           (SHADOWKV, "any"): (20, 1),
           # every sequence compressed: RoPE of k and of q and the sparse kernels; no page writes,
           # exact attention or per-row choice (ShadowKV's own: 8 a layer, the paper's target 10)
           (SHADOWKV, "compressed"): (18, 0)}
PACKED_SAVES = 3  # packed projections (the default on CUDA): q, k, v in one GEMM and gate, up in one


def _layer_kernels(spec: str, packed: bool, monkeypatch, name: str = "llama_gqa") -> dict[str, list[list[list[str]]]]:
    """For each form of the step, for each captured bucket of it that holds decoder layers:
    each layer's kernels, in order."""
    interpreted_or_skip()
    # the Triton ops with no CPU counterpart (the residual add with its norm) run, interpreted, as on CUDA
    monkeypatch.setattr(cuda_fused, "DEVICE_TYPE", "cpu")
    if not (small_m_linear_available() and fused_ops_available()):
        pytest.skip("kvforge's CPU kernels did not build: the layer's operations are not one each")
    model = make_pair(name)[1]
    if packed:  # as a runner on CUDA packs it (models/packed_projections.py)
        assert pack_projections(model) == 2 * len(model.model.layers)
    spans: list[tuple[object, int, list[int]]] = []

    def before(module, args) -> None:
        graph = active_graph()
        if graph is not None:
            spans.append((graph, len(graph.kernels), [0]))

    def after(module, args, out) -> None:
        graph = active_graph()
        if graph is not None:
            spans[-1][2][0] = len(graph.kernels)

    hooks = [h for layer in model.model.layers
             for h in (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))]
    try:
        with device_code_paths():
            if spec == SHADOWKV:
                runner = ModelRunner(model, create_cache(spec, model.cache_layout(), 1 << 22, torch.float32))
                runner.cache.sparse.triton = True  # kernel=0 keeps the fused C++ kernel off on the CPU
                runner.cache.exact.decode_kernel = "triton"  # CUDA's paged kernel for the exact rows
                graphs = runner.decode_graphs = Replayed(model, runner.cache, 4, 128, capture=True)
            else:
                runner = make_runner(model, spec)
                graphs = runner.decode_graphs = Replayed(model, runner.cache, 4, 32, capture=True)
            assert graphs.capture().graphs > 0
    finally:
        for hook in hooks:
            hook.remove()
    steps: dict[int, list[list[str]]] = {}
    for graph, start, (end,) in spans:
        steps.setdefault(id(graph), []).append([name.split("::")[-1] for name in graph.kernels[start:end]])
    assert steps and all(len(layers) == len(model.model.layers) for layers in steps.values())
    form_of = {id(graph): form for (_, _, form), (graph, _, _) in graphs._graphs.items()}
    by_form: dict[str, list[list[list[str]]]] = {}
    for graph_id, layers in steps.items():
        by_form.setdefault(form_of[graph_id], []).append(layers)
    return by_form


@pytest.mark.parametrize("spec", ["full:block_size=4,decode_kernel=triton",
                                  "kivi:bits=2,group=4,residual=8,decode_kernel=triton", SHADOWKV],
                         ids=["full", "kivi", "shadowkv"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_a_captured_decode_step_launches_a_few_kernels_per_layer(spec: str, packed: bool, monkeypatch) -> None:
    by_form = _layer_kernels(spec, packed, monkeypatch)
    assert sorted(by_form) == sorted(form for s, form in BUDGETS if s == spec)  # every form captured
    for form, steps in by_form.items():
        per_layer, once = BUDGETS[spec, form]
        # packed: one GEMM for q, k and v and one for gate and up, where there were five
        _within_budget(steps, per_layer - PACKED_SAVES if packed else per_layer, once, 3 if packed else 6)
        # the residual add after attention and the norm before the MLP: one launch, in every layer;
        # the add after the MLP: in the down projection's GEMM, none apart
        assert all(kernels.count("triton:_rms_norm_kernel") == 1 and kernels.count("addmm_") == 1
                   and "add" not in kernels for layers in steps for kernels in layers), steps[0][1]
        if spec == SHADOWKV:  # every layer attends its compressed sequences sparsely
            assert all("triton:_attention_kernel" in kernels for layers in steps for kernels in layers)
        if form == "compressed":  # no exact sequence: no exact page write, no paged attention
            exact = {"index_copy_", "triton:_rope_store_kernel", "triton:_paged_decode_kernel"}
            assert not any(exact & set(kernels) for layers in steps for kernels in layers)


def _within_budget(steps: list[list[list[str]]], per_layer: int, once: int, gemms: int) -> None:
    for layers in steps:
        first, *rest = layers
        for kernels in rest:
            assert len(kernels) <= per_layer, f"{len(kernels)} kernels in a layer: {kernels}"
        assert len(first) <= per_layer + once, f"{len(first)} kernels in the first layer: {first}"
    # the counting sees the layer's work: its projections (all but down) and its attention at least
    assert all(sum(name == "small_m_linear" for name in kernels) == gemms for layers in steps for kernels in layers)
    assert any(name.startswith("triton:") for kernels in steps[-1] for name in kernels)


def test_gemma3s_residual_adds_and_gate_launch_fused(monkeypatch) -> None:
    """Gemma3's sandwich norms: the post-attention norm, the add and the pre-feedforward norm
    in one launch, the post-feedforward norm and the add in another, no add apart; its
    GELU-tanh gate in one launch."""
    by_form = _layer_kernels("full:block_size=4,decode_kernel=triton", False, monkeypatch, "gemma3_hybrid")
    layers = [kernels for steps in by_form.values() for step in steps for kernels in step]
    assert layers and all(kernels.count("triton:_rms_norm_kernel") == 2
                          and kernels.count("triton:_gate_mul_kernel") == 1
                          and not {"add", "gelu", "mul"} & set(kernels) for kernels in layers), layers[0]
    # norm, q, k, v, q-norm, k-norm, RoPE and store, RoPE of q, attention, o, the sandwich, gate, up, the gate's
    # product, down, the add of a norm (from 20 before the fused adds and gate)
    assert max(len(kernels) for kernels in layers) <= 16
