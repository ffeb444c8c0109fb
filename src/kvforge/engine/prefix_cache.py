"""Automatic prefix caching: a request whose tokens begin like earlier ones takes their
K/V from the cache and computes only the rest. Plain Python (the cache method owns the
storage); the scheduler calls `admit` when a request (re)starts and `release` when one
leaves, the engine calls `published` after each step.

Two mechanisms, chosen by what the cache method can do:

- Page sharing (`cache.prefix_block_size` set: `full`). Full pages are named by a hash
  chained over the page's token ids and its parent page's name, so a name identifies the
  whole prefix up to the page's end. After a step every full page a request has committed
  is published; a new request takes the longest run of published pages that begins its
  tokens (reference counts in the block pool) and computes from there. Freed pages stay
  cached, least recently used first, and are reclaimed only when the pool needs them.
- Snapshots (`cache.can_fork`: `kivi`). A KIVI prefill chunk attends earlier chunks
  through their quantised pages, so its state depends on where chunks began, and a hit must
  begin where the run without prefix caching would begin a chunk too. Before a prompt's
  last prefill chunk runs, the engine forks the sequence (a snapshot of its state at the
  chunk's start, sharing its quantised pages); a later prompt that extends those tokens
  starts from a fork of the snapshot and computes the rest. A prompt prefilled alone is cut
  at multiples of the step's token budget, with or without a hit, so a conversation alone
  on the engine gets exactly the tokens it gets without prefix caching.
- Sequence continuation (every other method: `shadowkv`). Its stored state is not a
  function of whole pages (ShadowKV compresses the whole prompt at once), so a finished
  request's sequence is kept as it is, tokens and all, and the next request whose tokens
  extend it exactly (the next turn of a conversation: prompt + reply + new message) adopts
  that sequence and appends its new tokens, as if they were generated: cheaper than a
  recompression, but not what recomputing the whole prompt would store.

Kept sequences (snapshots and continuations) are evicted, oldest first, whenever an
allocation would fail, so they never block admission.

Invariants: at least the last token of a request is always computed (its logits choose
the next token), so a hit is at most num_tokens - 1 tokens; a hit changes nothing about
what is stored, only which steps stored it; every reference taken is given back when the
request finishes, is preempted or is aborted (`cache.free`).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvforge.engine.request import Request

_ROOT = b"kvforge-prefix"


def page_keys(tokens: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Chained names of the full pages of `tokens`, reusing the names in `known` (a prefix
    of the result computed earlier)."""
    keys = list(known)
    parent = keys[-1] if keys else _ROOT
    for start in range(len(keys) * block_size, len(tokens) - block_size + 1, block_size):
        page = tokens[start:start + block_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(4, "little", signed=True) for t in page)).digest()
        keys.append(parent)
    return keys


@dataclass
class PrefixStats:
    queries: int = 0  # admissions that looked for a prefix
    hits: int = 0  # admissions that found one
    queried_tokens: int = 0
    hit_tokens: int = 0
    continued_sequences: int = 0  # hits by continuation
    snapshots: int = 0  # snapshots taken (forks of a prompt at its last chunk's start)
    evicted_sequences: int = 0

    def as_dict(self) -> dict[str, float]:
        return {"prefix_queries": self.queries, "prefix_hits": self.hits, "prefix_queried_tokens": self.queried_tokens,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
                "prefix_continued_sequences": self.continued_sequences, "prefix_snapshots": self.snapshots,
                "prefix_evicted_sequences": self.evicted_sequences}


class PrefixCache:
    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.block_size: int | None = cache.prefix_block_size
        self.stats = PrefixStats()
        self.snapshots = not self.shares_pages and bool(getattr(cache, "can_fork", False))
        # seq id -> its tokens, least recently used first; snapshots take negative ids, which
        # requests (numbered from 0) never use.
        self._kept: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._snapshot_ids = itertools.count(-1, -1)

    @property
    def shares_pages(self) -> bool:
        return self.block_size is not None

    # -- the scheduler's hooks --------------------------------------------------------
    def admit(self, request: Request) -> int:
        """Before a request (re)starts from no computed tokens: attach what the cache holds
        of its tokens; returns the tokens attached (the request's num_computed_tokens)."""
        tokens = request.tokens(0, request.num_tokens)
        limit = len(tokens) - 1
        self.stats.queries += 1
        self.stats.queried_tokens += limit
        if self.shares_pages:
            request.page_keys = page_keys(tokens, self.block_size, request.page_keys)
            hit = self.cache.match_prefix(request.seq_id, request.page_keys, limit)
        elif self.snapshots:
            hit = self._fork_snapshot(request, tokens, limit)
        else:
            hit = self._continue(request, tokens, limit)
        if hit:
            self.stats.hits += 1
            self.stats.hit_tokens += hit
        return hit

    def cancel(self, request: Request, seq_id: int) -> None:
        """Undo an `admit` whose first allocation failed: the request waits again holding
        nothing (a continued sequence is kept again, attached pages are released)."""
        if self.shares_pages or self.snapshots:
            self.cache.free(request.seq_id)
        else:
            self._kept[request.seq_id] = tuple(request.tokens(0, request.num_computed_tokens))
        self.stats.queries -= 1  # it is asked again when it is admitted
        self.stats.queried_tokens -= request.num_tokens - 1
        self.stats.hits -= 1
        self.stats.hit_tokens -= request.num_computed_tokens
        request.seq_id, request.num_computed_tokens = seq_id, 0

    def published(self, request: Request) -> None:
        """After a step: offer the request's newly full pages."""
        if not self.shares_pages or request.num_computed_tokens < self.block_size:
            return
        if len(request.page_keys) * self.block_size + self.block_size <= request.num_computed_tokens:
            request.page_keys = page_keys(request.tokens(0, request.num_computed_tokens), self.block_size,
                                          request.page_keys)
        self.cache.publish_prefix(request.seq_id, request.page_keys)

    def before_step(self, chunks: list[Any]) -> None:
        """Snapshots: before a prompt's last prefill chunk runs, keep a fork of the sequence
        as it stands (tokens [0, chunk start)) unless one is kept already. Best effort: no
        snapshot when memory for it cannot be had now."""
        if not self.snapshots:
            return
        for chunk in chunks:
            request = chunk.request
            if chunk.start == 0 or chunk.end != request.num_prompt_tokens or request.num_output_tokens:
                continue
            tokens = tuple(request.tokens(0, chunk.start))
            same = next((seq_id for seq_id, kept in self._kept.items() if kept == tokens), None)
            if same is not None:
                self._kept.move_to_end(same)
                continue
            snapshot = next(self._snapshot_ids)
            if self.cache.fork(request.seq_id, snapshot):
                self._kept[snapshot] = tokens
                self.stats.snapshots += 1

    def release(self, request: Request, keep: bool) -> None:
        """A request leaves the cache. Page sharing: its pages go back to the pool (the
        published ones stay cached). Continuation: a finished request's sequence is kept
        (`keep`) for a request that extends it; otherwise it is freed."""
        finished_generating = 0 < request.num_computed_tokens == request.num_tokens - 1
        if keep and finished_generating and not self.shares_pages and not self.snapshots:
            self._kept[request.seq_id] = tuple(request.tokens(0, request.num_computed_tokens))
        else:
            self.cache.free(request.seq_id)

    def evict_one(self) -> bool:
        """Free the least recently kept sequence (to make room); False if none is kept."""
        if not self._kept:
            return False
        seq_id, _ = self._kept.popitem(last=False)
        self.cache.free(seq_id)
        self.stats.evicted_sequences += 1
        return True

    def clear(self) -> None:
        while self.evict_one():
            pass

    @property
    def kept_sequences(self) -> int:
        return len(self._kept)

    # -- adoption -----------------------------------------------------------------------
    def _longest_kept(self, tokens: list[int], limit: int) -> tuple[int | None, int]:
        """The kept sequence with the most tokens (at most `limit`) that begin `tokens`."""
        best, best_len = None, 0
        for seq_id, kept in self._kept.items():
            n = len(kept)
            if best_len < n <= limit and tuple(tokens[:n]) == kept:
                best, best_len = seq_id, n
        return best, best_len

    def _fork_snapshot(self, request: Request, tokens: list[int], limit: int) -> int:
        """Start the request from a fork of the longest snapshot that begins its tokens."""
        best, best_len = self._longest_kept(tokens, limit)
        if best is None or not self.cache.fork(best, request.seq_id):
            return 0
        self._kept.move_to_end(best)
        return best_len

    def _continue(self, request: Request, tokens: list[int], limit: int) -> int:
        """Adopt the longest kept sequence whose tokens begin `tokens` (at most `limit`)."""
        best, best_len = self._longest_kept(tokens, limit)
        if best is None:
            return 0
        del self._kept[best]
        if self.cache.num_cached_tokens(best) != best_len:  # the method dropped it meanwhile
            self.cache.free(best)
            return 0
        request.seq_id = best  # the request continues in the kept sequence's storage
        self.stats.continued_sequences += 1
        return best_len
