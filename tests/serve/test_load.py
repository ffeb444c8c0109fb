"""Load on loopback: 48 concurrent streaming clients with mixed prompt lengths, a quarter of
them disconnecting mid-stream, and 24 kinds of bad request mixed in. Bounded in count and
time (one minute), it stops by itself."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time

import httpx
import pytest
import torch
from server_helpers import CONTEXT, MODEL_NAME, char_tokenizer, make_engine, serve, tiny_model

from kvforge.engine.sampling import SamplingParams

NUM_CLIENTS = 48
DEADLINE_S = 60
# A near tie in the reference could flip under another batch's rounding (~1e-6 here): the
# fixture must not have one, or token-for-token equality would test luck.
MIN_REFERENCE_MARGIN = 1e-4

# (body, HTTP status, the parameter the error must name)
BAD_REQUESTS = [
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 65}, 400, "n"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "max_tokens": CONTEXT + 10}, 400, "max_tokens"),
    ({"prompt": "y" * (CONTEXT + 5)}, 400, "prompt"),
    ({"prompt": [5, 999999]}, 400, "prompt"),
    ({"prompt": "x", "stop": 7}, 400, "stop"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "stream_options": "yes"}, 400, "stream_options"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
]


def _prompts(count: int) -> list[tuple[str, int]]:
    rng = random.Random(1234)
    letters = string.ascii_letters + string.digits + " .,"
    return [("".join(rng.choice(letters) for _ in range(rng.randint(3, 160))), rng.randint(4, 40))
            for _ in range(count)]


def _offline(model, tokenizer, prompts: list[tuple[str, int]]) -> list[list[int]]:
    """Greedy token ids of each prompt from the engine alone (no server), and a check that
    every step's top-2 margin is clear of rounding."""
    engine = make_engine(model, tokenizer)
    ids = [engine.add_request(tokenizer.encode(text), SamplingParams.greedy_params(
        max_tokens=max_tokens, logprobs=True, top_logprobs=2)) for text, max_tokens in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    margins = [top[0][1] - top[1][1] for rid in ids for top in finished[rid].top_logprobs]
    assert min(margins) > MIN_REFERENCE_MARGIN
    return [finished[rid].token_ids for rid in ids]


LEAVING_MAX_TOKENS = 300  # a leaving client's request cannot finish before its disconnect is seen


async def _stream(client: httpx.AsyncClient, text: str, max_tokens: int, leave_after: int | None) -> dict:
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    if leave_after is not None:
        body.update(max_tokens=LEAVING_MAX_TOKENS, ignore_eos=True)
    token_ids, reasons, done = [], [], False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            token_ids.extend(choice["token_ids"])
            reasons.append(choice["finish_reason"])
            if leave_after is not None and len(token_ids) >= leave_after:
                break  # leaving the block closes the connection mid-stream
    return {"token_ids": token_ids, "done": done, "finish_reason": reasons[-1] if reasons else None}


async def _bad(client: httpx.AsyncClient, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return await client.post(path, json=body)


def test_concurrent_streams_disconnects_and_bad_requests():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer, model = char_tokenizer(), tiny_model()
        prompts = _prompts(NUM_CLIENTS)
        reference = _offline(model, tokenizer, prompts)
        # every fourth client leaves after a few tokens (of those whose reference gets that far
        # before any EOS, so ignoring EOS changes nothing in what it reads)
        leaving = {i: 2 + i % 3 for i in range(0, NUM_CLIENTS, 4) if len(reference[i]) > 5}
        engine = make_engine(model, tokenizer, budget=1 << 21, batched_tokens=96)
        with serve(engine, tokenizer) as server:
            async def run() -> tuple[list, list]:
                limits = httpx.Limits(max_connections=NUM_CLIENTS + len(BAD_REQUESTS))
                async with httpx.AsyncClient(base_url=server.base_url, timeout=DEADLINE_S, limits=limits) as client:
                    streams = [_stream(client, text, max_tokens, leaving.get(i))
                               for i, (text, max_tokens) in enumerate(prompts)]
                    bad = [_bad(client, body) for body, _, _ in BAD_REQUESTS]
                    # interleave the bad requests with the streams
                    jobs = [job for pair in zip(streams[:len(bad)], bad) for job in pair] + streams[len(bad):]
                    results = await asyncio.wait_for(asyncio.gather(*jobs), DEADLINE_S)
                stream_results = [r for r in results if isinstance(r, dict)]
                bad_results = [r for r in results if isinstance(r, httpx.Response)]
                return stream_results, bad_results

            stream_results, bad_results = asyncio.run(run())
            # ordered as submitted: streams and bad requests alternate, then the rest of the streams
            for index, (result, expected) in enumerate(zip(stream_results, reference)):
                if index in leaving:
                    assert result["token_ids"] == expected[:len(result["token_ids"])]
                    assert not result["done"]
                else:
                    assert result["done"] and result["token_ids"] == expected, f"client {index}"
                    assert result["finish_reason"] in ("stop", "length")
            for response, (body, status, param) in zip(bad_results, BAD_REQUESTS):
                assert response.status_code == status, (body, response.text)
                error = response.json()["error"]
                assert error["param"] == param, (body, error)
                assert param.split("[")[0].split(".")[0] in error["message"]
            # every abort is applied within an engine step: the cache drains to empty
            deadline = time.monotonic() + 10
            while engine.has_unfinished_requests() or engine.cache.memory_usage()["fast"]:
                assert time.monotonic() < deadline, "requests or cache bytes left after the clients finished"
                time.sleep(0.05)
            # /metrics catches up within a round of the engine loop
            wanted = ['kvforge_kv_cache_bytes_used{model_name="tiny",tier="fast"} 0.0',
                      f'kvforge_request_finished_total{{finished_reason="abort",model_name="tiny"}} {len(leaving)}.0']
            while not all(line in httpx.get(f"{server.base_url}/metrics", timeout=30).text for line in wanted):
                assert time.monotonic() < deadline, "/metrics does not show the drained cache and the aborts"
                time.sleep(0.05)
            after = httpx.post(f"{server.base_url}/v1/completions", timeout=30, json={
                "prompt": prompts[1][0], "max_tokens": prompts[1][1], "temperature": 0, "return_token_ids": True})
            assert after.status_code == 200 and after.json()["choices"][0]["token_ids"] == reference[1]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("stream, path, choices", [(True, "/v1/completions", 1), (False, "/v1/completions", 1),
                                                   (True, "/v1/chat/completions", 4),
                                                   (False, "/v1/chat/completions", 4)])
def test_a_client_that_disconnects_has_its_request_aborted(stream, path, choices):
    """A long request (would run 400 tokens) is left after its first bytes: within a few
    engine steps nothing runs and no cache byte is held, for each of its n choices."""
    tokenizer, model = char_tokenizer(), tiny_model()
    engine = make_engine(model, tokenizer)
    # The tiny model can run 400 steps inside the non-streaming client's 0.3 s timeout on a
    # fast moment (a fresh-clone CI run did): each step waits 10 ms first, so the request
    # would need >= 4 s and the client always leaves before it finishes.
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]
    with serve(engine, tokenizer) as server:
        async def leave_early() -> None:
            text = {"prompt": "abc"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "abc"}]}
            body = {**text, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": stream, "n": choices}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:
                if stream:
                    async with client.stream("POST", path, json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: "):
                                break
                else:
                    with pytest.raises(httpx.ReadTimeout):
                        await client.post(path, json=body, timeout=0.3)
        steps_before = engine.steps
        asyncio.run(leave_early())
        deadline = time.monotonic() + 10
        while engine.has_unfinished_requests() or engine.cache.memory_usage()["fast"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert engine.steps - steps_before < 400  # stopped long before max_tokens
