"""`kvforge swiftkv compare` on a tiny checkpoint: with l = L the SwiftKV model is the base,
so both continuations must agree token for token; l < L runs and reports both systems."""

from __future__ import annotations

import pytest
from distill_helpers import one_thread, text_file, write_tiny_hf_checkpoint  # noqa: F401

from kvforge.cli import main
from kvforge.tools.swiftkv.side_by_side import common_prefix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("side")
    return write_tiny_hf_checkpoint(root / "model"), text_file(root / "text.txt"), root


def init(model, out, layers: int) -> None:
    assert main(["swiftkv", "init", "--model", str(model), "--num-key-value-layers", str(layers), "--out", str(out),
                 "--params-only"]) == 0


def compare(swiftkv, text, *extra: str) -> int:
    return main(["swiftkv", "compare", "--swiftkv", str(swiftkv), "--text-file", str(text), "--prompt-tokens", "40",
                 "--max-tokens", "6", "--repeats", "1", *extra])


def test_all_layers_kept_continues_exactly_like_the_base(tiny, capsys):
    model, text, root = tiny
    init(model, root / "l4", 4)  # l = L: no layer skipped
    assert compare(root / "l4", text) == 0
    out = capsys.readouterr().out
    assert "| base |" in out and "| swiftkv |" in out
    assert "generated tokens: 6; identical leading tokens: 6; same token at the same position: 6" in out


def test_skipping_layers_reports_both_systems(tiny, capsys):
    model, text, root = tiny
    init(model, root / "l2", 2)
    assert compare(root / "l2", text) == 0
    out = capsys.readouterr().out
    assert "--- base continuation ---" in out and "--- swiftkv continuation ---" in out
    assert "prefill speed-up" in out and "generated tokens: 6;" in out


def test_bad_settings_fail_before_loading(tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:  # argparse's refusal of the value
        main(["swiftkv", "compare", "--swiftkv", str(tmp_path / "missing"), "--prompt-tokens", "0"])
    code = refused.value.code
    err = capsys.readouterr().err
    assert code == 2 and "prompt-tokens" in err and ">= 1" in err


def test_common_prefix():
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix((), (1,)) == 0
