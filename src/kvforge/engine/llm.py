"""`LLM`: the offline facade. Load a model once, then `generate` or `stream`.

Prompts may be text (encoded as is), token ids, or chat messages
(`[{"role": "user", "content": ...}, ...]`, rendered with the model's chat template).
A `load_format="dummy"` model (random weights at a config's shapes) has no tokenizer: token
ids in, token ids out (`output.text` stays empty).
A request that is invalid on its own (empty, too long for the context or the KV budget)
comes back with `finish_reason == "error"` and a message; the others run normally.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm.auto import tqdm

from kvforge.cache.registry import create_cache, parse_cache_spec
from kvforge.compute_dtype import resolve_dtype
from kvforge.devices import resolve_device
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.request import FinishReason, Request
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError, require
from kvforge.models.loader import load_model, parse_dtype
from kvforge.models.tokenizer import encode_prompt, has_chat_template, load_tokenizer
from kvforge.sizes import check_host_budget, parse_bytes

Messages = Sequence[Mapping[str, str]]
Prompt = str | Sequence[int] | Messages


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and all(
        isinstance(m, Mapping) and "role" in m for m in prompt)


class LLM:
    def __init__(self, model: str = "smollm2-135m", cache: str = "full", dtype: str = "auto",
                 kv_budget: str | int = "1GiB", max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 cache_options: Sequence[str] | None = None, device: str | torch.device = "cpu",
                 swiftkv: str | None = None, admission: str = "optimistic", step_timing: bool = False,
                 prefix_caching: bool = True, early_exit: float | None = None, enforce_eager: bool = False,
                 max_seq_len_to_capture: int = 8192, load_format: str = "auto", prepack_weights: str = "auto") -> None:
        # Everything that can be wrong with the arguments fails before weights load.
        where = resolve_device(device)  # ConfigError, not torch's assertion, on a torch without CUDA
        spec = parse_cache_spec(cache, list(cache_options or []))
        resolved, self.dtype_reason = resolve_dtype(dtype, where)  # auto: bfloat16 on a CPU with bf16 hardware
        torch_dtype = parse_dtype(resolved)
        self.dtype = torch_dtype
        budget = parse_bytes(kv_budget) if where.type != "cpu" else check_host_budget(kv_budget)  # before loading
        config = EngineConfig(kv_budget_bytes=budget, max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, max_model_len=max_model_len, admission=admission,
                              step_timing=step_timing, prefix_caching=prefix_caching, enforce_eager=enforce_eager,
                              max_seq_len_to_capture=max_seq_len_to_capture, prepack_weights=prepack_weights)
        if early_exit is not None:  # the range before weights load; the head once the config is known
            require(0.0 < early_exit <= 1.0, "early_exit", early_exit, "must be a probability in (0, 1]")
        self.model, self.source = load_model(model, dtype=torch_dtype, device=where, swiftkv=swiftkv,
                                             load_format=load_format)
        if early_exit is not None:
            set_early_exit = getattr(self.model, "set_early_exit", None)
            require(set_early_exit is not None, "early_exit", early_exit,
                    "needs a SwiftKV model with an early-exit head (--swiftkv DIR)")
            set_early_exit(early_exit)
        self.tokenizer = None if self.source.kind == "dummy" else load_tokenizer(self.source)
        layout = self.model.cache_layout()
        if max_model_len is not None:  # LLMEngine bounds sequences by the smaller of the two too
            layout = replace(layout, max_sequence_tokens=min(max_model_len, layout.max_sequence_tokens or max_model_len))
        kv_cache = create_cache(spec, layout, config.kv_budget_bytes, torch_dtype, where)
        self.cache_spec = spec
        self.engine = LLMEngine(self.model, kv_cache, self.tokenizer, config)

    def start_up_lines(self) -> list[str]:
        """What a command prints at start-up about the choices made for this machine: the
        compute dtype (when `dtype` was auto), the form of a bf16 model's prefill products, the
        weights' prepacking and malloc's settings (on a CPU), and how decode steps run (CUDA
        graphs captured, at what cost, or why eagerly; on CUDA), and what the cache method did
        at start-up (e.g. RAM page-locked for ShadowKV's slow tier)."""
        report = self.engine.prepack_report
        return [line for line in (self.dtype_reason, self.engine.bf16_report, report and report.describe(),
                                  self.engine.malloc_report, self.engine.cache.start_up_line(),
                                  self.engine.graphs_report) if line]

    @property
    def is_chat_model(self) -> bool:
        return has_chat_template(self.tokenizer)

    def encode(self, prompt: Prompt) -> list[int]:
        if self.tokenizer is None and not _is_token_ids(prompt):
            raise ConfigError("prompt", type(prompt).__name__, f"must be token ids: the model has no tokenizer "
                                                               f"(load_format='dummy', weights {self.source.weights})")
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt, chat=False)
        if _is_token_ids(prompt):
            return list(prompt)
        if _is_messages(prompt):
            if not self.is_chat_model:
                raise ConfigError("prompt", "chat messages", "need a model with a chat template")
            return encode_prompt(self.tokenizer, prompt, chat=True)
        raise ConfigError("prompt", type(prompt).__name__, "must be text, token ids or chat messages")

    # -- batch generation -------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        prompt_list = self._as_prompt_list(prompts)
        param_list = self._as_param_list(params, len(prompt_list))
        results: dict[str, RequestOutput] = {}
        order = [self._submit(p, sp, results) for p, sp in zip(prompt_list, param_list)]
        bar = tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm or len(order) < 2)
        bar.update(len(results))
        generated = 0
        start = time.perf_counter()
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                generated += len(output.new_token_ids)
                if output.finished:
                    results[output.request_id] = output
                    bar.update(1)
            bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}", refresh=False)
        bar.close()
        return [results[request_id] for request_id in order]

    # -- streaming --------------------------------------------------------------------
    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output as it changes (`new_text` / `new_token_ids` hold the
        delta); requests rejected on submission are yielded first, already finished."""
        prompt_list = self._as_prompt_list(prompts)
        param_list = self._as_param_list(params, len(prompt_list))
        rejected: dict[str, RequestOutput] = {}
        for prompt, sp in zip(prompt_list, param_list):
            self._submit(prompt, sp, rejected)
        yield from rejected.values()
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()

    # -- helpers ----------------------------------------------------------------------
    def _submit(self, prompt: Prompt, params: SamplingParams, rejected: dict[str, RequestOutput]) -> str:
        try:
            return self.engine.add_request(self.encode(prompt), params)
        except ConfigError as exc:
            request = Request(f"rejected-{len(rejected)}-{id(prompt)}", -1, [], params)
            request.error = str(exc)
            request.finish(FinishReason.ERROR)
            rejected[request.request_id] = RequestOutput.of(request, [], "")
            return request.request_id

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or _is_token_ids(prompts) or _is_messages(prompts):
            return [prompts]
        return list(prompts)

    @staticmethod
    def _as_param_list(params: SamplingParams | Sequence[SamplingParams] | None, count: int
                       ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ConfigError("params", len(params), f"must be one SamplingParams or one per prompt ({count})")
        return list(params)

