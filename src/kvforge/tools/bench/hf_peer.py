"""The transformers peer: the same weights (loaded by transformers from the same file), the
same dtype and thread count, the same prompt ids. Only loaded when `--compare hf` asks.

Each function below times exactly what its kvforge counterpart times:
- `prefill`: one forward call `model(ids, logits_to_keep=1)` under inference_mode (what
  `generate(max_new_tokens=1)` computes, minus its Python set-up), plus the argmax;
- `decode`: the prompt batch is prefilled into a DynamicCache (untimed), then G-1 forward
  calls with greedy argmax fed back are timed. That is `generate`'s inner loop without its
  logits processors and stopping checks, so it favours transformers;
- `generate`: `model.generate` on static batches, every sequence producing exactly O tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvforge.errors import KVForgeError
from kvforge.integrations.transformers import cache_argument
from kvforge.models.loader import ModelSource


def load_hf_peer(source: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The peer on `device` (the kvforge systems' device), in `dtype`; of a dummy model, the
    same random weights (drawn by name on `device`, as kvforge's are)."""
    from kvforge.tools.verify import load_transformers_model

    if source.kind == "dummy":
        return dummy_hf_peer(source, dtype, device)
    return load_transformers_model(source, device, dtype)


def dummy_hf_peer(source: ModelSource, dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.nn.Module:
    """transformers' model of a dummy source's config (kvforge's reading of it, written back
    as a config.json), built on `device` and filled by `fill_dummy_weights`, whose draws
    depend only on each parameter's name and shape, which the two models share."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvforge.models.dummy_weights import fill_dummy_weights
    from kvforge.models.loader import load_model_config
    from kvforge.models.swiftkv_checkpoint import hf_config_dict

    config = load_model_config(source)
    hf = hf_config_dict(config)
    hf_config = AutoConfig.for_model(**{key: value for key, value in hf.items() if key != "torch_dtype"})
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    fill_dummy_weights(model, config, source.seed)
    return model.eval()


def prefill(model: torch.nn.Module, prompts: Sequence[Sequence[int]]) -> float:
    """Seconds of one batched prompt forward with logits for the last position only."""
    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        out.logits[:, -1].argmax(dim=-1)
        _wait(model)
        return time.perf_counter() - start


def decode(model: torch.nn.Module, prompts: Sequence[Sequence[int]], gen: int) -> dict[str, Any]:
    """Prefill (untimed) then gen-1 timed greedy decode calls; returns seconds and tokens."""
    from transformers import DynamicCache

    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        _wait(model)
        start = time.perf_counter()
        for _ in range(gen - 1):
            out = model(input_ids=next_ids, **cache_argument(cache), use_cache=True, logits_to_keep=1)
            next_ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        _wait(model)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": len(prompts) * (gen - 1), "steps": gen - 1}


def _wait(model: torch.nn.Module) -> None:
    """On a GPU, wait for the queued kernels, so that a timed region ends with its work."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def pad_token_id(model: torch.nn.Module) -> int:
    """Prompts have equal length, so nothing is padded; generate still wants an id."""
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], output_len: int, batch: int) -> float:
    """Seconds to run every prompt through `model.generate` in static batches of `batch`."""
    pad = pad_token_id(model)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[first:first + batch], dtype=torch.long, device=model.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 num_beams=1, max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=pad)
            if out.shape[1] != ids.shape[1] + output_len:
                raise KVForgeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, "
                                   f"expected {output_len}")
    return time.perf_counter() - start
