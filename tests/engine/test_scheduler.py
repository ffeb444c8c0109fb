"""Scheduler (pure Python, fake cache): budget, chunking, order, admission, preemption."""

from __future__ import annotations

import math

from kvforge.engine.request import FinishReason, Request, RequestStatus
from kvforge.engine.sampling import SamplingParams
from kvforge.engine.scheduler import Scheduler


class FakeCache:
    """Pages of 4 tokens out of a fixed pool; all-or-nothing growth, like PageTable."""

    def __init__(self, pages: int, block: int = 4) -> None:
        self.free_pages = pages
        self.block = block
        self.held: dict[int, int] = {}
        self.peak_used = 0
        self.total = pages

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        need = math.ceil(num_tokens / self.block) - self.held.get(seq_id, 0)
        if need > self.free_pages:
            return False
        if need > 0:
            self.free_pages -= need
            self.held[seq_id] = self.held.get(seq_id, 0) + need
        self.peak_used = max(self.peak_used, self.total - self.free_pages)
        return True

    def free(self, seq_id: int) -> None:
        self.free_pages += self.held.pop(seq_id, 0)


def make_request(number: int, prompt_len: int, max_tokens: int = 4) -> Request:
    return Request(str(number), number, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule and pretend the model ran: advance computed tokens, append one token to
    requests that got logits, finish them at max_tokens."""
    out = scheduler.schedule()
    assert out.num_tokens <= scheduler.max_num_batched_tokens
    assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
    for chunk in out.chunks:
        chunk.request.num_computed_tokens = chunk.end
        if chunk.needs_logits:
            chunk.request.output_token_ids.append(7)
            if chunk.request.num_output_tokens >= chunk.request.params.max_tokens:
                scheduler.finish(chunk.request, FinishReason.LENGTH)
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def test_budget_chunks_prompts_and_puts_decodes_first():
    scheduler = Scheduler(FakeCache(1000), max_num_batched_tokens=10, max_num_seqs=8)
    scheduler.add(make_request(0, 3))
    scheduler.add(make_request(1, 25))
    assert run_step(scheduler) == [("0", 0, 3), ("1", 0, 7)]
    # request 0 now decodes one token, first; request 1 continues its prompt in a chunk
    assert run_step(scheduler) == [("0", 3, 1), ("1", 7, 9)]
    assert run_step(scheduler) == [("0", 4, 1), ("1", 16, 9)]
    assert run_step(scheduler)[1] == ("1", 25, 1)  # prompt done, now decoding


def test_max_num_seqs_limits_admission():
    scheduler = Scheduler(FakeCache(1000), max_num_batched_tokens=100, max_num_seqs=2)
    for number in range(3):
        scheduler.add(make_request(number, 5))
    assert [r for r, _, _ in run_step(scheduler)] == ["0", "1"]
    assert scheduler.waiting[0].request_id == "2"


def test_admission_waits_for_memory():
    cache = FakeCache(pages=4)  # 16 tokens
    scheduler = Scheduler(cache, max_num_batched_tokens=100, max_num_seqs=8)
    scheduler.add(make_request(0, 12, max_tokens=2))
    scheduler.add(make_request(1, 12, max_tokens=2))
    assert [r for r, _, _ in run_step(scheduler)] == ["0"]
    while scheduler.running:
        run_step(scheduler)
    assert [r for r, _, _ in run_step(scheduler)] == ["1"]
    assert cache.peak_used <= cache.total


def test_preemption_of_newest_and_recompute():
    cache = FakeCache(pages=6)  # 24 tokens
    scheduler = Scheduler(cache, max_num_batched_tokens=100, max_num_seqs=8)
    old, new = make_request(0, 8, max_tokens=12), make_request(1, 8, max_tokens=12)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prompts fit: 4 pages
    preempted_seen = False
    while scheduler.has_unfinished():
        run_step(scheduler)
        if new.metrics.num_preemptions and not preempted_seen:
            preempted_seen = True
            assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
            assert old.status is RequestStatus.RUNNING  # the oldest keeps going
        assert cache.peak_used <= cache.total
    assert preempted_seen and scheduler.num_preemptions >= 1
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert old.metrics.num_preemptions == 0


def test_recompute_covers_generated_tokens():
    cache = FakeCache(pages=3)  # 12 tokens
    scheduler = Scheduler(cache, max_num_batched_tokens=100, max_num_seqs=8)
    first, second = make_request(0, 4, max_tokens=6), make_request(1, 4, max_tokens=6)
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(3):
        run_step(scheduler)
    assert second.metrics.num_preemptions == 1
    generated = second.num_output_tokens
    while first.status is not RequestStatus.FINISHED:
        run_step(scheduler)
    chunks = run_step(scheduler)
    # re-admitted: prompt and already generated tokens are computed again from 0
    assert ("1", 0, 4 + generated) in chunks


def test_request_that_cannot_fit_even_alone_is_dropped():
    cache = FakeCache(pages=2)  # 8 tokens
    scheduler = Scheduler(cache, max_num_batched_tokens=100, max_num_seqs=8)
    request = make_request(0, 6, max_tokens=10)
    scheduler.add(request)
    for _ in range(5):
        run_step(scheduler)
    assert request.finish_reason is FinishReason.LENGTH
    assert not scheduler.has_unfinished() and cache.free_pages == 2


def test_abort_frees_storage():
    cache = FakeCache(pages=10)
    scheduler = Scheduler(cache, max_num_batched_tokens=100, max_num_seqs=8)
    scheduler.add(make_request(0, 8))
    scheduler.add(make_request(1, 8))
    run_step(scheduler)
    aborted = scheduler.abort(["1", "unknown"])
    assert [r.request_id for r in aborted] == ["1"] and aborted[0].finish_reason is FinishReason.ABORT
    assert cache.held.keys() == {0}


def test_no_admission_in_a_step_that_preempted():
    """A step that had to preempt admits nobody, not even the request it just preempted,
    although the cache would now take it (it would likely be preempted again)."""

    class PressureOnce(FakeCache):
        """Refuses the first growth of sequence 0 (memory pressure), then has room for all."""

        def __init__(self) -> None:
            super().__init__(pages=1000)
            self.refused = False

        def allocate(self, seq_id: int, num_tokens: int) -> bool:
            if seq_id == 0 and num_tokens > 8 and not self.refused:
                self.refused = True
                return False
            return super().allocate(seq_id, num_tokens)

    scheduler = Scheduler(PressureOnce(), max_num_batched_tokens=100, max_num_seqs=8)
    old, new, small = make_request(0, 8, max_tokens=8), make_request(1, 8, max_tokens=8), make_request(2, 1)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    scheduler.add(small)
    out = scheduler.schedule()  # old's growth is refused once: new is preempted
    assert out.preempted == [new]
    assert [c.request for c in out.chunks] == [old]  # neither new nor small, though both would fit now
    assert new.status is RequestStatus.WAITING and small.status is RequestStatus.WAITING
    for chunk in out.chunks:
        chunk.request.num_computed_tokens = chunk.end
    assert [c.request for c in scheduler.schedule().chunks] == [old, new, small]  # the next step admits them


def test_a_waiting_request_that_cannot_start_even_alone_is_dropped_not_waited_on():
    """Admission (LLMEngine.validate_prompt) should refuse such a prompt; if a request still
    gets through, it is dropped (reported as an error by the engine) and the requests behind
    it run, instead of every later step waiting on it."""
    scheduler = Scheduler(FakeCache(4), max_num_batched_tokens=64, max_num_seqs=8)
    too_long, fits = make_request(0, 20), make_request(1, 6)
    scheduler.add(too_long)
    scheduler.add(fits)
    out = scheduler.schedule()
    assert out.dropped == [too_long] and too_long.finish_reason == FinishReason.LENGTH
    assert [c.request for c in out.chunks] == [fits] and not scheduler.waiting


class AdoptsUngrowablePrefix:
    """A prefix cache whose hit hands the request a kept sequence that cannot grow (as a
    compressed ShadowKV sequence can need more room to grow than a fresh start)."""

    def __init__(self, cache: FakeCache) -> None:
        self.cache = cache

    def admit(self, request: Request) -> int:
        request.seq_id, request.num_computed_tokens = 99, 8
        return 8

    def cancel(self, request: Request, seq_id: int) -> None:
        request.seq_id, request.num_computed_tokens = seq_id, 0

    def evict_one(self) -> bool:
        return False


def test_a_request_whose_adopted_prefix_cannot_grow_alone_starts_from_scratch():
    cache = FakeCache(4)
    cache.allocate = lambda seq_id, n, grow=cache.allocate: seq_id != 99 and grow(seq_id, n)
    scheduler = Scheduler(cache, max_num_batched_tokens=64, max_num_seqs=8, prefix=AdoptsUngrowablePrefix(cache))
    request = make_request(0, 12)
    scheduler.add(request)
    out = scheduler.schedule()
    assert not out.dropped and [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(request, 0, 12)]
    assert request.seq_id == 0 and cache.held == {0: 3}
