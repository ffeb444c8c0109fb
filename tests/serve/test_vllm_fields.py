"""What a vLLM client meets: prompt token ids checked before any use; repetition_penalty,
min_p and OpenAI's logit_bias, frequency_penalty and presence_penalty honoured; every OpenAI or vLLM field kvforge does not implement refused with a
400 naming it (accepted at its neutral value); /v1/models and the start-up banner say
what is served (base model, SwiftKV checkpoint, cache, dtype)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from in_process import app_client_fixture  # noqa: F401 - fixture
from server_helpers import MODEL_NAME, VOCAB, char_tokenizer, make_engine, tiny_model

from kvforge.cli import build_parser
from kvforge.engine.llm import LLM
from kvforge.serve.protocol import NEUTRAL, ChatCompletionRequest, CompletionRequest, unimplemented_fields

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SEEDS = range(4)


def post(client: TestClient, path: str, **body: Any):
    base = {"prompt": "xyz"} if path == COMPLETIONS else {"messages": [{"role": "user", "content": "hi"}]}
    return client.post(path, content=json.dumps({"model": MODEL_NAME, "max_tokens": 3, **base, **body}),
                       headers={"content-type": "application/json"})


def refused(response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"], error
    return error["message"]


def token_ids(client: TestClient, **body: Any) -> list[int]:
    response = post(client, COMPLETIONS, max_tokens=12, ignore_eos=True, return_token_ids=True, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


# -- prompt token ids ----------------------------------------------------------------------
@pytest.mark.parametrize("prompt, bad", [([-1, 5], -1), ([4294967296], 4294967296), ([[5], [-3]], -3),
                                         ([999999999], 999999999), ([5, VOCAB], VOCAB), ([2**70], 2**70)])
def test_prompt_token_ids_outside_the_vocabulary_are_a_400_naming_prompt_the_id_and_the_rule(app_client, prompt,
                                                                                                bad):
    message = refused(post(app_client, COMPLETIONS, prompt=prompt), "prompt")
    assert str(bad) in message and f"[0, {VOCAB})" in message and "vocabulary size" in message
    assert post(app_client, COMPLETIONS, prompt=[5, 6]).status_code == 200


# -- honoured: repetition_penalty and min_p ---------------------------------------------------
def test_repetition_penalty_one_is_off_and_another_value_changes_greedy_output(app_client):
    greedy = token_ids(app_client, temperature=0)
    assert token_ids(app_client, temperature=0, repetition_penalty=1.0) == greedy
    assert token_ids(app_client, temperature=0, repetition_penalty=3.0) != greedy
    # a penalty below 1 favours what was seen: the output repeats more
    boosted = token_ids(app_client, temperature=0, repetition_penalty=0.2)
    assert len(set(boosted)) <= len(set(greedy))


def test_min_p_one_keeps_only_the_top_token_and_zero_is_off(app_client):
    greedy = token_ids(app_client, temperature=0)
    for seed in SEEDS:
        sampled = token_ids(app_client, temperature=1.4, seed=seed)
        assert sampled != greedy
        assert token_ids(app_client, temperature=1.4, seed=seed, min_p=0.0) == sampled
        assert token_ids(app_client, temperature=1.4, seed=seed, min_p=1.0) == greedy


@pytest.mark.parametrize("body, param", [({"repetition_penalty": 0}, "repetition_penalty"),
                                         ({"repetition_penalty": -1.5}, "repetition_penalty"),
                                         ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
                                         ({"min_p": "0.1"}, "min_p")])
def test_bad_penalty_and_min_p_values_are_refused_by_name(app_client, body, param):
    for path in (COMPLETIONS, CHAT):
        refused(post(app_client, path, **body), param)


# -- refused: what kvforge does not implement ---------------------------------------------------
UNSUPPORTED = {"some": "thing"}  # neutral for no field


@pytest.mark.parametrize("path, name", [(COMPLETIONS, n) for n in unimplemented_fields(CompletionRequest)]
                         + [(CHAT, n) for n in unimplemented_fields(ChatCompletionRequest)])
def test_each_unimplemented_field_is_refused_by_name_and_accepted_when_neutral(app_client, path, name):
    message = refused(post(app_client, path, **{name: UNSUPPORTED}), name)
    assert "not supported" in message
    assert post(app_client, path, **{name: None}).status_code == 200
    for neutral in NEUTRAL[name]:
        assert post(app_client, path, **{name: neutral}).status_code == 200, (name, neutral)


@pytest.mark.parametrize("path, body, param", [
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"length_penalty": 0.7}, "length_penalty"),
    (COMPLETIONS, {"best_of": 3}, "best_of"), (CHAT, {"best_of": 2}, "best_of"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"), (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"add_generation_prompt": False}, "add_generation_prompt"),
    (COMPLETIONS, {"skip_special_tokens": 1}, "skip_special_tokens"),  # 1 is not true
    (COMPLETIONS, {"priority": False}, "priority"),  # false is not 0
    (COMPLETIONS, {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    (COMPLETIONS, {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
])
def test_what_a_vllm_client_may_send_and_kvforge_does_not_honour_is_refused(app_client, path, body, param):
    refused(post(app_client, path, **body), param)


@pytest.mark.parametrize("path, body", [(COMPLETIONS, {"best_of": 1}), (CHAT, {"best_of": 1}),
                                        (CHAT, {"tool_choice": "none"}), (CHAT, {"tools": []}),
                                        (COMPLETIONS, {"use_beam_search": False, "length_penalty": 1.0}),
                                        (COMPLETIONS, {"skip_special_tokens": True, "priority": 0}),
                                        (CHAT, {"response_format": {"type": "text"}}),
                                        (COMPLETIONS, {"presence_penalty": 0, "frequency_penalty": 0.0})])
def test_neutral_values_are_accepted(app_client, path, body):
    response = post(app_client, path, **body)
    assert response.status_code == 200, response.text


# -- honoured: OpenAI's logit_bias, frequency_penalty and presence_penalty ---------------------
def test_logit_bias_forces_and_bans_tokens(app_client):
    greedy = token_ids(app_client, temperature=0)
    assert token_ids(app_client, temperature=0, logit_bias={"7": 100}) == [7] * len(greedy)
    banned = token_ids(app_client, temperature=0, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]


def test_penalties_change_greedy_output_and_zero_does_not(app_client):
    greedy = token_ids(app_client, temperature=0)
    assert token_ids(app_client, temperature=0, frequency_penalty=0, presence_penalty=0.0) == greedy
    repeats = max(greedy.count(token) for token in set(greedy))
    assert repeats > 1  # the tiny model repeats itself: a penalty on repeats has work to do
    penalised = token_ids(app_client, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised != greedy and max(penalised.count(token) for token in set(penalised)) < repeats


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(app_client):
    def text(**body):
        response = post(app_client, COMPLETIONS, max_tokens=12, temperature=0, ignore_eos=True, **body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]
    whole = text()["text"]
    stop = whole[4:6]
    cut, kept = text(stop=[stop]), text(stop=["never here", stop], include_stop_str_in_output=True)
    assert cut["text"] == whole[:whole.index(stop)] and cut["finish_reason"] == "stop"
    assert kept["text"] == whole[:whole.index(stop) + len(stop)] and kept["finish_reason"] == "stop"
    assert text(include_stop_str_in_output=False, stop=[stop])["text"] == cut["text"]
    body = {"model": MODEL_NAME, "prompt": "xyz", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": True, "stream": True}
    with app_client.stream("POST", COMPLETIONS, json=body) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    streamed = "".join(json.loads(line)["choices"][0]["text"] for line in lines[:-1])
    assert streamed == kept["text"]  # the held-back start of the stop string comes out with it


def test_include_stop_str_in_output_keeps_a_stop_tokens_text(app_client):
    whole = post(app_client, COMPLETIONS, max_tokens=12, temperature=0, ignore_eos=True,
                 return_token_ids=True).json()["choices"][0]
    stop_id = whole["token_ids"][3]
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop_id]}
    cut = post(app_client, COMPLETIONS, **body).json()["choices"][0]["text"]
    kept = post(app_client, COMPLETIONS, include_stop_str_in_output=True, **body).json()["choices"][0]["text"]
    assert cut == whole["text"][:3] and kept == whole["text"][:4]  # (one character per token here)


def test_with_include_stop_str_in_output_a_stream_holds_nothing_back(app_client):
    """Any start of a stop string ends up in the text either way, so every chunk carries its
    own token's text at once (one character per token here), as vLLM's stream does."""
    whole = post(app_client, COMPLETIONS, max_tokens=8, temperature=0, ignore_eos=True,
                 return_token_ids=True).json()["choices"][0]
    own_texts = [char_tokenizer().decode([token], skip_special_tokens=True) for token in whole["token_ids"]]
    assert "".join(own_texts) == whole["text"] and whole["text"][1] in own_texts[1]
    body = {"model": MODEL_NAME, "prompt": "xyz", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stop": [whole["text"][1] + "\x00"], "include_stop_str_in_output": True, "stream": True}
    with app_client.stream("POST", COMPLETIONS, json=body) as response:
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert [json.loads(line)["choices"][0]["text"] for line in lines[:-1]] == own_texts


def test_the_stop_string_found_is_the_one_kept(app_client):
    """Two stop strings, the shorter listed first and complete before min_tokens (so it
    never stops): the longer one, found later, is the one whose text ends the output."""
    whole = post(app_client, COMPLETIONS, max_tokens=12, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    short, long = whole[1], whole[1:4]
    assert whole.index(short) == 1  # the short one first appears where the long one starts
    kept = post(app_client, COMPLETIONS, max_tokens=12, temperature=0, ignore_eos=True, min_tokens=3,
                stop=[short, long], include_stop_str_in_output=True).json()["choices"][0]["text"]
    assert kept == whole[:4]


def test_allowed_token_ids_are_the_only_ids_chosen(app_client):
    for body in ({"temperature": 0}, {"temperature": 1.5, "seed": 4}):
        assert set(token_ids(app_client, allowed_token_ids=[7, 9], **body)) <= {7, 9}
    assert set(token_ids(app_client, temperature=1.5, seed=4, allowed_token_ids=[7, 9])) == {7, 9}


@pytest.mark.parametrize("path, body, param, words", [
    (COMPLETIONS, {"allowed_token_ids": [3, VOCAB]}, "allowed_token_ids", f"[0, {VOCAB})"),
    (CHAT, {"allowed_token_ids": [3, VOCAB]}, "allowed_token_ids", f"[0, {VOCAB})"),
    (CHAT, {"allowed_token_ids": [VOCAB - 1], "stop_token_ids": [VOCAB - 1], "min_tokens": 1}, "allowed_token_ids",
     "min_tokens=1"),
    (CHAT, {"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    (COMPLETIONS, {"allowed_token_ids": [-2]}, "allowed_token_ids", ">= 0"),
    (COMPLETIONS, {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    (COMPLETIONS, {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    (CHAT, {"logit_bias": {"-4": 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {str(VOCAB): 1}}, "logit_bias", f"[0, {VOCAB})"),
    (COMPLETIONS, {"logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias[5]", "[-100, 100]"),
])
def test_out_of_range_penalties_and_biases_are_a_400_naming_the_field(app_client, path, body, param, words):
    assert words in refused(post(app_client, path, **body), param)


# -- what is served ---------------------------------------------------------------------------
def test_models_entry_carries_kvforge_metadata(app_client):
    (entry,) = app_client.get("/v1/models").json()["data"]
    assert entry["id"] == MODEL_NAME and entry["object"] == "model"
    assert entry["kvforge"] == {"base_model": MODEL_NAME, "swiftkv": None, "cache": "full", "dtype": "float32",
                                "weights": "checkpoint"}


class _FakeLLM:
    """What run_serve reads of an LLM, on the tiny model (no weights are loaded)."""

    def __init__(self, **kwargs: Any) -> None:
        from kvforge.cache.registry import parse_cache_spec

        self.tokenizer = char_tokenizer()
        self.engine = make_engine(tiny_model(), self.tokenizer)
        self.cache_spec = parse_cache_spec(kwargs["cache"], kwargs["cache_options"])
        self.dtype = getattr(torch, kwargs["dtype"])  # a named dtype, as LLM resolves it
        self.dtype_reason = None
        self.source = SimpleNamespace(weights="checkpoint")

    start_up_lines = LLM.start_up_lines  # reads engine and dtype_reason, as on the real LLM


def test_a_swiftkv_model_shows_its_checkpoint_cache_and_dtype_in_the_banner_and_in_models(monkeypatch, capsys):
    from server_helpers import free_port

    from kvforge.serve import server

    served: dict[str, Any] = {}

    class _Captured:
        def __init__(self, config, engine) -> None:
            served["app"] = config.app

        def run(self) -> None:
            pass

    monkeypatch.setattr("kvforge.engine.llm.LLM", _FakeLLM)
    monkeypatch.setattr("kvforge.serve.graceful.GracefulServer", _Captured)
    args = build_parser(["serve"]).parse_args(
        ["serve", "--model", "smollm2-135m", "--swiftkv", "ckpt/swiftkv-50", "--cache", "kivi:bits=2",
         "--dtype", "bfloat16", "--port", str(free_port())])
    assert isinstance(args, argparse.Namespace)
    assert server.run_serve(args) == 0
    banner = capsys.readouterr().err
    for text in ("smollm2-135m", "swiftkv ckpt/swiftkv-50", "cache kivi:bits=2", "dtype bfloat16"):
        assert text in banner, banner
    with TestClient(served["app"]) as client:
        (entry,) = client.get("/v1/models").json()["data"]
    assert entry["kvforge"] == {"base_model": "smollm2-135m", "swiftkv": "ckpt/swiftkv-50", "cache": "kivi:bits=2",
                                "dtype": "bfloat16", "weights": "checkpoint"}


def test_a_huge_model_name_is_refused_with_a_short_message(app_client):
    response = post(app_client, COMPLETIONS, model="m" * 100_000)
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert len(response.json()["error"]["message"]) < 200


def test_every_neutral_field_is_declared_by_a_request_model():
    """A NEUTRAL entry no model declares would be dropped as unknown, never refused."""
    declared = set(unimplemented_fields(CompletionRequest)) | set(unimplemented_fields(ChatCompletionRequest))
    assert declared == set(NEUTRAL)
