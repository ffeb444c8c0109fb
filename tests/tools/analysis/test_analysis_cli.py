"""`kvforge analyze` end to end on a tiny random model (the loader is replaced)."""

from __future__ import annotations

import json

import pytest
from conftest import make_pair

from kvforge.cli import main
from kvforge.tools.analysis import cli as analysis_cli
from kvforge.tools.text_data import split_train_heldout


class CharTokenizer:
    """One id per printable character (ids 3..95 of the tiny models' vocabulary of 96)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 29 if 32 <= ord(c) <= 124 else 3 for c in text]


@pytest.fixture
def tiny_setup(monkeypatch, tmp_path):
    _, model = make_pair("gemma3_hybrid")  # QK-norm and mixed sliding/global layers
    monkeypatch.setattr(analysis_cli, "load_model_and_tokenizer",
                        lambda name, dtype, device: (model, CharTokenizer(), "tiny"))
    # Articles with title lines, so the held-out split (after 80% at an article start) is non-empty.
    text = "".join(f" = Article {i} = \n\n The word {i} follows the words before it, again and again.\n\n"
                   for i in range(40))
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    return model, text_file


def test_analyze_all_writes_figures_and_numbers(tiny_setup, tmp_path, capsys):
    model, text_file = tiny_setup
    out = tmp_path / "out"
    assert main(["analyze", "all", "--model", "tiny", "--text-file", str(text_file), "--tokens", "64",
                 "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    for kind in ("layer-similarity", "key-spectra", "kv-channels"):
        assert f"== {kind} ==" in printed
        stem = kind.replace("-", "_")
        assert (out / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        payload = json.loads((out / f"{stem}.json").read_text())
        assert payload["analysis"] == kind and payload["num_tokens"] == 64 and payload["model"] == "tiny"
        assert payload["text_part"] == "held-out"
        global_layers = [i for i in range(4) if model.config.window_of(i) is None]
        assert payload["global_layers"] == global_layers and 0 < len(global_layers) < 4
    spectra = json.loads((out / "key_spectra.json").read_text())
    assert len(spectra["layers"]) == 4
    assert len(spectra["layers"][0]["chunk_min_cosine"]["values"]) == 64 // 8  # one KV head
    channels = json.loads((out / "kv_channels.json").read_text())
    assert channels["layer"] == 2 and len(channels["key_magnitude"]) == 32


def test_analyze_one_kind_and_a_bad_layer(tiny_setup, tmp_path, capsys):
    _, text_file = tiny_setup
    out = tmp_path / "one"
    assert main(["analyze", "kv-channels", "--model", "tiny", "--text-file", str(text_file), "--tokens", "32",
                 "--out", str(out), "--layer", "1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["kv_channels.json", "kv_channels.png"]
    assert json.loads((out / "kv_channels.json").read_text())["layer"] == 1
    assert main(["analyze", "kv-channels", "--model", "tiny", "--text-file", str(text_file), "--tokens", "32",
                 "--out", str(out), "--layer", "4"]) == 2
    assert "invalid layer=4" in capsys.readouterr().err


def test_passage_is_the_start_of_the_held_out_text(tiny_setup):
    _, text_file = tiny_setup
    ids = analysis_cli.passage_tokens(CharTokenizer(), str(text_file), 40)
    text = text_file.read_text()
    train, heldout = split_train_heldout(text)
    assert len(train) >= 0.8 * len(text) and heldout.startswith(" = Article ")
    assert ids == CharTokenizer().encode(heldout[:40])
    with pytest.raises(Exception, match="tokens"):
        analysis_cli.passage_tokens(CharTokenizer(), str(text_file), 10**6)
