"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (or a chat's messages) as the
token ids generation would run on, and token ids back as text, with the checks of the
generation endpoints (the model's name, a tokenizer, ids inside the vocabulary)."""

from __future__ import annotations

from typing import Any

from kvforge.models.tokenizer import encode_prompt
from kvforge.serve.chat import ChatHandler
from kvforge.serve.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from kvforge.serve.served_model import ServedModel, refuse_unimplemented


class TokenizeHandler:
    def __init__(self, served: ServedModel, chat: ChatHandler) -> None:
        self.served, self.chat = served, chat

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        served = self.served
        served.check_name(body.model)
        refuse_unimplemented(body)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", body.prompt, "send exactly one of prompt (text) and messages (a chat)")
        if body.messages is not None:
            if body.add_special_tokens:
                raise bad_request("add_special_tokens", True, "must be false with messages: the chat template "
                                                              "places the special tokens")
            ids = self.chat.prompt_ids(body.messages)
        else:
            tokenizer = served.require_tokenizer("prompt", body.prompt)
            ids = (encode_prompt(tokenizer, body.prompt, chat=False) if body.add_special_tokens in (None, True)
                   else [int(t) for t in tokenizer.encode(body.prompt, add_special_tokens=False)])
        out: dict[str, Any] = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = served.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        served = self.served
        served.check_name(body.model)
        served.check_token_ids(body.tokens, "tokens", "")
        return {"prompt": served.require_tokenizer("tokens", body.tokens).decode(body.tokens)}
