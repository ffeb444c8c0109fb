"""`POST /v1/chat/completions`: messages rendered with the model's chat template, streaming
or not, logprobs with `top_logprobs` alternatives.

A message's `content` is a string or an array of parts; text parts are joined with a
newline (as vLLM does), any other kind of part is refused with the parameter named.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from kvforge.engine.outputs import RequestOutput
from kvforge.engine.sampling import MAX_TOP_LOGPROBS, SamplingParams
from kvforge.models.tokenizer import encode_prompt, has_chat_template
from kvforge.serve.logprobs import TokenText, chat_logprobs, token_id_text
from kvforge.serve.protocol import ChatCompletionRequest, ChatMessage, bad_request
from kvforge.serve.served_model import ServedModel, sample_params, samples_per_prompt, sampling_params
from kvforge.serve.shared_prefill import after_first_sample
from kvforge.serve.streams import DONE, ending_with_error_event, last_items, outputs, sse, unless_disconnected
from kvforge.serve.tool_calls import ToolCallDeltas, ToolPlan, tool_plan

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatHandler:
    def __init__(self, served: ServedModel) -> None:
        self.served = served

    async def create(self, body: ChatCompletionRequest, raw: Request) -> Any:
        served = self.served
        served.check_name(body.model)
        served.check_available()
        prompt, params, plan = self._inputs(body)
        await served.check_constraint(params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        arrival = time.perf_counter()
        # One engine request per choice (OpenAI's n); the first keeps the response's id.
        samples = range(samples_per_prompt(body))
        streams = after_first_sample([served.engine.generate(prompt, sample_params(params, index),
                                                             request_id if index == 0 else f"{request_id}-{index}",
                                                             arrival) for index in samples],
                                     samples, served.prefix_caching)
        head = {"id": request_id, "created": int(time.time()), "model": served.name}
        ids = bool(body.return_token_ids)
        shown = token_id_text if body.return_tokens_as_token_ids else None
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            events = self._events(head, prompt, streams, params, usage, ids, shown, plan)
            return StreamingResponse(ending_with_error_event(events), media_type="text/event-stream")
        finals = await unless_disconnected(raw, last_items(streams))
        choices = []
        for index, out in enumerate(finals):
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            finish_reason = out.finish_reason
            calls = plan.calls(out.text) if plan is not None else None
            if calls is not None and plan is not None:
                message, finish_reason = {**message, "content": "", "tool_calls": calls}, plan.finish_reason(finish_reason)
            choice: dict[str, Any] = {"index": index, "message": message,
                                      "logprobs": self._logprobs(out.token_ids, out, params, shown),
                                      "finish_reason": finish_reason}
            if ids:
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": _usage(prompt, finals)})

    # -- request -> engine inputs -----------------------------------------------------
    def prompt_ids(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of `messages` (and the tools, for a template that shows them) through
        the model's chat template (also /tokenize's)."""
        served = self.served
        served.require_tokenizer("messages", "...")
        if not has_chat_template(served.tokenizer):
            raise bad_request("messages", "...", f"{served.name} has no chat template: use /v1/completions")
        return encode_prompt(served.tokenizer, _messages(messages), chat=True, tools=tools)

    def _inputs(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ToolPlan | None]:
        served = self.served
        plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        top = body.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request("top_logprobs", top, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if top and not body.logprobs:
            raise bad_request("top_logprobs", top, "needs logprobs=true")
        prompt = served.truncated(self.prompt_ids(body.messages, plan.tools if plan else None), body)
        served.check_prompt(prompt, "messages")
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, served.max_tokens(requested, len(prompt), name,
                                                          fit=body.truncate_prompt_tokens is not None), served.vocab_size,
                                 plan.constraint if plan else None, logprobs=bool(body.logprobs), top_logprobs=top)
        served.check_params(params)
        return prompt, params, plan

    # -- engine outputs -> response ---------------------------------------------------
    def _logprobs(self, token_ids: list[int], out: RequestOutput, params: SamplingParams,
                  shown: TokenText | None) -> dict[str, Any] | None:
        if not params.logprobs:
            return None
        count = len(token_ids)
        tops = (out.top_logprobs or [])[-count:] if count else []
        return chat_logprobs(self.served.token_text, token_ids, (out.logprobs or [])[-count:] if count else [],
                             tops or None, shown)

    async def _events(self, head: dict[str, Any], prompt: list[int], streams: list[AsyncIterator[RequestOutput]],
                      params: SamplingParams, include_usage: bool, ids: bool,
                      shown: TokenText | None, plan: ToolPlan | None) -> AsyncIterator[str]:
        chunk_head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if include_usage else {}
        for index in range(len(streams)):  # each choice opens with the assistant's role
            first: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}
            if ids:
                first["prompt_token_ids"] = prompt
            yield sse({**chunk_head, "choices": [first], **extra})
        finals: list[RequestOutput | None] = [None] * len(streams)
        tool_deltas = [ToolCallDeltas(plan) for _ in streams] if plan and plan.constraint else None
        async with aclosing(outputs(streams)) as merged:  # a bug in this loop aborts the requests now
            async for index, out in merged:
                finals[index] = out
                finish_reason = out.finish_reason if out.finished else None
                if tool_deltas is None:
                    delta: dict[str, Any] = {"content": out.new_text} if out.new_text else {}
                else:
                    delta = tool_deltas[index].delta(out.new_text, out.finished, out.text)
                    if out.finished and plan is not None and plan.complete(out.text):
                        finish_reason = plan.finish_reason(finish_reason)
                choice: dict[str, Any] = {
                    "index": index, "delta": delta,
                    "logprobs": self._logprobs(out.new_token_ids, out, params, shown),
                    "finish_reason": finish_reason}
                if ids:
                    choice["token_ids"] = out.new_token_ids
                yield sse({**chunk_head, "choices": [choice], **extra})
        if include_usage and all(out is not None for out in finals):
            yield sse({**chunk_head, "choices": [], "usage": _usage(prompt, finals)})
        yield DONE


def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages with their content as one string, checked field by field."""
    if not messages:
        raise bad_request("messages", [], "must hold at least one message")
    out = []
    for index, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{index}].role", message.role, f"must be one of {list(ROLES)}")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{index}].content[{part_index}]", part.get("type"),
                                      "only text parts ({'type': 'text', 'text': ...}) are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):  # (for a template that shows tool use)
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        out.append(entry)
    return out


def _usage(prompt: list[int], finals: list[RequestOutput] | list[RequestOutput | None]) -> dict[str, int]:
    """The prompt counted once, whatever n; the completions of every choice."""
    completion = sum(len(out.token_ids) for out in finals if out is not None)
    return {"prompt_tokens": len(prompt), "completion_tokens": completion, "total_tokens": len(prompt) + completion}
