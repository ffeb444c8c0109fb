"""The FastAPI application: routes, the API key, and every error in OpenAI's schema.

Routes only: the handlers (completions.py, chat.py) turn requests into engine inputs and
outputs into responses. The app starts the engine thread when it starts and stops it when
it shuts down.

Errors: 400 `invalid_request_error` naming the parameter (bad JSON, wrong types, values
out of range, prompts beyond the context or the KV budget), 401 without the API key when
one is set, 404 for an unknown model or route, 503 while shutting down, 500 if an engine
step failed (that request only).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.engine.async_engine import EngineStepError, EngineUnavailableError
from kvforge.errors import KVForgeError
from kvforge.serve.chat import ChatHandler
from kvforge.serve.completions import CompletionHandler
from kvforge.serve.metrics import CONTENT_TYPE, ServerMetrics
from kvforge.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvforge.serve.served_model import ServedModel
from kvforge.serve.streams import ClientDisconnected, api_error_of
from kvforge.serve.tokenize import TokenizeHandler

logger = logging.getLogger(__name__)

# Fields whose types are unions: one sentence instead of one pydantic error per member.
UNION_RULES = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or an array of content parts",
    "tool_choice": "must be a string or an object",
}


def create_app(served: ServedModel, metrics: ServerMetrics | None = None, api_key: str | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
        try:
            yield
        finally:
            served.engine.stop()

    app = FastAPI(title="kvforge", lifespan=lifespan)
    completions, chat = CompletionHandler(served), ChatHandler(served)
    tokens = TokenizeHandler(served, chat)

    async def check_key(authorization: str | None = Header(default=None)) -> None:
        if api_key is None:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card()]}

    @v1.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Any:
        return await completions.create(body, raw)

    @v1.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Any:
        return await chat.create(body, raw)

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if served.engine.accepting:
            return JSONResponse({"status": "ok", "model": served.name})
        return JSONResponse({"status": "unavailable", "model": served.name}, status_code=503)

    @app.post("/tokenize", dependencies=[Depends(check_key)])
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's endpoint: the token ids a prompt or a chat's messages would generate from."""
        return tokens.tokenize(body)

    @app.post("/detokenize", dependencies=[Depends(check_key)])
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return tokens.detokenize(body)

    @app.post("/reset_prefix_cache", dependencies=[Depends(check_key)])
    async def reset_prefix_cache() -> Response:
        """vLLM's endpoint: forget the cached prefixes (their KV bytes are freed); what runs
        keeps running. A benchmark or a soak then starts cold, or checks nothing else is held."""
        if not await served.engine.reset_prefix_cache():
            return JSONResponse({"status": "timeout"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.render() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE)

    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_api_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), error_type=error_type).body(),
                            status_code=exc.status_code)

    @app.exception_handler(EngineUnavailableError)
    @app.exception_handler(EngineStepError)
    async def engine_failed(_: Request, exc: KVForgeError) -> JSONResponse:
        error = api_error_of(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientDisconnected)
    async def gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left


def validation_api_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 from pydantic's errors: the first error's field, path and rule."""
    error = errors[0]
    path = [part for part in error.get("loc", ()) if part != "body"]
    kept: list[str] = []
    for part in path:
        if isinstance(part, int):
            kept[-1:] = [f"{kept[-1]}[{part}]" if kept else f"[{part}]"]
        elif "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper():
            break  # a union member's tag: the field itself is what was wrong
        else:
            kept.append(part)
    param = ".".join(kept) or "body"
    field = kept[-1].split("[")[0] if kept else ""
    if error.get("type") == "missing":
        rule = "is required"
    elif error.get("type") == "json_invalid":
        param, rule = "body", f"is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')})"
    elif not kept and isinstance(error.get("input"), bytes):  # FastAPI reads JSON only under its content type
        return APIError(400, "invalid body: must be a JSON object sent with the header Content-Type: "
                             "application/json", param="body")
    elif field in UNION_RULES and len(path) > len(kept):
        rule = UNION_RULES[field]
    else:
        rule = str(error.get("msg", "is invalid")).rstrip(".")
        rule = rule[:1].lower() + rule[1:]
    value = error.get("input")
    shown = "" if error.get("type") in ("missing", "json_invalid") else f"={value!r}"[:80]
    return APIError(400, f"invalid {param}{shown}: {rule}", param=param)
