"""`kvforge swiftkv distill / evaluate` end to end on a tiny checkpoint, recipes, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from distill_helpers import one_thread, text_file, write_tiny_hf_checkpoint  # noqa: F401
from safetensors.torch import load_file

from kvforge.cli import main
from kvforge.errors import ConfigError
from kvforge.models.loader import load_model
from kvforge.models.swiftkv_checkpoint import swiftkv_tensor_names
from kvforge.tools.swiftkv.recipe import DistillRecipe, load_recipe_file, write_recipe

# A name no loader knows (a name, not a path: kvforge.cli_checks resolves paths before the
# command runs): errors must come before the model is even looked at.
MISSING_MODEL = "never-loaded-model"


def distill(*args: str) -> int:
    return main(["swiftkv", "distill", *args])


# -- bad input -------------------------------------------------------------------------
def test_empty_data_file_fails_before_training(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code = distill("--model", MISSING_MODEL, "--num-key-value-layers", "2", "--out", str(tmp_path / "o"),
                   "--data", str(empty))
    assert code == 2
    assert "data" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_chat_file_without_assistant_turns_fails_before_training(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})
                              for i in range(3)) + "\n")
    code = distill("--model", MISSING_MODEL, "--num-key-value-layers", "2", "--out", str(tmp_path / "o"),
                   "--data", str(chat))
    err = capsys.readouterr().err
    assert code == 2 and "no assistant turns" in err and not (tmp_path / "o").exists()


def test_recipe_with_an_unknown_key_fails_before_training(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num-key-value-layers: 2\nlearning-rate: 1.0e-4\nlearnin-rate: 3.0e-4\n")
    code = distill("--recipe", str(recipe), "--model", MISSING_MODEL, "--out", str(tmp_path / "o"))
    err = capsys.readouterr().err
    assert code == 2 and "learnin-rate" in err and "unknown key" in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize(("key", "value", "flag"), [("seq-len", "abc", "seq-len"), ("bf16", "yes", "bf16"),
                                                    ("warmup-ratio", 1.5, "warmup-ratio"),
                                                    ("lr-schedule", "step", "lr-schedule"),
                                                    ("hidden-loss-layer", 1, "hidden-loss-layer")])
def test_bad_recipe_values_name_the_flag(tmp_path, key, value, flag):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"num-key-value-layers": 2, "out": "x", key: value}))
    with pytest.raises(ConfigError, match=flag):
        DistillRecipe(**load_recipe_file(path))


def test_recipe_file_flags_and_written_recipe_agree(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("num_key_value_layers: 22\nlearning-rate: 2e-4\nseq-len: 128\nbf16: true\nout: a\n")
    from kvforge.cli import build_parser
    from kvforge.tools.swiftkv.recipe import recipe_from_args

    args = build_parser(["swiftkv"]).parse_args(["swiftkv", "distill", "--recipe", str(path), "--seq-len", "64", "--out", "b"])
    recipe = recipe_from_args(args)
    assert (recipe.num_key_value_layers, recipe.learning_rate, recipe.seq_len, recipe.bf16, recipe.out) == \
        (22, 2e-4, 64, True, "b")  # flags override the file; YAML's "2e-4" string is a number
    assert recipe.temperature == 2.0 and recipe.warmup_ratio == 0.05 and recipe.weight_decay == 0.0
    written = write_recipe(recipe, tmp_path / "written.yaml")
    assert DistillRecipe(**load_recipe_file(written)) == recipe


# -- end to end ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return write_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


def test_distill_writes_a_loadable_params_only_checkpoint_and_evaluate_reads_it(tiny_checkpoint, tmp_path, capsys):
    data, out = text_file(tmp_path / "text.txt"), tmp_path / "out"
    code = distill("--model", str(tiny_checkpoint), "--num-key-value-layers", "2", "--out", str(out), "--data",
                   str(data), "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "1", "--max-steps", "3",
                   "--learning-rate", "1e-2", "--eval-windows", "1", "--eval-context", "48", "--kl-chunk-tokens", "16")
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out KL" in printed
    names = {"config.json", "model.safetensors", "recipe.yaml", "metrics.jsonl", "loss.png", "checkpoints"}
    assert names <= {p.name for p in out.iterdir()}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "event" not in m] == [1, 2, 3]
    evals = [m for m in metrics if m.get("event") == "eval"]
    assert [m["step"] for m in evals] == [0, 3] and evals[1]["kl"] != evals[0]["kl"]  # the student moved

    tensors = load_file(str(out / "model.safetensors"))
    student, _ = load_model(tiny_checkpoint, swiftkv=out)
    assert set(tensors) == set(swiftkv_tensor_names(student.config))
    assert all(t.dtype == torch.float16 for t in tensors.values())
    torch.testing.assert_close(student.get_parameter("model.norm_swiftkv.weight"),
                               tensors["model.norm_swiftkv.weight"].float())
    base, _ = load_model(tiny_checkpoint)
    assert not torch.equal(student.get_parameter("model.layers.3.self_attn.q_proj_swiftkv.weight"),
                           base.get_parameter("model.layers.3.self_attn.q_proj.weight"))
    recipe = DistillRecipe(**load_recipe_file(out / "recipe.yaml"))
    assert recipe.max_steps == 3 and recipe.num_key_value_layers == 2

    report = tmp_path / "eval.json"
    code = main(["swiftkv", "evaluate", "--swiftkv", str(out), "--context", "48", "--max-windows", "1",
                 "--text-file", str(data), "--json", str(report)])
    assert code == 0  # --model defaults to the base named by the params-only checkpoint
    figures = json.loads(report.read_text())["students"][str(out)]
    assert figures["kl"] == pytest.approx(evals[1]["kl"], rel=1e-2)  # fp16 export vs the fp32 trained values
    assert figures["student_ppl"] > 1 and 0 <= figures["top1_agreement"] <= 1


def test_chat_and_self_generated_data_train(tiny_checkpoint, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                       {"role": "assistant", "content": " ".join(map(str, range(i)))}]})
                              for i in range(2, 8)) + "\n")
    common = ["--model", str(tiny_checkpoint), "--num-key-value-layers", "2", "--seq-len", "48", "--micro-batch-size",
              "1", "--grad-accum", "1", "--max-steps", "2"]
    assert distill(*common, "--out", str(tmp_path / "chat"), "--data", str(chat)) == 0
    generated = tmp_path / "gen"
    assert distill(*common, "--out", str(generated), "--data", str(text_file(tmp_path / "t.txt")), "--self-generate",
                   "3", "--self-generate-max-tokens", "6", "--self-generate-prompt-tokens", "8") == 0
    records = [json.loads(line) for line in (generated / "self_generated.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(len(r["prompt"]) == 8 and 1 <= len(r["completion"]) <= 6 for r in records)
    steps = [json.loads(line) for line in (generated / "metrics.jsonl").read_text().splitlines()]
    completions = sum(len(r["completion"]) for r in records)  # all three fit in the one 48-token row
    assert [m["counted_tokens"] for m in steps] == [completions] * 2  # only completion predictions count
    assert all(m["loss"] > 0 for m in steps)


def test_a_resume_with_a_changed_recipe_is_refused_and_leaves_the_run_intact(tiny_checkpoint, tmp_path, capsys):
    data, out = text_file(tmp_path / "text.txt"), tmp_path / "out"
    args = ["--model", str(tiny_checkpoint), "--num-key-value-layers", "2", "--out", str(out), "--data", str(data),
            "--seq-len", "32", "--grad-accum", "1", "--max-steps", "2"]
    assert distill(*args) == 0
    written = (out / "recipe.yaml").read_text(), (out / "metrics.jsonl").read_text()
    assert distill(*args[:-1], "4", "--resume", "auto") == 2  # max-steps changes the schedule
    assert "max-steps: 2 -> 4" in capsys.readouterr().err
    assert ((out / "recipe.yaml").read_text(), (out / "metrics.jsonl").read_text()) == written
    assert distill(*args, "--resume", "auto") == 0  # same recipe: already complete, nothing re-run
    assert (out / "metrics.jsonl").read_text() == written[1]


def test_init_from_starts_where_an_earlier_distillation_ended(tiny_checkpoint, tmp_path, capsys):
    data = text_file(tmp_path / "text.txt")
    common = ["--model", str(tiny_checkpoint), "--data", str(data), "--seq-len", "32", "--grad-accum", "1",
              "--eval-windows", "1", "--eval-context", "48"]
    first = tmp_path / "first"
    assert distill(*common, "--num-key-value-layers", "2", "--out", str(first), "--max-steps", "3",
                   "--learning-rate", "1e-2") == 0
    # The second run's evaluation before its first step is the first run's after its last.
    second = tmp_path / "second"
    assert distill(*common, "--num-key-value-layers", "2", "--out", str(second), "--max-steps", "1",
                   "--init-from", str(first)) == 0
    kl = {run: [m["kl"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if m.get("event") == "eval"] for run in (first, second)}
    assert kl[second][0] == pytest.approx(kl[first][1], rel=1e-2)  # fp16 export of the fp32 trained values
    assert DistillRecipe(**load_recipe_file(second / "recipe.yaml")).init_from == str(first)
    capsys.readouterr()

    assert distill(*common, "--num-key-value-layers", "3", "--out", str(tmp_path / "bad"), "--max-steps", "1",
                   "--init-from", str(first)) == 2
    err = capsys.readouterr().err
    assert "init-from" in err and "l and g (3, 1)" in err and "found (2, 1)" in err
    # A g = 1 model starts a g = 2 one (K/V averaged per group); the other way is refused.
    grouped = tmp_path / "grouped"
    assert distill(*common, "--num-key-value-layers", "2", "--group-size", "2", "--out", str(grouped),
                   "--max-steps", "1", "--init-from", str(first)) == 0
    assert distill(*common, "--num-key-value-layers", "2", "--out", str(tmp_path / "bad3"), "--max-steps", "1",
                   "--init-from", str(grouped)) == 2
    assert "found (2, 2)" in capsys.readouterr().err
    assert distill(*common, "--num-key-value-layers", "2", "--out", str(tmp_path / "bad2"), "--max-steps", "1",
                   "--init-from", str(tiny_checkpoint)) == 2
    assert "must be a SwiftKV checkpoint directory" in capsys.readouterr().err
