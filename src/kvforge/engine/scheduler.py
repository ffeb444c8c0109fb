"""Continuous-batching scheduler (plain Python, no torch), in the vLLM v1 style.

Each step fills a token budget (`max_num_batched_tokens`): running requests first, oldest
first, each with the tokens it is missing (one for a decoding request, a chunk for one
still in its prompt); then waiting requests are admitted in arrival order while the
budget, `max_num_seqs` and the cache allow. There are no prefill and decode phases.

Memory: before a request is scheduled, the cache must make room for the tokens it will
hold after the step (`cache.allocate`). When a running request cannot grow, the newest
running request is preempted: its storage is freed and it goes back to the front of the
queue to be recomputed later (prompt and generated tokens alike).

Prefix caching (`prefix`, engine/prefix_cache.py): a request that (re)starts from zero
computed tokens first takes what the cache holds of its tokens; when memory runs out, kept
sequences of finished requests are evicted before any running request is preempted.

Invariants:
- the sum of scheduled tokens never exceeds max_num_batched_tokens;
- a request appears at most once per step;
- running requests hold cache storage, waiting ones hold none;
- no request is admitted in a step that had to preempt (it would likely be preempted next).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvforge.engine.prefix_cache import PrefixCache
from kvforge.engine.request import FinishReason, Request, RequestStatus
from kvforge.errors import require


class CacheAllocator(Protocol):
    def allocate(self, seq_id: int, num_tokens: int) -> bool: ...

    def free(self, seq_id: int) -> None: ...


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # index of the first token computed in this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def needs_logits(self) -> bool:
        """The chunk ends at the request's last token: its logits give the next token."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests that can never fit in the cache, finished with reason LENGTH.
    dropped: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, cache: CacheAllocator, max_num_batched_tokens: int, max_num_seqs: int,
                 lifetimes_fit: Callable[[list[Request]], bool] | None = None,
                 prefix: PrefixCache | None = None) -> None:
        """`lifetimes_fit` turns on reserving admission: a waiting request is admitted only if
        the cache holds the running requests and it, each at its whole lifetime, at once (a
        request admitted alone always is, so none waits forever)."""
        require(max_num_batched_tokens >= 1, "max_num_batched_tokens", max_num_batched_tokens, "must be >= 1")
        require(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "must be >= 1")
        self.cache = cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.lifetimes_fit = lifetimes_fit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.peak_running = 0
        self.num_preemptions = 0
        self.prefix = prefix

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests with reason ABORT; unknown or finished ids are ignored."""
        wanted = set(request_ids)
        aborted = [r for r in (*self.running, *self.waiting) if r.request_id in wanted]
        for request in aborted:
            self.finish(request, FinishReason.ABORT)
        return aborted

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request from the queues, release its storage and mark it finished. With
        prefix caching a request that ended normally may leave its sequence to the cache."""
        if request in self.running:
            self.running.remove(request)
            if self.prefix is not None:
                self.prefix.release(request, keep=reason in (FinishReason.STOP, FinishReason.LENGTH))
            else:
                self.cache.free(request.seq_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish(reason)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            take = min(request.num_tokens - request.num_computed_tokens, budget)
            if self._make_room(request, take, index, out):
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, take))
                budget -= take
                index += 1
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if not self._reservation_fits(request):
                    break
                started = self._attach_prefix(request)
                take = min(request.num_tokens - request.num_computed_tokens, budget)
                if not self._allocate(request, request.num_computed_tokens + take):
                    if started is not None:
                        self.prefix.cancel(request, started)
                    if self.running:
                        break
                    # Alone, with every kept prefix evictable: from scratch (growing an
                    # adopted prefix can need more than a fresh start), or never. Waiting on
                    # it would stall the engine (admission should have refused it: this is
                    # the net under that check).
                    take = min(request.num_tokens, budget)
                    if started is None or not self._allocate(request, take):
                        self.finish(request, FinishReason.LENGTH)
                        out.dropped.append(request)
                        continue
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, take))
                budget -= take
        self.peak_running = max(self.peak_running, len(self.running))
        return out

    def _reservation_fits(self, request: Request) -> bool:
        if self.lifetimes_fit is None or not self.running:
            return True
        return self.lifetimes_fit([*self.running, request])

    def _attach_prefix(self, request: Request) -> int | None:
        """A request starting from scratch takes the cached part of its tokens; returns its
        seq id before that (to undo it), or None when nothing was attached."""
        if self.prefix is None or request.num_computed_tokens or request.params.prompt_logprobs is not None:
            return None  # prompt logprobs need every prompt row computed
        before = request.seq_id
        hit = self.prefix.admit(request)
        if not hit:
            return None
        request.num_computed_tokens = hit
        return before

    def _allocate(self, request: Request, num_tokens: int) -> bool:
        """cache.allocate, evicting kept prefix sequences while that makes it succeed."""
        while not self.cache.allocate(request.seq_id, num_tokens):
            if self.prefix is None or not self.prefix.evict_one():
                return False
        return True

    def _make_room(self, request: Request, take: int, index: int, out: SchedulerOutput) -> bool:
        """Allocate for `request`, preempting newer requests as needed. False if the request
        itself had to go (preempted, or dropped when even alone it cannot fit)."""
        while not self._allocate(request, request.num_computed_tokens + take):
            victim = self.running[-1]
            if victim is request and index == 0:
                # Alone (every newer request is gone, none older) and still no room.
                self.finish(request, FinishReason.LENGTH)
                out.dropped.append(request)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request.seq_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
