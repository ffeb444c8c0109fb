"""The wire format: pydantic models of OpenAI's request bodies and the one error shape.

Requests follow OpenAI's schema. Unknown fields are ignored (as OpenAI's SDKs expect of a
compatible server); known fields are type-checked strictly (no "10" for 10, no true for
1), so a wrong type is a 400 that names the field. Extensions follow vLLM's names:
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`,
`allowed_token_ids`, `include_stop_str_in_output`, `return_token_ids`, `skip_special_tokens`,
`truncate_prompt_tokens` (with `truncation_side`), and the structured-output
fields (`structured_outputs`, `guided_json`, ...).

Fields OpenAI or vLLM define that kvforge does not implement are declared here too, so
that a client who sets one learns it: each is accepted at its neutral value (`NEUTRAL`:
omitted, null, or the value vLLM's clients send by default) and refused otherwise with a
400 naming it, never silently ignored.

Responses are plain dicts built by the handlers (they mirror OpenAI's objects).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# Fields kvforge does not implement -> the values that mean "not used" besides null
# (booleans compare by identity, numbers by value).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    # vLLM's sampling extensions
    "use_beam_search": (False,), "length_penalty": (1,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (), "logits_processors": (),
    # vLLM's structured output and other extensions
    "guided_decoding_backend": ("auto", "guidance"), "guided_whitespace_pattern": (),
    "priority": (0,), "request_id": (), "cache_salt": (),
    "kv_transfer_params": (), "vllm_xargs": (), "prompt_embeds": (),
    # chat only: templates, documents, multimodal and reasoning options
    "add_generation_prompt": (True,), "continue_final_message": (False,), "echo": (False,),
    "chat_template": (), "chat_template_kwargs": ({},), "documents": (), "mm_processor_kwargs": (),
    "reasoning_effort": (), "functions": (), "function_call": (), "audio": (), "modalities": (["text"],),
    "prediction": (),
}


def unimplemented_fields(model: type[BaseModel]) -> tuple[str, ...]:
    """The fields of a request model that kvforge declares but does not implement: those
    named in NEUTRAL and typed Any (a completion's `echo` is implemented, a chat's is not)."""
    return tuple(name for name, field in model.model_fields.items() if name in NEUTRAL and field.annotation is Any)


def is_neutral(name: str, value: Any) -> bool:
    """True when `value` of the unimplemented field `name` asks for nothing kvforge lacks."""
    return value is None or any(_same(value, neutral) for neutral in NEUTRAL[name])


def _same(value: Any, neutral: Any) -> bool:
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral  # true is not 1, 1 is not true
    return bool(value == neutral)  # 1 == 1.0; lists and objects by content


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
    best_of: int | None = None  # vLLM's; only best_of = n is supported
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
    min_p: float | None = None  # 0: off
    repetition_penalty: float | None = None  # 1: off
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be chosen
    include_stop_str_in_output: bool | None = None  # the text ends with the stop string that ended it
    return_token_ids: bool | None = None  # adds token_ids (and prompt_token_ids) to each choice
    skip_special_tokens: bool | None = None  # false: special tokens' text is part of the output
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: max_model_len - 1)
    truncation_side: str | None = None  # which end truncation keeps: "left" (default) keeps the last tokens
    bad_words: list[str] | None = None  # words the output never completes
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    # The text's shape (serve/structured_fields.py): OpenAI's, and vLLM's current and older fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Not implemented: accepted only at their neutral value (NEUTRAL), refused by name otherwise.
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None
    guided_decoding_backend: Any = None  # llguidance (vLLM's "guidance") always
    guided_whitespace_pattern: Any = None
    priority: Any = None
    request_id: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    prompt_embeds: Any = None


class CompletionRequest(_GenerationFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = None  # N: the chosen token's logprob and the N most likely
    echo: bool | None = False
    suffix: str | None = None


class ChatMessage(_Body):
    role: str
    # A string, or an array of parts of which kvforge reads {"type": "text", "text": ...}.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the chat template
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # serve/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None  # "none", "required" or a named function ("auto" is a 400)
    parallel_tool_calls: bool | None = None  # false: "required" makes one call
    # Not implemented: accepted only at their neutral value (NEUTRAL), refused by name otherwise.
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    reasoning_effort: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a completion's `prompt` or a chat's `messages`, as the server would
    encode them for generation."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    return_token_strs: bool | None = None
    # chat template options kvforge does not implement: refused unless neutral (NEUTRAL)
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    mm_processor_kwargs: Any = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


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
