"""`kvforge serve` driven by the official `openai` client over loopback: both endpoints,
streaming and not, usage, logprobs with echo (against the engine's own scoring), the API
key, errors in OpenAI's schema, /health and /metrics."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (  # noqa: F401 - fixtures
    MODEL_NAME,
    make_engine,
    model_fixture,
    serve,
    tokenizer_fixture,
)

from kvforge.cache.registry import create_cache
from kvforge.engine.loglikelihood import ScoreSettings, score_continuations
from kvforge.engine.runner import ModelRunner


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with serve(make_engine(model, tokenizer, step_timing=True), tokenizer) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_streamed_text_concatenates_to_the_non_streamed_text(client, tokenizer):
    prompt = "The quick brown fox"
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt)) == len(prompt)
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    pieces, usage, reasons = [], None, []
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].text
    assert len(whole.choices[0].text) > 0
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_chat_streamed_text_concatenates_to_the_non_streamed_text(client, tokenizer):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"}],
        add_generation_prompt=True, tokenize=False)
    assert whole.usage.prompt_tokens == len(rendered)
    assert whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
    pieces, roles = [], []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
            last_reason = choice.finish_reason
    assert roles[0] == "assistant"
    assert "".join(pieces) == text
    assert last_reason == whole.choices[0].finish_reason


def test_chat_and_completion_prompts_of_token_ids_and_batches(client):
    batch = client.completions.create(model=MODEL_NAME, prompt=[[10, 11, 12], [20, 21]], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == 5 and batch.usage.completion_tokens == 10
    single = client.completions.create(model=MODEL_NAME, prompt=[20, 21], max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert batch.choices[1].text == single.choices[0].text


def test_echo_logprobs_equal_the_engine_scoring_used_by_lm_eval(client, model, tokenizer):
    context = tokenizer.encode("Once upon a time there")
    continuation = tokenizer.encode(" was a fox")
    runner = ModelRunner(model, create_cache("full:block_size=8", model.cache_layout(), 1 << 22, torch.float32))
    (expected,) = score_continuations(runner, [(context, continuation)], ScoreSettings(mode="cached"))
    for max_tokens in (0, 1):
        response = client.completions.create(model=MODEL_NAME, prompt=context + continuation, echo=True,
                                             logprobs=1, max_tokens=max_tokens, temperature=0)
        lp = response.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(context) + len(continuation) + max_tokens
        scored = lp.token_logprobs[len(context):len(context) + len(continuation)]
        assert sum(scored) == pytest.approx(expected.logprob, abs=1e-4)
        greedy = all(max(top, key=top.get) == token for top, token in
                     zip(lp.top_logprobs[len(context):len(context) + len(continuation)],
                         lp.tokens[len(context):]))
        assert greedy == expected.is_greedy
        assert response.choices[0].text.startswith(tokenizer.decode(context + continuation))
        assert response.usage.completion_tokens == max_tokens


def test_generated_logprobs_and_top_alternatives(client):
    response = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=6, temperature=0, logprobs=3,
                                         extra_body={"ignore_eos": True})
    lp = response.choices[0].logprobs
    assert "".join(lp.tokens) == response.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3  # greedy: the chosen token is the most likely, one of the three
        assert max(top, key=top.get) == token and top[token] == pytest.approx(value)
        assert value <= 0
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "abc"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)


def test_seeded_sampling_repeats_and_stop_strings_cut(client):
    kwargs = dict(model=MODEL_NAME, prompt="xyz", max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                  extra_body={"ignore_eos": True})
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
    text = client.completions.create(model=MODEL_NAME, prompt="xyz", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[3:5]
    cut = client.completions.create(model=MODEL_NAME, prompt="xyz", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


def test_errors_use_openai_schema(client, server):
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="other", prompt="x", max_tokens=1)
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, n=0)
    assert bad.value.body["param"] == "n" and bad.value.body["type"] == "invalid_request_error"
    response = httpx.post(f"{server.base_url}/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"
    assert httpx.get(f"{server.base_url}/v1/nothing", timeout=30).status_code == 404


def test_api_key_is_required_when_set(model, tokenizer):
    with serve(make_engine(model, tokenizer), tokenizer, api_key="sesame") as running:
        url = running.base_url
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        for near in ("Bearer sesam", "Bearer sesame!", "Bearer s", "Basic sesame"):  # only the exact key
            assert httpx.get(f"{url}/v1/models", headers={"Authorization": near}, timeout=30).status_code == 401
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(model=MODEL_NAME, prompt="a", max_tokens=2).usage.prompt_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()


def test_health_and_metrics_parse(client, server):
    client.completions.create(model=MODEL_NAME, prompt="metrics", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    assert httpx.get(f"{server.base_url}/health", timeout=30).json()["status"] == "ok"
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                                if k != "model_name") + "}" if len(sample.labels) > 1 else "")
            samples[key] = sample.value
    assert samples["kvforge_generation_tokens_total"] >= 3
    assert samples["kvforge_prompt_tokens_total"] >= len("metrics")
    assert samples["kvforge_request_finished_total{finished_reason=length}"] >= 1
    assert samples["kvforge_time_to_first_token_seconds_count"] >= 1
    assert samples["kvforge_kv_cache_bytes_capacity{tier=fast}"] == server.llm_engine.cache.memory.capacity["fast"]
    assert samples["kvforge_kv_cache_bytes_used{tier=fast}"] == 0  # nothing in flight
    assert samples["kvforge_num_requests_running"] == 0
    parts = {(k, p): samples[f"kvforge_engine_step_part_seconds_total{{kind={k},part={p}}}"]
             for k in ("decode", "prefill") for p in ("linear", "attention", "sampling", "other")}
    assert all(v > 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(samples["kvforge_engine_step_seconds_total"], rel=0.2)
    timed = sum(samples[f"kvforge_engine_timed_steps_total{{kind={k}}}"] for k in ("decode", "prefill"))
    assert timed == samples["kvforge_engine_steps_total"]
    assert samples["kvforge_engine_timed_steps_total{kind=decode}"] >= 2  # 3 tokens: 1 from prefill, 2 decode


def test_max_tokens_may_fill_the_context_exactly(client):
    from server_helpers import CONTEXT

    room = CONTEXT - 1  # a one-token prompt
    assert client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=room, temperature=0).choices
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL_NAME, prompt="a", max_tokens=room + 1)
    assert error.value.body["param"] == "max_tokens" and f"must be <= {room}" in error.value.body["message"]
