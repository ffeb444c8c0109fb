"""GatedMLP's activation: the fused gates serve the activations they know; any other
activation set on the module runs its own PyTorch expression."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.models.layers import GatedMLP


def test_an_activation_without_a_fused_gate_runs_its_expression() -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(16, 40, "silu", bias=False)
    mlp.activation = torch.tanh  # e.g. a study swapping the activation after construction
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = F.linear(torch.tanh(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                            mlp.down_proj.weight)
        torch.testing.assert_close(mlp(x), expected)
