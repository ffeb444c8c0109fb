"""The stronger transformers peer, `hf-static`: transformers' static cache with its forward
compiled by `torch.compile`, its fastest documented decode path (what `generate` does
with `cache_implementation="static"`: `model.get_compiled_call(CompileConfig())`, inductor
in mode "reduce-overhead", which replays CUDA graphs on a GPU). Same weights, dtype,
thread count and prompt ids as `hf` (hf_peer.py), and timed the same way:

- `decode`: the prompt batch is prefilled into one `StaticCache` by the plain forward
  (untimed; `generate` does not compile its prefill either), then G-1 compiled forward calls
  with greedy argmax fed back are timed;
- `prefill`: one compiled forward of the whole [batch, prompt] into a `StaticCache` sized to
  the prompt, plus the argmax.

Compiling is not timed: `compile_decode` / `compile_prefill` run once before the warm-up
and the timed runs and return their seconds, which the benchmark reports as
`compile_seconds`. One cache is kept and reset between runs (untimed), as `generate` keeps
its own: its tensors have static addresses, and a new cache would make the compiled code
(and its CUDA graphs) start over.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvforge.integrations.transformers import cache_argument
from kvforge.tools.bench.hf_peer import _wait

NAME = "hf-static"
TIMING = {
    "decode": "transformers' StaticCache, prefilled by the plain forward (untimed), then G-1 calls of the forward "
              "compiled as generate compiles it (CompileConfig defaults: inductor, mode reduce-overhead) with "
              "argmax feedback; compiling is done before the warm-up and reported as compile_seconds",
    "prefill": "one call of the compiled forward (CompileConfig defaults) into a StaticCache the size of the prompt, "
               "plus the argmax; compiling is done before the warm-up and reported as compile_seconds",
}


def compiled_call(model: torch.nn.Module) -> Callable[..., Any]:
    """The model's forward compiled as transformers' `generate` compiles it for a static cache."""
    from transformers import CompileConfig

    return model.get_compiled_call(CompileConfig())


class StaticPeer:
    """One transformers model with one static cache of `max_len` tokens per sequence and
    its compiled forward."""

    def __init__(self, model: torch.nn.Module, max_len: int) -> None:
        from transformers import StaticCache

        self.model = model
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.call = compiled_call(model)

    def _ids(self, rows: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(rows, dtype=torch.long, device=self.model.device)

    def _forward(self, call: Callable[..., Any], ids: torch.Tensor) -> torch.Tensor:
        out = call(input_ids=ids, **cache_argument(self.cache), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(dim=-1, keepdim=True)

    def decode_tokens(self, prompts: Sequence[Sequence[int]], gen: int) -> tuple[torch.Tensor, float]:
        """The `gen` greedy tokens of every prompt ([batch, gen]) and the seconds of the
        gen-1 compiled decode calls (the prefill, by the plain forward, is untimed)."""
        ids = self._ids(prompts)
        with torch.inference_mode():
            self.cache.reset()
            tokens = [self._forward(self.model.__call__, ids)]
            _wait(self.model)
            start = time.perf_counter()
            for _ in range(gen - 1):
                tokens.append(self._forward(self.call, tokens[-1]))
            _wait(self.model)
            seconds = time.perf_counter() - start
        return torch.cat(tokens, dim=1), seconds

    def decode(self, prompts: Sequence[Sequence[int]], gen: int) -> dict[str, Any]:
        """What hf_peer.decode returns: seconds of the gen-1 timed steps, tokens, steps."""
        _, seconds = self.decode_tokens(prompts, gen)
        return {"seconds": seconds, "tokens": len(prompts) * (gen - 1), "steps": gen - 1}

    def prefill(self, prompts: Sequence[Sequence[int]]) -> float:
        """Seconds of one compiled batched prompt forward with logits for the last position."""
        ids = self._ids(prompts)
        with torch.inference_mode():
            self.cache.reset()
            _wait(self.model)
            start = time.perf_counter()
            self._forward(self.call, ids)
            _wait(self.model)
            return time.perf_counter() - start

    def compile_decode(self, prompts: Sequence[Sequence[int]], gen: int) -> float:
        """Seconds of the first decode run, which compiles the step (untimed by the benchmark)."""
        start = time.perf_counter()
        self.decode_tokens(prompts, max(gen, 2))
        return time.perf_counter() - start

    def compile_prefill(self, prompts: Sequence[Sequence[int]]) -> float:
        """Seconds of a plain prefill (which allocates the cache and gives its tensors static
        addresses, as transformers wants before compiling) and the first compiled one."""
        start = time.perf_counter()
        with torch.inference_mode():
            self.cache.reset()
            self._forward(self.model.__call__, self._ids(prompts))
        self.prefill(prompts)
        return time.perf_counter() - start

