"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (or a chat's messages) as the
token ids generation would run on, and token ids back as text, with the checks of the
generation endpoints (the model's name, a tokenizer, ids inside the vocabulary)."""

from __future__ import annotations

from typing import Any

from kvforge.models.tokenizer import encode_prompt
from kvforge.serve.chat import ChatHandler
from kvforge.serve.protocol import DetokenizeRequest, TokenizeRequest, bad_request
from kvforge.serve.served_model import ServedModel


class TokenizeHandler:
    def __init__(self, served: ServedModel, chat: ChatHandler) -> None:
        self.served, self.chat = served, chat

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        served = self.served
        served.check_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", body.prompt, "send exactly one of prompt (text) and messages (a chat)")
        if body.messages is not None:
            ids = self.chat.prompt_ids(body.messages)
        else:
            ids = encode_prompt(served.require_tokenizer("prompt", body.prompt), body.prompt, chat=False)
        return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        served = self.served
        served.check_name(body.model)
        served.check_token_ids(body.tokens, "tokens", "")
        return {"prompt": served.require_tokenizer("tokens", body.tokens).decode(body.tokens)}
