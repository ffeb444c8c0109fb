"""The mutations `make mutants` applies, one at a time: each breaks one invariant that
matters, and its tests must notice. Add one for every new invariant.

A mutation: a name, the file (from the repository root), an exact snippet that occurs
once in it, its replacement, the test targets that should fail, and why it matters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str


S = "src/kvforge/"
SHADOWKV = ("tests/cache/shadowkv/test_shadowkv_parts.py", "tests/cache/shadowkv/test_shadowkv.py")
KIVI = ("tests/cache/kivi",)
BUDGET = ("tests/cache/test_budget_invariant.py",)

MUTATIONS: list[Mutation] = [
    # -- ShadowKV ------------------------------------------------------------------------
    Mutation("shadowkv_basis_from_post_rope_keys", S + "cache/shadowkv/compress.py",
             "basis = key_basis(keys_pre.reshape(n, heads * dim), rank)",
             "basis = key_basis(keys_post.transpose(0, 1).reshape(n, heads * dim), rank)",
             SHADOWKV, "the paper's point: pre-RoPE keys are low-rank, post-RoPE keys are not"),
    Mutation("shadowkv_landmarks_from_pre_rope_keys", S + "cache/shadowkv/compress.py",
             "return ChunkData(coefficients, chunk_landmarks(keys_post, chunk),",
             "return ChunkData(coefficients, chunk_landmarks(keys_pre.transpose(0, 1).contiguous(), chunk),",
             SHADOWKV, "landmarks are scored against post-RoPE queries"),
    Mutation("shadowkv_outliers_highest_min_cosine", S + "cache/shadowkv/select.py",
             "torch.topk(min_cosine, count, dim=-1, largest=False)",
             "torch.topk(min_cosine, count, dim=-1, largest=True)",
             SHADOWKV, "outliers are the chunks worst summarised by their landmark"),
    Mutation("shadowkv_admission_forgets_fixed_state", S + "cache/shadowkv/memory.py",
             "needed = inner_bytes + chunk_pages * self.fast_chunk_bytes + fixed",
             "needed = inner_bytes + chunk_pages * self.fast_chunk_bytes",
             BUDGET, "the fast tier must stay within its budget"),
    Mutation("shadowkv_kernel_sums_group_scores", S + "cache/shadowkv/cpu_decode.cpp",
             "w.score[i] = std::max(w.score[i], p[i]);", "w.score[i] = w.score[i] + p[i];",
             ("tests/cache/shadowkv/test_shadowkv_cpu_decode.py",),
             "a KV head's chunk score is the max over its query heads (C++ kernel)"),
    # -- KIVI ----------------------------------------------------------------------------
    Mutation("kivi_codes_round_down", S + "cache/kivi/quant.py",
             "codes = torch.round((xg - zero.float().unsqueeze(-1)) / safe)",
             "codes = torch.floor((xg - zero.float().unsqueeze(-1)) / safe)",
             KIVI, "round to nearest: the error bound is scale / 2"),
    Mutation("kivi_scale_over_2_to_the_bits", S + "cache/kivi/quant.py",
             "scale = _round_toward((high - zero.float()) / levels, float(\"inf\"))",
             "scale = _round_toward((high - zero.float()) / (levels + 1), float(\"inf\"))",
             KIVI, "scale = (max - min) / (2^b - 1)"),
    Mutation("kivi_key_residual_flush_point", S + "cache/kivi/method.py",
             "return (num_tokens // self.config.residual) * self.config.residual",
             "return max(0, num_tokens - self.config.residual) // self.config.group * self.config.group",
             KIVI, "keys stay exact until R of them are collected, then flush as whole pages"),
    Mutation("kivi_kernel_residual_window", S + "cache/kivi/cpu_decode.cpp",
             "return {n, (n / R) * R, std::max<int64_t>(0, n - R),",
             "return {n, (n / R) * R, std::max<int64_t>(0, n - R + 1),",
             ("tests/cache/kivi/test_kivi_cpu_decode.py",),
             "the C++ kernel reads the last R values from the residual (nv = n - R)"),
    # -- shared core ---------------------------------------------------------------------
    Mutation("window_mask_off_by_one", S + "cache/attention.py",
             "visible &= delta < window", "visible &= delta <= window",
             ("tests/cache/test_chunk_attention.py", "tests/models/test_model_parity.py"),
             "a sliding window of w shows the query and the w - 1 keys before it"),
    Mutation("page_table_window_start", S + "cache/page_table.py",
             "return 0 if window is None else max(0, position - window + 1)",
             "return 0 if window is None else max(0, position - window)",
             ("tests/cache/test_block_pool.py", "tests/cache/full/test_full_cache.py"),
             "sliding-window pages are released once no query can see them"),
    Mutation("block_pool_free_leaks", S + "cache/block_pool.py",
             "                else:\n                    self._free.append(block)\n", "",
             ("tests/cache/test_block_pool.py", "tests/cache/full/test_full_cache.py") + BUDGET,
             "freed pages return to the pool"),
    Mutation("full_budget_undercounts_a_page", S + "cache/full/method.py",
             "return self.pages.max_pages_per_sequence(num_tokens) * self.page_bytes",
             "return (self.pages.max_pages_per_sequence(num_tokens) - 1) * self.page_bytes",
             ("tests/cache/full/test_full_cache.py", "tests/engine/test_engine.py"),
             "a sequence's bytes decide admission"),
    Mutation("paged_kernel_window_off_by_one", S + "cache/full/cpu_decode.cpp",
             "col_lo[b] = std::clamp<int64_t>(from[b] - first[b], 0, columns);",
             "col_lo[b] = std::clamp<int64_t>(from[b] - first[b] - 1, 0, columns);",
             ("tests/cache/full/test_full_cpu_decode.py",),
             "the C++ paged kernel reads exactly the visible positions"),
    Mutation("chunk_positions_shifted", S + "batch.py",
             "positions.extend(range(cached, cached + len(tokens)))",
             "positions.extend(range(cached + 1, cached + 1 + len(tokens)))",
             ("tests/engine/test_runner.py", "tests/models/test_model_parity.py"),
             "the token at row query_start + i has position cached_len + i"),
    # -- SwiftKV -------------------------------------------------------------------------
    Mutation("swiftkv_cache_layer_of_group", S + "config.py",
             "return layer if layer < first else first + (layer - first) // self.key_value_group_size",
             "return layer if layer < first else first + (layer - first) % self.key_value_group_size",
             ("tests/swiftkv/test_swiftkv_model.py", "tests/swiftkv/test_swiftkv_tables.py"),
             "AcrossKV: consecutive later layers share their group's cache layer"),
    Mutation("swiftkv_leader_is_last_of_group", S + "config.py",
             "(layer - self.num_key_value_layers) % self.key_value_group_size == 0",
             "(layer - self.num_key_value_layers) % self.key_value_group_size == self.key_value_group_size - 1",
             ("tests/swiftkv/test_swiftkv_tables.py", "tests/swiftkv/test_checkpoint.py"),
             "the first layer of each group computes the group's K/V (the authors' layout)"),
    # -- engine --------------------------------------------------------------------------
    Mutation("scheduler_admits_in_a_preempting_step", S + "engine/scheduler.py",
             "if not out.preempted:", "if True:",
             ("tests/engine/test_scheduler.py",), "a step that had to preempt admits nobody"),
    Mutation("preemption_keeps_computed_tokens", S + "engine/scheduler.py",
             "request.num_computed_tokens = 0", "request.num_computed_tokens = request.num_computed_tokens",
             ("tests/engine/test_scheduler.py", "tests/engine/test_engine.py"),
             "a preempted request lost its cache and must recompute from 0"),
    Mutation("top_p_ignores_temperature", S + "engine/sampling.py",
             "probs, candidates = _nucleus_candidates(torch.softmax(scaled, dim=-1), params.top_p)",
             "probs, candidates = _nucleus_candidates(torch.softmax(scores - scores.max(), dim=-1), params.top_p)",
             ("tests/engine/test_sampling.py",), "the nucleus is taken after the temperature"),
    Mutation("seed_ignored", S + "engine/sampling.py",
             "        generator.manual_seed(seed)", "        generator.seed()",
             ("tests/engine/test_sampling.py", "tests/engine/test_engine.py"),
             "the same seed gives the same tokens"),
    Mutation("stop_string_across_tokens_missed", S + "engine/sampling.py",
             "found = text.find(stop, max(0, search_from - len(stop) + 1))",
             "found = text.find(stop, search_from)",
             ("tests/engine/test_sampling.py", "tests/engine/test_engine.py"),
             "a stop string that starts in earlier text and ends in the new token still stops"),
    Mutation("ignore_eos_ignored", S + "engine/llm_engine.py",
             "(not params.ignore_eos and token in self.eos_token_ids)", "(token in self.eos_token_ids)",
             ("tests/engine/test_engine.py",), "ignore_eos generates past the EOS token"),
    Mutation("prompt_logprob_rows_shifted", S + "engine/llm_engine.py",
             "stop = min(chunk.end, len(prompt) - 1)", "stop = min(chunk.end, len(prompt))",
             ("tests/engine/test_prompt_logprobs.py",), "the row of position p scores token p + 1"),
    Mutation("prompt_at_context_accepted", S + "engine/llm_engine.py",
             "if len(prompt) >= self.max_model_len:", "if len(prompt) > self.max_model_len:",
             ("tests/engine/test_engine.py",), "a prompt must leave room for one generated token"),
    # -- prefix caching ------------------------------------------------------------------
    Mutation("prefix_hit_covers_the_last_token", S + "engine/prefix_cache.py",
             "limit = len(tokens) - 1", "limit = len(tokens)",
             ("tests/engine/test_prefix_cache.py",), "the last token is always computed: its logits choose the next"),
    Mutation("page_key_forgets_its_parent", S + "engine/prefix_cache.py",
             "parent = hashlib.sha256(parent + b\"\".join(", "parent = hashlib.sha256(b\"\".join(",
             ("tests/engine/test_prefix_cache.py",), "a page's name covers every token before it"),
    Mutation("shared_page_without_a_reference", S + "cache/block_pool.py",
             "        self._refs[block] += 1\n", "",
             ("tests/engine/test_prefix_cache.py", "tests/cache/test_block_pool.py"),
             "a sequence attaching a cached page holds a reference to it"),
    Mutation("cached_pages_block_admission", S + "cache/block_pool.py",
             "return len(self._free) + len(self._cached)", "return len(self._free)",
             ("tests/engine/test_prefix_cache.py",), "cached pages are reclaimed when the pool needs them"),
    Mutation("sliding_pages_shared_half_written", S + "cache/page_table.py",
             "if j >= first_whole[g] and j < len(table)", "if j < len(table)",
             ("tests/engine/test_prefix_cache.py",), "a sliding layer's page is shared only once all its tokens are stored"),
    Mutation("kept_sequences_not_evicted", S + "engine/scheduler.py",
             "if self.prefix is None or not self.prefix.evict_one():", "if True:",
             ("tests/engine/test_prefix_cache.py",), "kept sequences go before any running request is preempted"),
    Mutation("kivi_fork_shares_the_value_ring", S + "cache/kivi/method.py",
             "        self.store.v_res[:, fork.slot] = self.store.v_res[:, seq.slot]\n", "",
             ("tests/engine/test_prefix_cache.py",), "a KIVI fork starts with its own copy of the full-precision residual"),
    Mutation("snapshot_after_the_last_chunk", S + "engine/prefix_cache.py",
             "if chunk.start == 0 or chunk.end != request.num_prompt_tokens",
             "if chunk.start == 0 or chunk.end == request.num_prompt_tokens",
             ("tests/engine/test_prefix_cache.py",), "a snapshot is the state where the no-hit run starts a chunk too"),
    Mutation("snapshot_moved_not_forked", S + "engine/prefix_cache.py",
             "        self._kept.move_to_end(best)\n        return best_len",
             "        self.cache.free(best)\n        del self._kept[best]\n        return best_len",
             ("tests/engine/test_prefix_cache.py",), "a snapshot serves every later prompt that extends it"),
    # -- server --------------------------------------------------------------------------
    Mutation("server_keeps_running_after_client_left", S + "engine/async_engine.py",
             "                self.abort(request_id)\n", "                pass\n",
             ("tests/serve/test_load.py",), "a client that goes away frees its cache within a step"),
    Mutation("server_max_tokens_beyond_context", S + "serve/served_model.py",
             "if requested > room:", "if requested > room + 1:",
             ("tests/serve/test_openai_api.py", "tests/serve/test_load.py"), "prompt + max_tokens must fit the context (400 otherwise)"),
    Mutation("server_api_key_prefix_accepted", S + "serve/app.py",
             "not secrets.compare_digest(token.strip().encode(), api_key.encode())",
             "not api_key.startswith(token.strip())",
             ("tests/serve/test_openai_api.py",), "only the exact key is accepted"),
]
