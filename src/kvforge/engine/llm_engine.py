"""The engine: scheduler + runner + sampler, one `step()` at a time.

`add_request` validates a request alone and raises ConfigError if it can never run (empty
prompt, prompt beyond the context, prompt larger than the whole KV budget, token ids
outside the vocabulary); nothing else in the engine is touched, so other requests go on.
`step()` schedules, runs the model once, samples, applies stop rules and returns the
outputs of every request that changed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvforge.cache.base import CacheMethod
from kvforge.engine.bad_words import bad_word_sequences, banned_by_bad_words
from kvforge.engine.decode_graphs import CaptureReport, DecodeGraphs
from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.grammar_matcher import ConstraintBroken, GrammarCompiler, advance, allowed_masks
from kvforge.engine.logit_adjustments import needs_output, needs_prompt_and_output
from kvforge.engine.outputs import RequestOutput
from kvforge.engine.prefix_cache import PrefixCache
from kvforge.engine.request import FinishReason, Request
from kvforge.engine.runner import ModelRunner, StepItem
from kvforge.engine.sampling import (
    SampleOutput,
    SamplingParams,
    banned_token_ids,
    make_generator,
    most_likely,
    sample,
)
from kvforge.engine.scheduler import ScheduledChunk, Scheduler
from kvforge.engine.stepping_thread import SteppingThreadCheck
from kvforge.engine.stop_strings import find_stop_match
from kvforge.errors import ConfigError
from kvforge.kernels.bf16_products import bf16_products
from kvforge.kernels.cpu_prepack import PrepackReport, available_memory_bytes, prepack_weights
from kvforge.kernels.triton_runtime import decode_warps
from kvforge.malloc_tuning import keep_freed_memory
from kvforge.models.causal_lm import CausalLM
from kvforge.sizes import format_bytes
from kvforge.step_timing import StepTimer


class LLMEngine:
    def __init__(self, model: CausalLM, cache: CacheMethod, tokenizer: Any | None = None,
                 config: EngineConfig | None = None) -> None:
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        limit = model.config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        bound = cache.layout.max_sequence_tokens  # the cache's stores are sized for no longer a sequence
        if bound is not None and bound < self.max_model_len:
            raise ConfigError("max_model_len", self.max_model_len,
                              f"must be <= the cache layout's max_sequence_tokens={bound} (build the cache from "
                              "a layout bounded by max_model_len, as LLM does)")
        self.runner = ModelRunner(model, cache)
        self.capture_report: CaptureReport | None = None
        self.graphs_report: str | None = None  # how decode steps run on CUDA, said at start-up
        if self.runner.device.type == "cuda":
            decode_warps()  # (a bad KVFORGE_TRITON_DECODE_WARPS fails here, not in a step or a capture)
            if self.config.enforce_eager:
                self.graphs_report = "decode steps run eagerly (--enforce-eager)"
            elif self.config.step_timing:  # the step timer reads the device between ops
                self.graphs_report = "decode steps run eagerly: the step timer (--step-timing) reads the device"
            else:
                graphs = DecodeGraphs(model, cache, self.config.max_cudagraph_capture_size or self.config.max_num_seqs,
                                      min(self.config.max_seq_len_to_capture, self.max_model_len), capture=True)
                self.capture_report = graphs.capture()
                self.graphs_report = graphs.describe(self.capture_report)
                self.runner.decode_graphs = graphs if graphs.enabled else None
        self.prepack_report: PrepackReport | None = None
        self.malloc_report: str | None = None
        self.bf16_report: str | None = None
        if self.runner.device.type == "cpu":
            self.malloc_report = keep_freed_memory()
            weights = list(model.prefill_linear_weights())
            # measured once per process by its first caller: normally here, on the thread that will step the engine
            products = bf16_products() if any(w.dtype == torch.bfloat16 for w in weights) else None
            with torch.no_grad():
                self.prepack_report = prepack_weights(weights, self.config.prepack_weights, available_memory_bytes(),
                                                      widen_bf16=products is not None and products.linear)
            if products is not None and products.linear and not self.prepack_report.widened:
                products = replace(products, linear=False, why=f"{products.why}; the linear layers stay bf16: "
                                   "their weights are not packed as float32 (--prepack-weights)")
            self.bf16_report = products and products.describe()
        lifetimes_fit = None
        if self.config.admission == "reserve":
            def lifetimes_fit(requests: list[Request]) -> bool:
                return cache.memory.fits_together([min(r.num_prompt_tokens + r.params.max_tokens, self.max_model_len)
                                            for r in requests])
        self.prefix = PrefixCache(cache) if self.config.prefix_caching else None
        self.scheduler = Scheduler(cache, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                                   lifetimes_fit, self.prefix)
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size, self.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.step_timer = StepTimer(self.runner.device) if self.config.step_timing else None
        self._last_step_kind = "prefill"  # of the latest step: every chunk past its prompt -> "decode"
        self._stepping_thread = SteppingThreadCheck(self.runner.device)  # (built here: this thread ran torch)

    # -- requests ---------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; raises ConfigError (leaving the engine untouched) if it is invalid.
        `arrival_time` (time.perf_counter seconds) backdates the request's metrics, e.g. to
        when a server received it."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError("params", type(params).__name__, "must be a SamplingParams")
        prompt = [int(t) for t in prompt_token_ids]
        self.validate_prompt(prompt)
        self.validate_params(params)
        number = next(self._ids)
        request_id = str(number) if request_id is None else str(request_id)
        if request_id in self._requests and not self._requests[request_id].is_finished:
            raise ConfigError("request_id", request_id, "must be unique among unfinished requests")
        request = Request(request_id, number, prompt, params, eos_token_ids=self.eos_token_ids)
        if arrival_time is not None:
            request.metrics.arrival_time = arrival_time
        if not params.greedy:
            request.generator = make_generator(params.seed, self.runner.device)
        if self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if params.structured_outputs is not None:
            request.grammar = self.grammars.matcher(params.structured_outputs)
        request.bad_word_ids = bad_word_sequences(self.tokenizer, params.bad_words)
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.abort(ids)
        for request in aborted:
            self._requests.pop(request.request_id, None)
        return [RequestOutput.of(r, [], r.release_text()) for r in aborted]

    def prefix_statistics(self) -> dict[str, float]:
        """Prefix-cache counters (empty with prefix caching off)."""
        if self.prefix is None:
            return {}
        return {**self.prefix.stats.as_dict(), "prefix_kept_sequences": self.prefix.kept_sequences}

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix: free the sequences kept for continuation and the
        cached pages (a benchmark repeat then starts cold)."""
        if self.prefix is not None:
            self.prefix.clear()
            self.cache.forget_prefixes()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens of unfinished requests whose K/V are not in the cache yet (progress of a prefill)."""
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self._requests.values())

    def validate_params(self, params: SamplingParams, constraint: bool = True) -> None:
        """Raise ConfigError if a request's token ids do not fit this model, or it could
        never choose a token (read-only: safe from another thread while the engine steps).
        `constraint`: compile its structured-output constraint too (a server does that part
        off its event loop: the first one may wait seconds for the tokenizer's wrapping)."""
        vocab = self.model.config.vocab_size
        outside = [token for token, _ in params.logit_bias if token >= vocab]
        if outside:
            raise ConfigError("logit_bias token id", outside[0], f"must be in [0, {vocab}) (the vocabulary)")
        allowed = params.allowed_token_ids
        if allowed is not None:
            if allowed[-1] >= vocab:  # (sorted)
                raise ConfigError("allowed_token_ids", allowed[-1], f"must be token ids in [0, {vocab}) (the vocabulary)")
            if set(allowed) <= banned_token_ids(params, self.eos_token_ids, 0):
                raise ConfigError("allowed_token_ids", list(allowed), f"are all stop or EOS ids, banned until "
                                  f"min_tokens={params.min_tokens} tokens: no token could be chosen")
        if constraint and params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        bad_word_sequences(self.tokenizer, params.bad_words)

    def validate_prompt(self, prompt: Sequence[int]) -> None:
        """Raise ConfigError if a prompt can never run here (read-only: safe to call from
        another thread while the engine steps)."""
        if not prompt:
            raise ConfigError("prompt", "", "must contain at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ConfigError("prompt token id", bad[0], f"must be in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ConfigError("prompt length", len(prompt),
                              f"must be < max_model_len={self.max_model_len} (room for at least one "
                              "generated token)")
        needed = self.cache.memory.sequence_bytes(len(prompt) + 1)
        capacity = self.cache.memory.capacity["fast"]
        if not self.cache.memory.fits_together([len(prompt) + 1]):
            raise ConfigError("kv_budget", capacity,
                              f"must hold this prompt of {len(prompt)} tokens ({needed} bytes needed)")

    @property
    def last_step_kind(self) -> str:
        """"decode" when the latest step computed no prompt token (every row generating), else "prefill"."""
        return self._last_step_kind

    # -- one step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, apply the stop rules; the outputs of every
        request that changed."""
        self._stepping_thread.check()
        if self.step_timer is None:
            return self._step()
        return self.step_timer.time_step(self._step, lambda: self._last_step_kind)

    def _step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        for request in scheduled.dropped:
            usable = format_bytes(self.cache.memory.capacity["fast"])
            shorter = " or a smaller max_tokens" if request.output_token_ids else ""
            request.error = (f"the KV cache ({usable} usable of kv_budget) cannot hold this sequence even alone at "
                             f"{request.num_tokens} tokens: give a larger kv_budget{shorter}")
            self._requests.pop(request.request_id, None)
            outputs[request.request_id] = RequestOutput.of(request, [], request.release_text())
        if not scheduled.chunks:
            return list(outputs.values())
        self.steps += 1
        decode = all(c.start >= c.request.num_prompt_tokens for c in scheduled.chunks)
        self._last_step_kind = "decode" if decode else "prefill"
        items = [self._item(chunk) for chunk in scheduled.chunks]
        if self.prefix is not None:
            self.prefix.before_step(scheduled.chunks)
        logits = self.runner.execute(items)  # the scheduler allocated
        now = time.perf_counter()
        sampling: list[Request] = []
        sample_rows: list[int] = []
        row = 0
        for chunk, item in zip(scheduled.chunks, items):
            request = chunk.request
            if _scores_prompt(request):
                self._score_prompt(request, chunk, logits[row:row + item.num_logits])
            row += item.num_logits
            request.num_computed_tokens = chunk.end
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            if chunk.needs_logits:
                sampling.append(request)
                sample_rows.append(row - 1)
            if self.prefix is not None:
                self.prefix.published(request)
        sampling, sample_rows, allowed = self._constraint_masks(sampling, sample_rows, logits, outputs)
        if sampling:
            rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
            chosen = self._sample(rows, sampling, allowed)
            for index, request in enumerate(sampling):
                if request.params.top_logprobs:
                    request.output_top_logprobs.append(chosen.top_logprobs[index])
                outputs[request.request_id] = self._accept(request, chosen.token_ids[index],
                                                           chosen.logprobs[index], now)
        return list(outputs.values())

    def _constraint_masks(self, sampling: list[Request], sample_rows: list[int], logits: torch.Tensor,
                          outputs: dict[str, RequestOutput]) -> tuple[list[Request], list[int], list | None]:
        """The allowed-id masks of the constrained requests about to sample (None for the
        others; None in all when none is constrained). A request whose matcher broke (in
        error, e.g. past a parser limit) ends here alone, with an error in `outputs`, and is
        dropped from the rows that sample."""
        constrained = [index for index, request in enumerate(sampling) if request.grammar is not None]
        if not constrained:
            return sampling, sample_rows, None
        masks, broken = allowed_masks([sampling[i].grammar for i in constrained], logits.shape[-1])
        masks = masks.to(logits.device)  # one copy to a GPU for the step, not one per row
        allowed: list[torch.Tensor | None] = [None] * len(sampling)
        for row, index in enumerate(constrained):
            allowed[index] = masks[row]
        for row, reason in broken:
            request = sampling[constrained[row]]
            outputs[request.request_id] = self._end_with_error(request, reason, [])
        if not broken:
            return sampling, sample_rows, allowed
        gone = {constrained[row] for row, _ in broken}
        keep = [i for i in range(len(sampling)) if i not in gone]
        return [sampling[i] for i in keep], [sample_rows[i] for i in keep], [allowed[i] for i in keep]

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                allowed: list[torch.Tensor | None] | None = None) -> SampleOutput:
        # Ids seen so far (prompt and output) for the rows whose repetition penalty reads them,
        # and output ids for their frequency and presence penalties (None elsewhere: a plain
        # step builds no list).
        seen = [r.prompt_token_ids + r.output_token_ids if needs_prompt_and_output(r.params) else None
                for r in requests]
        generated = [r.output_counts if needs_output(r.params) else None for r in requests]
        args = (logits, [r.params for r in requests], [r.generator for r in requests],
                [_banned(r) for r in requests], seen,
                generated, allowed)
        return sample(*args) if self.step_timer is None else self.step_timer.measure("sampling", sample, *args)

    def _item(self, chunk: ScheduledChunk) -> StepItem:
        request = chunk.request
        tokens = request.tokens(chunk.start, chunk.end)
        # A chunk of a request still scoring its prompt lies within the prompt (the prompt was
        # complete before any output existed), and every row of it gets logits.
        num_logits = len(tokens) if _scores_prompt(request) else int(chunk.needs_logits)
        return StepItem(request.seq_id, tokens, num_logits=num_logits,
                        decode=chunk.start >= request.num_prompt_tokens)

    def _score_prompt(self, request: Request, chunk: ScheduledChunk, logits: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens predicted by this chunk's rows (`logits`
        has one row per position of the chunk): the row of position p predicts token p + 1.
        After a preemption the recomputed rows that were already scored are skipped."""
        prompt = request.prompt_token_ids
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
            request.prompt_top_logprobs.append([])
        # Chunks run in order, so the next unscored token's predictor is in this chunk.
        first = len(request.prompt_logprobs) - 1
        stop = min(chunk.end, len(prompt) - 1)  # the row of position n - 1 samples the first output
        if stop <= first:
            return
        rows = logits[first - chunk.start:stop - chunk.start].float().log_softmax(dim=-1)
        targets = torch.tensor(prompt[first + 1:stop + 1], device=rows.device)
        request.prompt_logprobs.extend(rows.gather(1, targets.unsqueeze(1)).squeeze(1).tolist())
        count = request.params.prompt_logprobs or 0
        request.prompt_top_logprobs.extend(most_likely(rows, count) if count else [[] for _ in range(stop - first)])

    def _accept(self, request: Request, token: int, logprob: float | None, now: float) -> RequestOutput:
        """Append a sampled token and apply the stop rules."""
        params = request.params
        request.append_output(token)
        # The constraint is complete and nothing may follow: the request ends, this token's text kept.
        try:
            constraint_done = request.grammar is not None and advance(request.grammar, token)
        except ConstraintBroken as exc:
            return self._end_with_error(request, str(exc), [token])
        if logprob is not None:
            request.output_logprobs.append(logprob)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        stopped = token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)
        # A stop token's text is left out, unless include_stop_str_in_output (vLLM's; special
        # tokens, such as EOS, have no text: the detokenizer skips them)
        if request.detokenizer is not None and (not stopped or params.include_stop_str_in_output):
            request.detokenizer.add(token)
            request.output_text = request.detokenizer.text
            if params.stop and not stopped:
                # A stop string counts once min_tokens tokens exist: it must end in the
                # text of a token past that point (one ending earlier never stops).
                if request.num_output_tokens >= params.min_tokens:
                    match = find_stop_match(request.output_text, params.stop, request.stop_search_from)
                    # vLLM's include_stop_str_in_output: the text ends with the stop string found
                    cut = None if match is None else match[0] + (len(match[1]) if params.include_stop_str_in_output else 0)
                    if cut is not None:
                        request.output_text = request.output_text[:cut]
                        stopped = True
                request.stop_search_from = len(request.output_text)
        if stopped or constraint_done:
            self.scheduler.finish(request, FinishReason.STOP)
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self.scheduler.finish(request, FinishReason.LENGTH)
        output = RequestOutput.of(request, [token], request.release_text())
        if request.is_finished:
            self._requests.pop(request.request_id, None)
        return output

    def _end_with_error(self, request: Request, message: str, new_token_ids: list[int]) -> RequestOutput:
        """End one request (its constraint broke) and say why; the rest of the step goes on."""
        request.error = message
        self.scheduler.finish(request, FinishReason.ERROR)
        self._requests.pop(request.request_id, None)
        return RequestOutput.of(request, new_token_ids, request.release_text())


def _banned(request: Request) -> frozenset[int] | set[int]:
    """The ids a request may not choose now: stop and EOS ids before min_tokens, and the
    last token of any bad word the output would complete."""
    banned = banned_token_ids(request.params, request.eos_token_ids, request.num_output_tokens)
    if request.bad_word_ids:
        return banned | banned_by_bad_words(request.bad_word_ids, request.output_token_ids)
    return banned


def _scores_prompt(request: Request) -> bool:
    """The request asked for prompt log-probabilities and has not got all of them yet."""
    return request.params.prompt_logprobs is not None and len(request.prompt_logprobs) < request.num_prompt_tokens
