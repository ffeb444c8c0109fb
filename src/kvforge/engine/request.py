"""A generation request and its lifecycle state (plain Python, no torch).

There is no prefill or decode phase: a request has `num_tokens` (prompt + generated) and
`num_computed_tokens` (tokens whose K/V the cache holds). Each step computes some of the
missing tokens; when the last one is computed its logits give the next token.

Invariants:
- 0 <= num_computed_tokens <= num_tokens;
- a running request that is preempted drops its cache and restarts from
  num_computed_tokens = 0, recomputing prompt and generated tokens;
- once finished, a request never changes again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine.sampling import SamplingParams, TopLogprobs
from kvforge.engine.stop_strings import pending_stop_length


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # rejected (bad input)


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0


@dataclass
class Request:
    request_id: str
    seq_id: int  # the cache's handle for this request's storage
    prompt_token_ids: list[int]
    params: SamplingParams
    # Token ids that end generation unless params.ignore_eos (the model's EOS ids).
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    # How often each id was generated (frequency and presence penalties), kept as tokens are
    # appended (`append_output`) so a step does not count the whole output again.
    output_counts: dict[int, int] = field(default_factory=dict)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token computed so far (None for
    # the first token, which nothing predicts). Kept across preemption: recomputed prompt
    # rows are not scored twice.
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    output_text: str = ""
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    generator: Any = None  # torch.Generator of this request (set by the engine)
    detokenizer: Any = None  # IncrementalDetokenizer (set by the engine when it has a tokenizer)
    grammar: Any = None  # llguidance matcher of params.structured_outputs (set by the engine)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (set by the engine)
    # Position in the output text from which stop strings are searched next.
    stop_search_from: int = 0
    # Characters of output_text delivered so far (RequestOutput.text); the rest is held
    # back while a stop string may still claim it (see release_text).
    num_released_chars: int = 0
    # Names of the request's full pages for prefix caching (engine/prefix_cache.py), kept
    # as they are computed.
    page_keys: list[bytes] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.output_counts[token] = self.output_counts.get(token, 0) + 1

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + outputs, without copying the whole sequence."""
        prompt = self.prompt_token_ids
        split = len(prompt)
        if end <= split:
            return prompt[start:end]
        if start >= split:
            return self.output_token_ids[start - split:end - split]
        return prompt[start:] + self.output_token_ids[:end - split]

    @property
    def released_text(self) -> str:
        """The output text delivered so far: the join of every delta."""
        return self.output_text[:self.num_released_chars]

    def release_text(self) -> str:
        """The output text not delivered yet that no stop string can still claim, marked
        delivered: while the request runs, a suffix that is a proper prefix of a stop string
        stays back; once it has finished, everything left goes.

        The released part never shrinks: a stop string found later starts at or after it,
        because every suffix that could begin a match was held back."""
        end = len(self.output_text)
        if not self.is_finished and not self.params.include_stop_str_in_output:  # (kept either way: nothing to hold)
            end -= pending_stop_length(self.output_text, self.params.stop)
        piece = self.output_text[self.num_released_chars:end]
        self.num_released_chars = max(self.num_released_chars, end)
        return piece

    def finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = time.perf_counter()
