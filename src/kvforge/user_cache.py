"""Where kvforge keeps files it can rebuild (tokenizers, converted peer weights):
$KVFORGE_CACHE_DIR/<part>, else ~/.cache/kvforge/<part>. Read on every call, so tests can
point it at a temporary directory."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(part: str) -> Path:
    root = os.environ.get("KVFORGE_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "kvforge") / part
