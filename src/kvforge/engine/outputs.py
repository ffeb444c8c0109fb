"""What the engine reports about a request: final results and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.engine.request import Request
from kvforge.engine.sampling import TopLogprobs


@dataclass(frozen=True)
class RequestMetricsReport:
    prompt_tokens: int
    output_tokens: int
    time_to_first_token: float | None  # seconds from arrival to the first generated token
    time_per_output_token: float | None  # mean seconds between later tokens
    latency: float | None  # seconds from arrival to finish
    num_preemptions: int

    @classmethod
    def of(cls, request: Request) -> RequestMetricsReport:
        m = request.metrics
        ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
        tpot = None
        if m.first_token_time is not None and m.finish_time is not None and request.num_output_tokens > 1:
            tpot = (m.finish_time - m.first_token_time) / (request.num_output_tokens - 1)
        latency = None if m.finish_time is None else m.finish_time - m.arrival_time
        return cls(request.num_prompt_tokens, request.num_output_tokens, ttft, tpot, latency,
                   m.num_preemptions)


@dataclass(frozen=True)
class RequestOutput:
    """State of a request after a step. `new_token_ids`/`new_text` are what this step added
    (the streaming delta); `token_ids`/`text` are everything so far. `text` is always the
    concatenation of every `new_text` of the request: while it runs, a suffix of the
    generated text that a stop string may still claim is held back (Request.release_text),
    so no delta shows text the final output cuts."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[float] | None
    error: str | None
    metrics: RequestMetricsReport
    # With params.top_logprobs: the most likely ids at each generated position.
    top_logprobs: list[TopLogprobs] | None = None
    # With params.prompt_logprobs, once the whole prompt is computed (None before): one
    # entry per prompt token, None for the first; and the most likely ids at each position.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None

    @classmethod
    def of(cls, request: Request, new_token_ids: list[int], new_text: str) -> RequestOutput:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            token_ids=list(request.output_token_ids),
            text=request.released_text,
            new_token_ids=new_token_ids,
            new_text=new_text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            logprobs=list(request.output_logprobs) if request.params.logprobs else None,
            error=request.error,
            metrics=RequestMetricsReport.of(request),
            top_logprobs=list(request.output_top_logprobs) if request.params.top_logprobs else None,
            prompt_logprobs=(request.prompt_logprobs if request.params.prompt_logprobs is not None
                             and len(request.prompt_logprobs) == request.num_prompt_tokens else None),
            prompt_top_logprobs=(request.prompt_top_logprobs if request.params.prompt_logprobs
                                 and len(request.prompt_logprobs) == request.num_prompt_tokens else None),
        )
