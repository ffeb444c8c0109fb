"""A packed model (models/packed_projections.py: what a runner on CUDA builds) replayed from
captured decode steps, on CUDA's code paths, gives the logits of the same model with its
projections apart run step by step: RoPE, SiLU-gate and every cache method's writes and
attention read the packed GEMM's slices in place (on the CPU: Triton's interpreter and the
emulation of a capture, graph_replay.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_pair, make_runner
from test_static_decode import replaying, script
from triton_helpers import interpreted_or_skip

from kvforge.host_sync import device_code_paths
from kvforge.models.layers import pack_projections
from kvforge.models.packed_projections import PackedLinear


@pytest.mark.parametrize("spec", ["full:block_size=4,decode_kernel=triton",
                                  "kivi:bits=2,group=4,residual=8,decode_kernel=triton"], ids=["full", "kivi"])
def test_packed_layers_replayed_give_the_logits_of_the_layers_apart(spec, monkeypatch):
    interpreted_or_skip()
    with device_code_paths():
        apart = script(make_runner(make_pair("llama_gqa")[1], spec))
        model = make_pair("llama_gqa")[1]
        assert pack_projections(model) == 2 * len(model.model.layers)
        used: list[int] = []
        split = PackedLinear.split
        monkeypatch.setattr(PackedLinear, "split", lambda self, out: used.append(1) or split(self, out))
        runner, graphs = replaying(model, spec)
        packed = script(runner)
    assert used and graphs.static_steps >= 10
    assert len(packed) == len(apart)
    for step, (a, b) in enumerate(zip(packed, apart)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")
