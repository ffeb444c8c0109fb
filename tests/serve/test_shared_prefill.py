"""The n completions of a prompt compute it once: with prefix caching on, a prompt's later
samples are submitted once its first has produced a token, and start from the pages it
published. The gate opens on the leader's first output, on its failure or close, and a
follower closed before it opens never submits its request."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from server_helpers import MODEL_NAME, char_tokenizer, make_engine, tiny_model

from kvforge.engine.async_engine import AsyncEngine
from kvforge.serve.app import create_app
from kvforge.serve.served_model import ServedModel
from kvforge.serve.shared_prefill import FirstOutputGate, after_first_sample

PROMPT = "the quick brown fox jumps over the lazy dog " * 2  # 88 tokens: 11 full pages of 8


class Recorder:
    """A stream that notes when it started, each item it gave, and its closing."""

    def __init__(self, name: str, items: int, events: list[str], fail: bool = False) -> None:
        self.name, self.items, self.events, self.fail = name, items, events, fail

    async def run(self):
        self.events.append(f"{self.name} start")
        try:
            for index in range(self.items):
                await asyncio.sleep(0)
                if self.fail:
                    raise RuntimeError("leader failed")
                self.events.append(f"{self.name} {index}")
                yield index
        finally:
            self.events.append(f"{self.name} closed")


async def drain(stream) -> list[Any]:
    return [item async for item in stream]


def test_followers_start_after_the_leaders_first_output():
    async def scenario() -> list[str]:
        events: list[str] = []
        streams = after_first_sample([Recorder("lead", 3, events).run(), Recorder("a", 2, events).run(),
                                      Recorder("b", 2, events).run()], [0, 1, 2], prefix_caching=True)
        await asyncio.gather(*(drain(s) for s in streams))
        return events

    events = asyncio.run(scenario())
    assert events.index("lead 0") < events.index("a start") and events.index("lead 0") < events.index("b start")
    assert events.index("a start") < events.index("lead closed")  # not held until the leader ends


def test_each_prompt_gates_its_own_samples_and_without_prefix_caching_nothing_waits():
    async def scenario(prefix_caching: bool) -> list[str]:
        events: list[str] = []
        names = ["p0", "p0s1", "p1", "p1s1"]
        streams = after_first_sample([Recorder(n, 2, events).run() for n in names], [0, 1, 0, 1], prefix_caching)
        await asyncio.gather(*(drain(s) for s in streams))
        return events

    gated = asyncio.run(scenario(True))
    assert gated.index("p0 0") < gated.index("p0s1 start") and gated.index("p1 0") < gated.index("p1s1 start")
    free = asyncio.run(scenario(False))
    assert free.index("p0s1 start") < free.index("p0 0")


def test_a_failing_leader_opens_the_gate_and_an_unopened_follower_never_starts():
    async def failing() -> list[str]:
        events: list[str] = []
        gate = FirstOutputGate()
        follower = gate.follow(Recorder("a", 1, events).run())
        with pytest.raises(RuntimeError):
            await drain(gate.lead(Recorder("lead", 1, events, fail=True).run()))
        assert await asyncio.wait_for(drain(follower), 5) == [0]
        return events

    assert "a 0" in asyncio.run(failing())

    async def closed_early() -> list[str]:
        events: list[str] = []
        gate = FirstOutputGate()
        follower = gate.follow(Recorder("a", 1, events).run())
        task = asyncio.ensure_future(drain(follower))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return events

    assert asyncio.run(closed_early()) == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_samples_of_a_prompt_reuse_its_pages(path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = char_tokenizer()
        engine = make_engine(tiny_model(), tokenizer, batched_tokens=256)
        app = create_app(ServedModel(MODEL_NAME, AsyncEngine(engine), tokenizer))
        body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 4, "n": 4, "temperature": 1.0, "seed": 3,
                                "return_token_ids": True}
        body.update({"prompt": PROMPT} if path == "/v1/completions" else
                    {"messages": [{"role": "user", "content": PROMPT}]})
        with TestClient(app) as client:
            response = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code == 200, response.text
        prompt = response.json()["choices"][0]["prompt_token_ids"]
        stats = engine.prefix_statistics()
        # every later sample found every full page of the prompt the first had computed
        assert stats["prefix_hit_tokens"] >= 3 * (len(prompt) // 8 * 8 - 8), (len(prompt), stats)
    finally:
        torch.set_num_threads(threads)
