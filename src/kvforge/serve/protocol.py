"""The wire format: pydantic models of OpenAI's request bodies and the one error shape.

Requests follow OpenAI's schema. Unknown fields are ignored (as OpenAI's SDKs expect of a
compatible server); known fields are type-checked strictly (no "10" for 10, no true for
1), so a wrong type is a 400 that names the field. Fields OpenAI defines that kvforge does
not implement are accepted at their neutral value and refused otherwise, by the handlers,
with the parameter named. Extensions follow vLLM's names: `top_k`, `min_tokens`,
`ignore_eos`, `stop_token_ids`, `return_token_ids`.

Responses are plain dicts built by the handlers (they mirror OpenAI's objects).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationFields(_Body):
    """Fields both endpoints share."""

    model: str | None = None  # None: the served model
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: int | None = None  # 0 or -1: off
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    return_token_ids: bool | None = None  # adds token_ids (and prompt_token_ids) to each choice


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = None  # N: the chosen token's logprob and the N most likely
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Body):
    role: str
    # A string, or an array of parts of which kvforge reads {"type": "text", "text": ...}.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class APIError(Exception):
    """A request the server refuses; rendered in OpenAI's error schema."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}


def bad_request(param: str, value: Any, rule: str) -> APIError:
    """400 naming the parameter, its value and the rule (kvforge's ConfigError wording)."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return APIError(400, f"invalid {param}={shown}: {rule}", param=param)
