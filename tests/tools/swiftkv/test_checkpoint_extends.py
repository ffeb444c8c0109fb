"""A params-only SwiftKV checkpoint that extends another (`kvforge_extends`): it stores only
the tensors it changes and loads as the whole; what it may extend is checked before any
weight is read. Also: a checkpoint stored in bfloat16 loads in any compute dtype."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint_format import base_and_swiftkv

from kvforge.errors import ModelLoadError
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import (
    EXTENDS_KEY,
    initial_swiftkv_tensors,
    read_overlay_tensors,
    write_checkpoint,
)

HEAD = "model.early_exit_proj.weight"


def write_pair(tmp_path, dtype=torch.float32):
    """A base checkpoint, a params-only SwiftKV one over it ("parent"), and a child that
    extends the parent with an early-exit head and one changed tensor; returns the child's
    whole tensors as a plain checkpoint would hold them."""
    base, swift = base_and_swiftkv()
    write_checkpoint(tmp_path / "base", base.config, base.state_dict(), torch.float32)
    parent = initial_swiftkv_tensors(dict(base.state_dict()), base.config, swift)
    write_checkpoint(tmp_path / "parent", replace(base.config, swiftkv=swift), parent, dtype,
                     base_model=str(tmp_path / "base"))
    with_head = replace(swift, early_exit_head=True)
    own = {HEAD: torch.randn(base.config.hidden_size, base.config.hidden_size),
           "model.norm_swiftkv.weight": torch.rand(base.config.hidden_size) + 0.5}
    write_checkpoint(tmp_path / "child", replace(base.config, swiftkv=with_head), own, dtype,
                     base_model=str(tmp_path / "base"))
    set_config(tmp_path / "child", **{EXTENDS_KEY: "../parent"})
    return {name: t.to(dtype) for name, t in {**parent, **own}.items()}


def set_config(directory, **fields):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_an_extending_checkpoint_reads_as_the_whole_and_loads_in_any_dtype(tmp_path, stored):
    whole = write_pair(tmp_path, stored)
    read = read_overlay_tensors(tmp_path / "child", torch.float32)
    assert set(read) == set(whole)
    for name, tensor in whole.items():  # its own tensors win over the parent's
        assert torch.equal(read[name], tensor.float()), name
    for compute in (torch.float32, torch.bfloat16):
        model = load_model(tmp_path / "child", dtype=compute)[0]
        assert model.config.swiftkv.early_exit_head
        assert model.get_parameter(HEAD).dtype == compute
        torch.testing.assert_close(model.get_parameter(HEAD), whole[HEAD].to(compute), rtol=0, atol=0)
        torch.testing.assert_close(model.get_parameter("model.layers.3.self_attn.q_proj_swiftkv.weight"),
                                   whole["model.layers.3.self_attn.q_proj_swiftkv.weight"].to(compute),
                                   rtol=0, atol=0)


def test_a_plain_bfloat16_checkpoint_loads_in_float32(tmp_path):
    base, swift = base_and_swiftkv()
    write_checkpoint(tmp_path / "base", base.config, base.state_dict(), torch.float32)
    tensors = initial_swiftkv_tensors(dict(base.state_dict()), base.config, swift)
    write_checkpoint(tmp_path / "params", replace(base.config, swiftkv=swift), tensors, torch.bfloat16,
                     base_model=str(tmp_path / "base"))
    model = load_model(tmp_path / "params", dtype="float32")[0]
    name = "model.layers.2.self_attn.q_proj_swiftkv.weight"
    assert model.get_parameter(name).dtype == torch.float32
    torch.testing.assert_close(model.get_parameter(name), tensors[name].bfloat16().float(), rtol=0, atol=0)


@pytest.mark.parametrize(("parent_fields", "child_fields", "message"), [
    ({}, {EXTENDS_KEY: "../nowhere"}, "is not a directory"),
    ({EXTENDS_KEY: "../child"}, {}, "extends '../child' in turn"),
    ({"num_key_value_layers": 2}, {}, "has num_key_value_layers=2 but this checkpoint has num_key_value_layers=1"),
    ({"key_value_group_size": 1}, {}, "key_value_group_size"),
    ({"kvforge_base_model": "another"}, {}, "kvforge_base_model='another'"),
])
def test_what_a_checkpoint_may_extend_is_checked(tmp_path, parent_fields, child_fields, message):
    write_pair(tmp_path)
    set_config(tmp_path / "parent", **parent_fields)
    set_config(tmp_path / "child", **child_fields)
    with pytest.raises(ModelLoadError, match=message):
        read_overlay_tensors(tmp_path / "child", torch.float32)


def test_a_missing_tensor_of_the_whole_is_still_refused(tmp_path):
    """The child plus its parent must hold every SwiftKV tensor, as a plain checkpoint must."""
    write_pair(tmp_path)
    save_file({HEAD: torch.zeros(1)}, str(tmp_path / "parent" / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(tmp_path / "child")
