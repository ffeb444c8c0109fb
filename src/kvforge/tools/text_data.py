"""The offline text corpus (WikiText-2 raw test split beside the project) and its split.

The first 80% of the file by characters, cut at the next article boundary (a top-level
title line " = Title = "), may be used for training and calibration; the rest is held out
for evaluation. Never evaluate on the training part.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvforge.errors import ConfigError

TEXT_FILE_NAME = "wikitext-2-raw-test.txt"
TRAIN_FRACTION = 0.8
_ARTICLE_TITLE = re.compile(r"^ = [^=].* = \r?$", re.MULTILINE)


def default_text_file() -> Path:
    """$KVFORGE_TEXT_FILE, else ../shared/data/ beside the repository or the working dir."""
    if os.environ.get("KVFORGE_TEXT_FILE"):
        return Path(os.environ["KVFORGE_TEXT_FILE"])
    repo_root = Path(__file__).resolve().parents[2]
    for base in (repo_root, Path.cwd()):
        candidate = base.parent / "shared" / "data" / TEXT_FILE_NAME
        if candidate.is_file():
            return candidate
    return repo_root.parent / "shared" / "data" / TEXT_FILE_NAME


def read_text(path: str | Path | None = None) -> str:
    path = Path(path) if path is not None else default_text_file()
    if not path.is_file():
        raise ConfigError("text_file", str(path), "must be an existing text file (see --text-file)")
    # newline="" keeps CRLF line endings, so tokenisation is reproducible byte for byte
    with path.open(encoding="utf-8", newline="") as handle:
        text = handle.read()
    if not text.strip():
        raise ConfigError("text_file", str(path), "must not be empty")
    return text


def split_train_heldout(text: str) -> tuple[str, str]:
    """(first ~80% up to an article boundary, the rest)."""
    target = int(len(text) * TRAIN_FRACTION)
    match = _ARTICLE_TITLE.search(text, target)
    cut = match.start() if match else target
    return text[:cut], text[cut:]


def heldout_text(path: str | Path | None = None) -> str:
    return split_train_heldout(read_text(path))[1]
