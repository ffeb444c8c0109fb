"""SwiftKV early exit (paper App. E): decode rows whose early-exit head is confident take its
logits and skip the later layers, and the sequences go on exactly as the definition says
(the later layers' caches are complete whatever exits); the head trains with the
distillation loss and round-trips through checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from distill_helpers import one_thread, random_data, tiny_base, tiny_recipe  # noqa: F401
from swiftkv_helpers import across_kv_pair
from test_swiftkv_engine import engine_for, prompts_of, run

from kvforge.cli import main
from kvforge.config import SwiftKVConfig
from kvforge.errors import ConfigError
from kvforge.models.dense import dense_hidden_states, dense_logits
from kvforge.models.loader import load_model
from kvforge.models.registry import build_model
from kvforge.models.swiftkv_checkpoint import (
    initial_swiftkv_tensors,
    model_state_for_swiftkv,
    swiftkv_tensor_names,
    write_checkpoint,
)
from kvforge.tools.swiftkv.loss import distill_loss
from kvforge.tools.swiftkv.student import DistillModel
from kvforge.tools.swiftkv.trainer import Trainer

FIRST_LATER = 1


def early_exit_model(seed: int = 0):
    """The 5-layer AcrossKV llama of the engine tests with a perturbed early-exit head."""
    base, _ = across_kv_pair()
    config = replace(base.config, swiftkv=SwiftKVConfig(FIRST_LATER, 2, early_exit_head=True))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state.update(initial_swiftkv_tensors(state, base.config, config.swiftkv))
    generator = torch.Generator().manual_seed(seed)
    for name in list(state):
        if "swiftkv" in name or "early_exit" in name:
            state[name] = state[name] + 0.05 * torch.randn(state[name].shape, generator=generator)
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(state, config))
    return model


def reference_greedy(model, prompt: list[int], max_tokens: int, threshold: float | None) -> tuple[list[int], int]:
    """The definition, densely: the prompt's last row never exits; each decode row takes the
    early head's argmax when its top probability >= threshold, else the final argmax."""
    tokens, exits = list(prompt), 0
    with torch.no_grad():
        for step in range(max_tokens):
            ids = torch.tensor([tokens])
            final = dense_logits(model, ids)[0, -1]
            if step > 0 and threshold is not None:
                early = model.early_logits(dense_hidden_states(model, ids, output_layer=FIRST_LATER)[0, -1:])[0]
                if torch.softmax(early, dim=-1).max() >= threshold:
                    tokens.append(int(early.argmax()))
                    exits += 1
                    continue
            tokens.append(int(final.argmax()))
    return tokens[len(prompt):], exits


def test_the_head_starts_as_the_final_head_on_the_input_of_layer_l():
    base, _ = across_kv_pair()
    config = replace(base.config, swiftkv=SwiftKVConfig(FIRST_LATER, 2, early_exit_head=True))
    state = {k: v.clone() for k, v in base.state_dict().items()}
    state.update(initial_swiftkv_tensors(state, base.config, config.swiftkv))
    model = build_model(config)
    model.load_hf_state_dict(model_state_for_swiftkv(state, config))
    hidden = dense_hidden_states(model, torch.tensor([prompts_of([9])[0]]), output_layer=FIRST_LATER)[0]
    with torch.no_grad():
        torch.testing.assert_close(model.early_logits(hidden), model.logits(hidden), atol=1e-4, rtol=1e-4)


def test_observing_changes_nothing_and_records_every_decode_row():
    model = early_exit_model()
    prompts = prompts_of([3, 10, 25, 7])
    plain = run(engine_for(model), prompts, max_tokens=5)
    model.early_exit_probe = []
    observed = run(engine_for(model), prompts, max_tokens=5)
    assert observed == plain
    assert len(model.early_exit_probe) == 4 * 4  # 4 decode rows per sequence (the 1st token is a prompt row)
    assert model.early_exit_counts.exited == 0
    finals = sorted(final for _, _, final in model.early_exit_probe)
    assert finals == sorted(t for out in plain for t in out[1:])


@pytest.mark.parametrize("quantile", [None, 0.5])
def test_exits_follow_the_definition_and_leave_the_caches_complete(quantile):
    """Every decode row exits (a threshold below any probability), or about half (the median
    observed top probability): the engine's greedy tokens equal the dense definition, so rows
    that did not exit attended over later-layer K/V that exited rows still wrote."""
    model = early_exit_model()
    prompts = prompts_of([3, 10, 25, 7, 18])
    model.early_exit_probe = []
    run(engine_for(model), prompts, max_tokens=6)
    tops = torch.tensor([top for top, _, _ in model.early_exit_probe])
    threshold = 1e-9 if quantile is None else float(tops.quantile(quantile))
    model.early_exit_probe = None
    model.set_early_exit(threshold)
    model.early_exit_counts = type(model.early_exit_counts)()
    outputs = run(engine_for(model), prompts, max_tokens=6)
    expected_exits = 0
    for prompt, output in zip(prompts, outputs):
        reference, exits = reference_greedy(model, prompt, 6, threshold)
        assert output == reference
        expected_exits += exits
    assert model.early_exit_counts.exited == expected_exits
    assert model.early_exit_counts.decode_rows == 5 * 5
    assert (expected_exits == 25) if quantile is None else (0 < expected_exits < 25)


def test_bad_early_exit_settings_fail_clearly(tmp_path):
    model = early_exit_model()
    for threshold in (0.0, 1.5):
        with pytest.raises(ConfigError, match="early_exit.*probability"):
            model.set_early_exit(threshold)
    _, headless = across_kv_pair()
    with pytest.raises(ConfigError, match="early-exit head"):
        headless.set_early_exit(0.95)
    # the range is checked before the model is looked at
    assert main(["generate", "--model", "/nonexistent/model", "--early-exit", "1.5", "hi"]) == 2


def test_training_adds_the_early_exit_kl_and_moves_the_head(tmp_path):
    model = DistillModel(tiny_base(), SwiftKVConfig(1, 2, early_exit_head=True))
    assert "model.early_exit_proj.weight" in set(model.trainable())
    data = random_data()

    def early_kl() -> float:  # on one fixed batch
        tokens, segments, counted = data.rows(torch.arange(data.num_rows))
        with torch.no_grad():
            pair = model.forward_hidden(tokens, segments)
        assert pair.student_early is not None
        student = model.student
        return distill_loss(pair, counted, student.model.norm, student.lm_head, float(counted.sum()), 2.0,
                            64).early_kl

    before = early_kl()
    trainer = Trainer(model, data, tiny_recipe(tmp_path, max_steps=6, early_exit_head=True), tmp_path,
                      progress=False)
    records = trainer.train()
    assert all(r["early_exit_kl"] > 0 for r in records)
    assert [r["loss"] for r in records] == pytest.approx([r["kl"] + r["early_exit_kl"] for r in records], rel=1e-5)
    assert early_kl() < 0.9 * before


def test_the_head_round_trips_through_a_checkpoint(tmp_path):
    model = early_exit_model()
    out = tmp_path / "ckpt"
    write_checkpoint(out, model.config, model.state_dict(), torch.float32)
    assert json.loads((out / "config.json").read_text())["early_exit_head"] is True
    loaded, _ = load_model(out)
    assert loaded.config.swiftkv.early_exit_head
    for name in swiftkv_tensor_names(model.config):
        if "early_exit" in name:
            assert torch.equal(loaded.get_parameter(name), model.get_parameter(name))


def test_early_exit_command_reports_its_figures(tmp_path):
    from distill_helpers import text_file, write_tiny_hf_checkpoint

    model, text = write_tiny_hf_checkpoint(tmp_path / "model"), text_file(tmp_path / "text.txt")
    swift = tmp_path / "swift"
    assert main(["swiftkv", "init", "--model", str(model), "--num-key-value-layers", "2", "--early-exit-head",
                 "--params-only", "--out", str(swift)]) == 0
    common = ["swiftkv", "early-exit", "--swiftkv", str(swift), "--prompts", "3", "--prompt-tokens", "8",
              "--max-tokens", "5", "--speed-prompts", "1", "--repeats", "1", "--text-file", str(text)]
    out = tmp_path / "ee.json"
    assert main([*common, "--threshold", "1e-9", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["decode_tokens_observed"] == 3 * 4  # the first token of each comes from the prompt row
    assert result["share_at_or_above_threshold"] == 1.0 and result["exit_rate"] == 1.0
    # the untrained head is the final head on layer l's input: agreement is what it is, but defined
    assert 0.0 <= result["agreement_above_threshold"] <= 1.0
    assert result["decode_tokens_per_s"]["with"] > 0 and "foreign_cores" in result["environment"]
    from kvforge.tools.report.render import render_document

    assert "exit rate with exits on | 100.0%" in render_document("ee.json", result)
    assert main([*common, "--threshold", "1.0", "--json", str(out)]) == 0
    never = json.loads(out.read_text())
    assert never["identical_outputs"] == 3 and never["token_agreement_positionwise"] == 1.0
    assert main([*common, "--threshold", "0"]) == 2


def test_early_exit_only_trains_the_head_and_exports_every_swiftkv_tensor(tmp_path):
    model = DistillModel(tiny_base(), SwiftKVConfig(1, 2, early_exit_head=True), early_exit_only=True)
    assert set(model.trainable()) == {"model.early_exit_proj.weight"}
    frozen = {k: v for k, v in model.export_state().items() if "early_exit" not in k}
    Trainer(model, random_data(), tiny_recipe(tmp_path, max_steps=2, early_exit_head=True, early_exit_only=True),
            tmp_path, progress=False).train()
    exported = model.export_state()
    assert set(exported) == set(swiftkv_tensor_names(model.student.config))
    for name, tensor in frozen.items():
        assert torch.equal(exported[name], tensor), name
    hidden = model.teacher.config.hidden_size
    assert not torch.equal(exported["model.early_exit_proj.weight"], torch.eye(hidden))
    with pytest.raises(ConfigError, match="early-exit-only"):
        tiny_recipe(tmp_path, early_exit_only=True)


def test_the_committed_early_exit_model_keeps_l15_exactly():
    """models/swiftkv-smollm2-135m-l15-ee trained only its head (--early-exit-only): it stores
    the head alone and extends the committed l15 model, so every other SwiftKV tensor is
    l15's, bit for bit."""
    from pathlib import Path

    from safetensors.torch import load_file

    from kvforge.models.swiftkv_checkpoint import read_overlay_tensors

    models = Path(__file__).resolve().parents[3] / "models"
    l15 = load_file(str(models / "swiftkv-smollm2-135m-l15" / "model.safetensors"))
    assert set(load_file(str(models / "swiftkv-smollm2-135m-l15-ee" / "model.safetensors"))) == {
        "model.early_exit_proj.weight"}
    ee = read_overlay_tensors(models / "swiftkv-smollm2-135m-l15-ee", torch.float16)
    assert set(ee) - set(l15) == {"model.early_exit_proj.weight"}
    assert all(torch.equal(ee[name], tensor) for name, tensor in l15.items())
    assert json.loads((models / "swiftkv-smollm2-135m-l15-ee" / "config.json").read_text())["early_exit_head"]
