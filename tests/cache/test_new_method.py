"""Adding a cache method takes a config, a MemorySpec, a StepMetadata, a CacheMethod and the
registry decorator, nothing in the model or engine: a tiny method defined here (each
sequence's post-RoPE K/V in growing tensors, attention by the reference definition) runs in
the engine by name and gives the `full` method's greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from conftest import make_pair

from kvforge.cache.attention import reference_attention
from kvforge.cache.base import CacheMethod, StepMetadata
from kvforge.cache.memory import MemorySpec
from kvforge.cache.registry import create_cache, parse_cache_spec, register_cache_method
from kvforge.engine.engine_config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.sampling import SamplingParams
from kvforge.errors import ConfigError, require


@dataclass(frozen=True)
class ListCacheConfig:
    max_sequences: int = 8

    def __post_init__(self) -> None:
        require(self.max_sequences >= 1, "max_sequences", self.max_sequences, "must be >= 1")


@dataclass(frozen=True)
class ListMemory(MemorySpec):
    """Every token costs its float32 K and V in every cache layer; the budget is the capacity."""

    num_cache_layers: int
    token_bytes: int
    budget: int

    def bytes_per_token(self, cache_layer):
        return self.token_bytes

    def sequence_bytes(self, num_tokens):
        return int(self.kv_bytes_per_token() * num_tokens)

    @property
    def capacity(self):
        return {"fast": self.budget, "slow": 0}


@dataclass
class ListStep(StepMetadata):
    step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@register_cache_method("test_list", ListCacheConfig)
class ListCache(CacheMethod[ListStep]):
    def __init__(self, layout, config, budget_bytes, compute_dtype, device):
        super().__init__(layout, compute_dtype, device)
        self.config = config
        self.memory = ListMemory(layout.num_cache_layers, 2 * layout.num_kv_heads * layout.head_dim * 4, budget_bytes)
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.lengths: dict[int, int] = {}

    def memory_usage(self):
        return {"fast": sum(self.memory.sequence_bytes(n) for n in self.lengths.values()), "slow": 0}

    def allocate(self, seq_id, num_tokens):
        others = sum(self.memory.sequence_bytes(n) for s, n in self.lengths.items() if s != seq_id)
        if seq_id not in self.lengths and len(self.lengths) >= self.config.max_sequences:
            return False
        if others + self.memory.sequence_bytes(num_tokens) > self.memory.budget:
            return False
        self.kv.setdefault(seq_id, [(torch.empty(0), torch.empty(0))] * self.layout.num_cache_layers)
        self.lengths.setdefault(seq_id, 0)
        return True

    def free(self, seq_id):
        self.kv.pop(seq_id, None)
        self.lengths.pop(seq_id, None)

    def num_cached_tokens(self, seq_id):
        return self.lengths.get(seq_id, 0)

    def begin_step(self, batch):
        self.check_batch(batch)
        return ListStep(batch)

    def write(self, cache_layer, meta, k_pre, v, rope):
        meta.step_kv[cache_layer] = (rope.apply(k_pre), v)

    def attend(self, cache_layer, meta, q, rope):
        k_step, v_step = meta.step_kv[cache_layer]
        spec = self.layout.specs[cache_layer]
        out = torch.empty_like(q)
        for span in meta.batch.spans:
            rows = slice(span.query_start, span.query_end)
            k_old, v_old = self.kv[span.seq_id][cache_layer]
            k = torch.cat([k_old, k_step[rows]]) if span.cached_len else k_step[rows]
            v = torch.cat([v_old, v_step[rows]]) if span.cached_len else v_step[rows]
            positions = torch.arange(span.total_len)
            out[rows] = reference_attention(q[rows], k, v, positions[span.cached_len:], positions, spec.scale,
                                            spec.sliding_window)
        return out

    def end_step(self, meta):
        for span in meta.batch.spans:
            rows = slice(span.query_start, span.query_end)
            layers = self.kv[span.seq_id]
            for layer, (k_step, v_step) in meta.step_kv.items():
                k_old, v_old = layers[layer]
                layers[layer] = ((torch.cat([k_old, k_step[rows]]), torch.cat([v_old, v_step[rows]]))
                                 if span.cached_len else (k_step[rows], v_step[rows]))
            self.lengths[span.seq_id] = span.total_len


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3_hybrid"])
def test_a_method_added_outside_the_package_runs_by_name(arch):
    _, model = make_pair(arch)
    tokens = {}
    for spec in ("test_list:max_sequences=4", "full:block_size=4"):
        cache = create_cache(spec, model.cache_layout(), 1 << 22, torch.float32)
        engine = LLMEngine(model, cache, None, EngineConfig(1 << 22, max_num_batched_tokens=16))
        ids = [engine.add_request(list(range(3, 3 + n)), SamplingParams.greedy_params(max_tokens=6, ignore_eos=True))
               for n in (5, 23, 11)]
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
        tokens[spec.split(":")[0]] = [finished[i] for i in ids]
        engine.clear_prefix_cache()
        assert cache.memory_usage()["fast"] == 0
    assert tokens["test_list"] == tokens["full"]


def test_its_options_are_parsed_and_validated_like_the_builtin_ones():
    assert parse_cache_spec("test_list:max_sequences=3").config() == ListCacheConfig(3)
    with pytest.raises(ConfigError, match="max_sequences"):
        parse_cache_spec("test_list:max_sequences=0")
    with pytest.raises(ConfigError, match="known options"):
        parse_cache_spec("test_list:nope=1")


def test_a_key_given_twice_takes_its_last_value_so_cache_opt_overrides_the_inline_options():
    """As docs/cache-methods.md says (tests build specs as a base plus overrides this way)."""
    assert parse_cache_spec("kivi:bits=2,bits=4").config().bits == 4
    overridden = parse_cache_spec("kivi:bits=2,group=64", ["bits=4"])
    assert overridden.config().bits == 4 and str(overridden) == "kivi:bits=4,group=64"
