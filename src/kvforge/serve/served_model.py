"""What the handlers share: the model's name and limits, its tokenizer, the engine, and the
checks and conversions every endpoint makes (model name, sampling fields, prompt limits).

Every check here raises `APIError` naming the parameter, the value and the rule, before the
request reaches the engine, so a bad request never touches the requests in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.engine.structured_output import StructuredOutputs
from kvforge.errors import ConfigError
from kvforge.serve.protocol import APIError, _GenerationFields, bad_request, is_neutral, unimplemented_fields
from kvforge.serve.structured_fields import structured_outputs_of

# Most completions one request may ask for per prompt (`n`), and in all (n x prompts, when
# n > 1): each is an engine request.
MAX_SAMPLES = 64
MAX_CHOICES = 1024


@dataclass(frozen=True)
class ModelInfo:
    """What is served beyond the name: shown in /v1/models (under "kvforge") and in the
    start-up banner, so a SwiftKV model or a quantized cache never looks like the plain
    model. `swiftkv` is the checkpoint directory laid over `base_model`, None without one."""

    base_model: str
    swiftkv: str | None = None
    cache: str = "full"
    dtype: str = "float32"
    weights: str = "checkpoint"  # or "dummy (random, seed N)": `--load-format dummy`, no tokenizer

    def as_dict(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "swiftkv": self.swiftkv, "cache": self.cache, "dtype": self.dtype,
                "weights": self.weights}

    def banner(self) -> str:
        swiftkv = f", swiftkv {self.swiftkv}" if self.swiftkv else ", no swiftkv"
        weights = "" if self.weights == "checkpoint" else f", weights {self.weights}: token ids only"
        return f"base model {self.base_model}{swiftkv}, cache {self.cache}, dtype {self.dtype}{weights}"


@dataclass
class ServedModel:
    name: str
    engine: AsyncEngine
    tokenizer: Any
    info: ModelInfo | None = None  # None: the name is all that is known (tests)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.token_text = lru_cache(maxsize=1 << 16)(self._token_text)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def prefix_caching(self) -> bool:
        return self.engine.engine.prefix is not None

    @property
    def vocab_size(self) -> int:
        return self.engine.engine.model.config.vocab_size

    def card(self) -> dict[str, Any]:
        """The /v1/models entry: OpenAI's keys, vLLM's max_model_len, and kvforge's own."""
        info = self.info or ModelInfo(self.name)
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "kvforge",
                "max_model_len": self.max_model_len, "kvforge": info.as_dict()}

    def check_available(self) -> None:
        if not self.engine.accepting:
            raise APIError(503, "the server is shutting down", error_type="service_unavailable")

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested != self.name:
            shown = repr(requested) if len(requested) <= 80 else repr(requested[:77]) + "..."
            raise APIError(404, f"The model {shown} does not exist: this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def _token_text(self, token_id: int) -> str:
        """The text of one token alone (as logprobs report tokens); '' without a tokenizer."""
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def require_tokenizer(self, param: str, value: Any) -> Any:
        """The tokenizer, or a 400 on `param` when the model has none (a dummy model)."""
        if self.tokenizer is None:
            raise bad_request(param, value, "must be token ids: this server's model has no tokenizer (weights "
                                             f"{self.info.weights if self.info else 'dummy'}); send prompt token ids "
                                             "to /v1/completions, with return_token_ids to get ids back")
        return self.tokenizer

    # -- prompts ----------------------------------------------------------------------
    def check_token_ids(self, ids: Sequence[int], param: str, where: str) -> None:
        """Token ids a client sent, checked before any use (decoding an id outside the
        vocabulary fails inside the tokenizer, or overflows past 2**64). `where` says
        which prompt of a batch, in the message."""
        vocab = self.vocab_size
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                shown = str(token_id) if len(str(token_id)) <= 40 else str(token_id)[:37] + "..."
                raise APIError(400, f"invalid {where + ' ' if where else ''}token id {shown} at position {position}: must be in "
                                    f"[0, {vocab}) (0 <= id < the vocabulary size)", param=param)

    def check_prompt(self, prompt: Sequence[int], param: str) -> None:
        """The engine's own limits (context, KV budget, vocabulary) as a 400 on `param`."""
        try:
            self.engine.engine.validate_prompt(prompt)
        except ConfigError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from exc

    def check_params(self, params: SamplingParams) -> None:
        """The engine's checks of a request's token ids (vocabulary, min_tokens) as a 400;
        its constraint is checked by `check_constraint`."""
        try:
            self.engine.engine.validate_params(params, constraint=False)
        except ConfigError as exc:
            raise bad_request(exc.parameter, exc.value, exc.rule) from exc

    async def check_constraint(self, params: SamplingParams) -> None:
        """A structured-output constraint compiled, on a worker thread (the first waits for
        the tokenizer's wrapping, up to seconds: the event loop goes on), or a 400."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.grammars.check, params.structured_outputs)
        except ConfigError as exc:
            raise bad_request(exc.parameter, exc.value, exc.rule) from exc

    def truncated(self, prompt: list[int], body: _GenerationFields) -> list[int]:
        """vLLM's `truncate_prompt_tokens`: the prompt cut to that many tokens (-1: the
        context less one, the room of one generated token), keeping its end (`truncation_side`
        "left", vLLM's default for generation) or its start ("right")."""
        keep, side = body.truncate_prompt_tokens, body.truncation_side or "left"
        if side not in ("left", "right"):
            raise bad_request("truncation_side", side, "must be 'left' (keep the last tokens) or 'right' (the first)")
        if keep is None:
            return prompt
        if keep == -1:
            keep = self.max_model_len - 1
        if not 1 <= keep <= self.max_model_len:
            raise bad_request("truncate_prompt_tokens", body.truncate_prompt_tokens,
                              f"must be -1 or an integer in [1, {self.max_model_len}] (the model's context)")
        if len(prompt) <= keep:
            return prompt
        return prompt[-keep:] if side == "left" else prompt[:keep]

    def max_tokens(self, requested: int | None, prompt_len: int, param: str, fit: bool = False) -> int:
        """`requested` checked against the context left after the prompt (None: all of it):
        prompt + max_tokens must fit max_model_len, a 400 otherwise, as OpenAI's API answers
        (vLLM 0.32 lowers max_tokens instead). `fit` (the client asked for a truncated
        prompt): lowered to the room left, as vLLM does."""
        room = self.max_model_len - prompt_len
        if requested is None:
            return room
        if requested < 1:
            raise bad_request(param, requested, "must be an integer >= 1")
        if fit:
            return min(requested, room)
        if requested > room:
            raise bad_request(param, requested,
                              f"must be <= {room}: the prompt has {prompt_len} tokens and the model's context "
                              f"is {self.max_model_len} tokens")
        return requested


def refuse_unimplemented(body: BaseModel) -> None:
    """A 400 naming the first field of `body` that kvforge declares but does not implement
    and that is not at its neutral value."""
    for name in unimplemented_fields(type(body)):
        value = getattr(body, name)
        if not is_neutral(name, value):
            raise bad_request(name, value, "is not supported by kvforge: must be omitted or null")


def samples_per_prompt(body: _GenerationFields) -> int:
    """OpenAI's `n`: how many completions each prompt gets (1 when omitted)."""
    if body.n is None:
        return 1
    if not 1 <= body.n <= MAX_SAMPLES:
        raise bad_request("n", body.n, f"must be an integer in [1, {MAX_SAMPLES}]")
    return body.n


def sample_params(params: SamplingParams, sample: int) -> SamplingParams:
    """The parameters of a prompt's `sample`-th completion (of n): with a seed, seed +
    sample (as vLLM's parallel sampling), so the n completions differ and each repeats; without
    one, each already has its own random stream."""
    if params.seed is None or sample == 0:
        return params
    return replace(params, seed=(params.seed + sample) % 2**64)


def sampling_params(body: _GenerationFields, max_tokens: int, vocab_size: int,
                    tool_constraint: StructuredOutputs | None = None, **logprob_fields: Any) -> SamplingParams:
    """The engine's SamplingParams from the fields both endpoints share. Fields OpenAI
    defines that kvforge does not implement must keep their neutral value.
    `tool_constraint`: a chat's tool choice shapes the text (one constraint per request)."""
    refuse_unimplemented(body)
    samples = samples_per_prompt(body)
    if body.best_of not in (None, samples):
        raise bad_request("best_of", body.best_of, f"only best_of=n ({samples}) is supported (or omit it)")
    structured = structured_outputs_of(body, tool_constraint)
    logit_bias = {}
    for key, value in (body.logit_bias or {}).items():  # JSON keys are strings: token ids in decimal
        # (the length bound before int(): Python refuses to convert thousands of digits)
        if not (key.isascii() and key.isdigit() and len(key) <= 12 and int(key) < vocab_size):
            raise bad_request("logit_bias", key if len(key) <= 40 else key[:37] + "...",
                              f"keys must be token ids in [0, {vocab_size}) (the vocabulary), written as strings")
        if int(key) in logit_bias:  # "7" and "07": one id twice, whose value would be a guess
            raise bad_request("logit_bias", key, f"names token id {int(key)} twice")
        logit_bias[int(key)] = value
    top_k = body.top_k or 0
    if top_k < -1:
        raise bad_request("top_k", top_k, "must be >= 1, or 0 or -1 to disable top-k")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=body.min_tokens or 0,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(top_k, 0), top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
            min_p=0.0 if body.min_p is None else body.min_p,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0, presence_penalty=body.presence_penalty or 0.0,
            logit_bias=logit_bias, allowed_token_ids=body.allowed_token_ids,
            stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=bool(body.ignore_eos),
            include_stop_str_in_output=bool(body.include_stop_str_in_output), structured_outputs=structured,
            skip_special_tokens=body.skip_special_tokens is not False, bad_words=tuple(body.bad_words or ()),
            **logprob_fields)
    except ConfigError as exc:
        raise bad_request(exc.parameter, exc.value, exc.rule) from exc
