"""CLI: clear errors for bad input, info on a tiny checkpoint, generation end to end; the top
level imports a verb's module only when that verb is parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvforge
from kvforge.cli import VERBS, load_function, main


@pytest.mark.parametrize("argv, expected", [
    (["info", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["info", "--model", "/no/such/file.gguf"], "no such file or directory"),
    (["generate", "--model", "no-such-model", "hi"], "named model"),
    (["generate", "--cache", "nope", "hi"], "known cache methods"),
    (["generate", "--dtype", "float64", "hi"], "invalid dtype='float64'"),
    (["generate", "--kv-budget", "lots", "hi"], "kv_budget"),
    (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    (["generate", "--top-p", "1.5", "hi"], "top_p"),
    (["chat", "--temperature", "-1"], "temperature"),
])
def test_bad_input_gives_clear_error(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_info_json(tmp_path, capsys):
    from kvforge.models.hf_checkpoint import CONFIG_FILE

    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 2048, "rope_theta": 10000.0}
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config))
    out = tmp_path / "info.json"
    assert main(["info", "--model", str(tmp_path), "--json", str(out)]) == 0
    info = json.loads(out.read_text())
    assert info["kv_cache"]["float32"]["bytes_per_token"] == 2 * 4 * 2 * 8 * 4
    assert info["kv_cache"]["bfloat16"]["bytes_per_token"] == 2 * 4 * 2 * 8 * 2
    assert "4 heads, 2 KV heads, head_dim 8" in capsys.readouterr().out


def test_help_imports_no_verb_module_and_not_torch():
    """`kvforge --help` lists the verbs from kvforge.cli.VERBS alone: no verb's module, and so
    not torch, is imported (run in a fresh interpreter: this one has imported both)."""
    probe = ("import sys\nfrom kvforge.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as exc:\n"
             "    assert exc.code == 0, exc.code\nprint('\\n'.join(sys.modules), file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(kvforge.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    imported = set(done.stderr.split())
    verb_modules = {reference.partition(":")[0] for verb in VERBS for reference in (verb.add_args, verb.run)}
    assert "torch" not in imported
    assert not verb_modules & imported, sorted(verb_modules & imported)
    assert "{" + ",".join(verb.name for verb in VERBS) + ",lm-eval}" in done.stdout


def test_every_verb_names_functions_that_exist():
    for verb in VERBS:
        assert callable(load_function(verb.add_args)) and callable(load_function(verb.run)), verb.name


@pytest.mark.parametrize("argv", [["bench", "prefill", "--help"], ["swiftkv", "--help"], ["info", "-h"]])
def test_a_verbs_help_builds_that_verb(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: kvforge {' '.join(w for w in argv if not w.startswith('-'))} ")


def test_generate_passes_vllms_min_p_and_repetition_penalty():
    from kvforge.cli import build_full_parser
    from kvforge.commands import _sampling_params

    args = build_full_parser().parse_args(["generate", "--min-p", "0.1", "--repetition-penalty", "1.3",
                                           "--frequency-penalty", "0.5", "--presence-penalty", "-0.25", "hi"])
    params = _sampling_params(args)
    assert params.min_p == 0.1 and params.repetition_penalty == 1.3
    assert params.frequency_penalty == 0.5 and params.presence_penalty == -0.25
    plain = _sampling_params(build_full_parser().parse_args(["chat"]))
    assert plain.min_p == 0.0 and plain.repetition_penalty == 1.0
    assert plain.frequency_penalty == 0.0 and plain.presence_penalty == 0.0



def test_generate_takes_a_structured_output_shape():
    from kvforge.cli import build_full_parser
    from kvforge.commands import _sampling_params
    from kvforge.engine.structured_output import StructuredOutputs

    args = build_full_parser().parse_args(["generate", "--structured-outputs", '{"choice": ["yes", "no"]}', "hi"])
    assert _sampling_params(args).structured_outputs == StructuredOutputs(choice=("yes", "no"))
    neutral = build_full_parser().parse_args(["generate", "--structured-outputs",
                                              '{"regex": "a+", "whitespace_pattern": null}', "hi"])
    assert _sampling_params(neutral).structured_outputs == StructuredOutputs(regex="a+")  # as the server accepts
    assert _sampling_params(build_full_parser().parse_args(["chat"])).structured_outputs is None


@pytest.mark.parametrize("value", ['{"choice": []}', "[1]", "{not json", '{"regexp": "a"}', '{}',
                                   '{"regex": "a", "structural_tag": "x"}'])
def test_a_bad_structured_output_shape_exits_2_naming_the_option(value, capsys):
    assert main(["generate", "--structured-outputs", value, "hi"]) == 2
    assert "--structured-outputs" in capsys.readouterr().err
