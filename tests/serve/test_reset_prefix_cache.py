"""`POST /reset_prefix_cache` (vLLM's endpoint): what the prefix cache holds for later
requests is freed, so a server at rest then holds no KV bytes at all (the soak's check)."""

from __future__ import annotations

import httpx
from server_helpers import char_tokenizer, make_engine, serve, tiny_model


def _kv_bytes(engine) -> int:
    return sum(engine.cache.memory_usage().values())


def test_kept_snapshots_are_freed_and_the_key_is_asked_for():
    tokenizer = char_tokenizer()
    # KIVI keeps a snapshot of a prompt longer than one step's tokens (prefix caching on)
    engine = make_engine(tiny_model(), tokenizer, cache="kivi:bits=2,group=8,residual=16", batched_tokens=32)
    with serve(engine, tokenizer, api_key="sesame") as server:
        headers = {"Authorization": "Bearer sesame"}
        body = {"model": "tiny", "prompt": "the lighthouse keeper wrote down the weather every night " * 2,
                "max_tokens": 4, "temperature": 0}
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=900) as client:  # a fresh tree builds the KIVI kernels first
            assert client.post("/v1/completions", json=body).status_code == 200
            assert engine.prefix_statistics()["prefix_kept_sequences"] >= 1 and _kv_bytes(engine) > 0
            assert httpx.post(f"{server.base_url}/reset_prefix_cache", timeout=30).status_code == 401
            answer = client.post("/reset_prefix_cache")
            assert answer.status_code == 200 and answer.json() == {"status": "ok"}
            assert engine.prefix_statistics()["prefix_kept_sequences"] == 0 and _kv_bytes(engine) == 0
            # and the server serves on
            assert client.post("/v1/completions", json=body).status_code == 200
