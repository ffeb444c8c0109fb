"""`POST /v1/completions`: prompts as text or token ids (one or a batch), streaming or not,
logprobs with `echo` (what lm-eval's `local-completions` scores log-likelihood with).

`max_tokens=0` is allowed with `echo` only: the prompt and its logprobs come back and
nothing is generated (the engine samples one token, which is not reported).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from kvforge.models.tokenizer import encode_prompt
from kvforge.serve.logprobs import CompletionLogprobs, TokenText, token_id_text
from kvforge.serve.protocol import CompletionRequest, bad_request
from kvforge.serve.served_model import (
    MAX_CHOICES,
    ServedModel,
    sample_params,
    samples_per_prompt,
    sampling_params,
)
from kvforge.serve.shared_prefill import after_first_sample
from kvforge.serve.streams import DONE, ending_with_error_event, last_items, outputs, sse, unless_disconnected


@dataclass(frozen=True)
class _Job:
    """One completion of one prompt of a request: choice `index` = prompt number x n + sample."""

    index: int
    sample: int  # which of the prompt's n completions (0 counts the prompt's tokens in the usage)
    prompt: list[int]
    text: str  # the prompt as text (what echo returns)
    params: SamplingParams


@dataclass(frozen=True)
class _Options:
    echo: bool
    logprobs: int | None
    hidden: bool  # max_tokens=0 with echo: report the prompt only
    return_token_ids: bool
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: logprobs show "token_id:<id>"

    def logprobs_builder(self, token_text: TokenText) -> CompletionLogprobs:
        return CompletionLogprobs(token_text, shown=token_id_text if self.tokens_as_ids else None)


class CompletionHandler:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    async def create(self, body: CompletionRequest, raw: Request) -> Any:
        served = self.served
        served.check_name(body.model)
        served.check_available()
        options, jobs = self._jobs(body)
        await served.check_constraint(jobs[0].params)  # (one constraint for every prompt of the request)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        streams = after_first_sample([served.engine.generate(job.prompt, job.params, f"{request_id}-{job.index}",
                                                             arrival) for job in jobs],
                                     [job.sample for job in jobs], served.prefix_caching)
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": served.name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(head, jobs, streams, options, usage)
            return StreamingResponse(ending_with_error_event(events), media_type="text/event-stream")
        finals = await unless_disconnected(raw, last_items(streams))
        choices = [self._choice(job, out, options) for job, out in zip(jobs, finals)]
        return JSONResponse({**head, "choices": choices, "usage": _usage(jobs, finals, options)})

    # -- request -> engine inputs -----------------------------------------------------
    def _jobs(self, body: CompletionRequest) -> tuple[_Options, list[_Job]]:
        served = self.served
        if body.suffix:
            raise bad_request("suffix", body.suffix, "is not supported by kvforge: must be empty or omitted")
        logprobs = body.logprobs
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request("logprobs", logprobs, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        echo = bool(body.echo)
        if body.max_tokens == 0 and not echo:
            raise bad_request("max_tokens", 0, "must be >= 1 (0 is allowed only with echo=true)")
        hidden = body.max_tokens == 0
        options = _Options(echo, logprobs, hidden, bool(body.return_token_ids), bool(body.return_tokens_as_token_ids))
        samples = samples_per_prompt(body)
        prompts = self._prompts(body.prompt)
        if samples > 1 and samples * len(prompts) > MAX_CHOICES:
            raise bad_request("n", samples, f"times the {len(prompts)} prompts must be <= {MAX_CHOICES} completions")
        jobs = []
        for number, (whole, text) in enumerate(prompts):
            prompt = served.truncated(whole, body)
            if len(prompt) < len(whole):  # echo returns the prompt the model saw
                text = served.tokenizer.decode(prompt) if served.tokenizer is not None else ""
            served.check_prompt(prompt, "prompt")
            max_tokens = 1 if hidden else served.max_tokens(body.max_tokens, len(prompt), "max_tokens",
                                                                fit=body.truncate_prompt_tokens is not None)
            params = sampling_params(body, max_tokens, served.vocab_size, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                                     prompt_logprobs=(logprobs or 0) if echo and logprobs is not None else None)
            served.check_params(params)
            if params.stop and served.tokenizer is None:
                raise bad_request("stop", list(params.stop), "needs text, and this server's model has no tokenizer: "
                                                             "use stop_token_ids")
            jobs += [_Job(number * samples + sample, sample, prompt, text, sample_params(params, sample))
                     for sample in range(samples)]
        return options, jobs

    def _prompts(self, prompt: str | list[int] | list[str] | list[list[int]]) -> list[tuple[list[int], str]]:
        """(token ids, text) per prompt: a string, token ids, or a non-empty list of either."""
        served = self.served
        if isinstance(prompt, str):
            return [(encode_prompt(served.require_tokenizer("prompt", prompt), prompt, chat=False), prompt)]
        if not prompt:
            raise bad_request("prompt", prompt, "must be a string, token ids or a non-empty list of either")
        if isinstance(prompt[0], str):
            tokenizer = served.require_tokenizer("prompt", prompt[0])
            return [(encode_prompt(tokenizer, text, chat=False), text) for text in prompt]  # type: ignore[misc]
        batch = [prompt] if isinstance(prompt[0], int) else prompt
        for index, ids in enumerate(batch):
            served.check_token_ids(ids, "prompt", "prompt" if batch is not prompt else f"prompt[{index}]")  # type: ignore[arg-type]
        decode = served.tokenizer.decode if served.tokenizer is not None else (lambda ids: "")
        return [(list(ids), decode(ids)) for ids in batch]  # type: ignore[misc]

    # -- engine outputs -> response ---------------------------------------------------
    def _choice(self, job: _Job, out: RequestOutput, options: _Options) -> dict[str, Any]:
        logprobs = None
        if options.logprobs is not None:
            builder = options.logprobs_builder(self.served.token_text)
            if options.echo:
                builder.add(job.prompt, out.prompt_logprobs or [], out.prompt_top_logprobs)
            if not options.hidden:
                builder.offset = len(job.text) if options.echo else 0
                builder.add(out.token_ids, out.logprobs or [], out.top_logprobs)
            logprobs = builder.take()
        text = "" if options.hidden else out.text
        choice: dict[str, Any] = {"index": job.index, "text": job.text + text if options.echo else text,
                                  "logprobs": logprobs, "finish_reason": _finish_reason(out, options)}
        if options.return_token_ids:
            choice["prompt_token_ids"] = job.prompt
            choice["token_ids"] = [] if options.hidden else out.token_ids
        return choice

    async def _events(self, head: dict[str, Any], jobs: list[_Job], streams: list[AsyncIterator[RequestOutput]],
                      options: _Options, include_usage: bool) -> AsyncIterator[str]:
        builders = [options.logprobs_builder(self.served.token_text) for _ in jobs]
        finals: list[RequestOutput | None] = [None] * len(jobs)
        async with aclosing(outputs(streams)) as merged:  # a bug in this loop aborts the requests now
            async for index, out in merged:
                job, builder = jobs[index], builders[index]
                first = finals[index] is None
                finals[index] = out
                text = "" if options.hidden else out.new_text
                new_ids = [] if options.hidden else out.new_token_ids
                if first and options.echo:
                    text = job.text + text
                    if options.logprobs is not None:
                        builder.add(job.prompt, out.prompt_logprobs or [], out.prompt_top_logprobs)
                        builder.offset = len(job.text)
                if options.logprobs is not None and new_ids:
                    count = len(new_ids)
                    builder.add(new_ids, (out.logprobs or [])[-count:], (out.top_logprobs or [])[-count:] or None)
                choice: dict[str, Any] = {"index": job.index, "text": text,
                                          "logprobs": builder.take() if options.logprobs is not None else None,
                                          "finish_reason": _finish_reason(out, options) if out.finished else None}
                if options.return_token_ids:
                    choice["token_ids"] = new_ids
                    if first:
                        choice["prompt_token_ids"] = job.prompt
                yield sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
        if include_usage:
            yield sse({**head, "choices": [], "usage": _usage(jobs, finals, options)})
        yield DONE


def _finish_reason(out: RequestOutput, options: _Options) -> str | None:
    return "length" if options.hidden else out.finish_reason


def _usage(jobs: list[_Job], finals: list[RequestOutput | None], options: _Options) -> dict[str, int]:
    prompt = sum(len(job.prompt) for job in jobs if job.sample == 0)  # once per prompt, whatever n
    completion = 0 if options.hidden else sum(len(out.token_ids) for out in finals if out is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
