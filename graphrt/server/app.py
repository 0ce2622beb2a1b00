"""The OpenAI-compatible HTTP API over an EngineLoop: an ASGI app (FastAPI) served by uvicorn.

Routes: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events),
GET /v1/models, GET /health, GET /metrics. Errors use OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``; a client's mistake is a 4xx, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphrt.sampling_params import InvalidRequestError
from graphrt.server.engine_loop import EngineLoop, EngineStoppedError, QueueFullError, Submission
from graphrt.server.guards import BearerAuth, BodyLimit, error_body
from graphrt.server.metrics import ServerMetrics
from graphrt.server.protocol import BadField, ChatCompletionRequest, CompletionRequest
from graphrt.server.responses import Choices, chat_chunk, completion_chunk, token_entries, usage

_FINISH = {"stop": "stop", "grammar": "stop", "length": "length", "abort": "abort"}


class ServerError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


def build_app(
    engine,
    model_name: str,
    api_key: str | None = None,
    max_queued: int = 128,
    max_body_bytes: int = 4 << 20,
    shutdown_timeout: float = 5.0,
    loras: dict | None = None,
) -> FastAPI:
    """The app serving ``engine`` (an LLMEngine, started) under ``model_name``, and each LoRA
    adapter of ``loras`` (name → LoRARequest, registered with the engine) under its own name. The
    engine thread starts with the app and stops (aborting what still runs) when the app shuts down."""
    loras = loras or {}
    metrics = ServerMetrics()
    loop = EngineLoop(engine, max_queued=max_queued, metrics=metrics)
    metrics.watch_engine(lambda: loop.stats)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        yield
        await loop.stop(shutdown_timeout)

    app = FastAPI(title="graphrt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine_loop = loop
    app.state.metrics = metrics
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key, prefix="/v1/")

    def fail(status: int, message: str, kind: str, param=None, code=None) -> JSONResponse:
        metrics.http_errors.labels(status=str(status)).inc()
        headers = {"Retry-After": "1"} if status == 429 else None
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        what = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            return fail(400, f"the request body is not valid JSON: {what}", "invalid_request_error")
        if first.get("type") == "extra_forbidden":
            return fail(400, f"unknown field {param!r}", "invalid_request_error", param)
        value = first.get("input")
        shown = "" if first.get("type") == "missing" else f" (got {json.dumps(value, default=str)[:100]})"
        return fail(400, f"{param}: {what}{shown}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kinds = {401: "authentication_error", 404: "NotFoundError", 413: "invalid_request_error"}
        return fail(exc.status_code, str(exc.detail), kinds.get(exc.status_code, "invalid_request_error"))

    @app.exception_handler(BadField)
    async def bad_field(request: Request, exc: BadField):
        return fail(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a server bug: still OpenAI's body
        return fail(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(ServerError)
    async def server_error(request: Request, exc: ServerError):
        return fail(exc.status, str(exc), exc.kind, exc.param, exc.code)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "graphrt"}
        card["max_model_len"] = engine.max_model_len
        adapters = [
            {"id": name, "object": "model", "created": 0, "owned_by": "graphrt", "parent": model_name} for name in loras
        ]
        return {"object": "list", "data": [card, *adapters]}

    def check_model(name: str | None):
        """The LoRARequest ``name`` selects (None: the base model)."""
        if name is None or name == model_name:
            return None
        if name in loras:
            return loras[name]
        served = [model_name, *loras]
        raise ServerError(
            404,
            f"model {name!r} does not exist; this server serves {served}",
            "NotFoundError",
            "model",
            "model_not_found",
        )

    async def submit(body, prompts: list, chat: bool) -> Submission:
        lora = check_model(body.model)
        try:
            params = body.sampling()  # one per choice
            # OpenAI's choice order: prompt by prompt, the n choices of each
            all_prompts = [prompt for prompt in prompts for _ in params]
            all_params = [p for _ in prompts for p in params]
            return await loop.submit(all_prompts, all_params, chat=chat, lora=lora)
        except BadField:
            raise
        except InvalidRequestError as e:
            raise ServerError(400, str(e), "invalid_request_error", _param_of(str(e), chat)) from None
        except QueueFullError as e:
            raise ServerError(429, f"too many requests waiting: {e}; retry later", "rate_limit_error") from None
        except EngineStoppedError as e:
            raise ServerError(503, str(e), "service_unavailable") from None

    async def respond(request: Request, body, submission: Submission, chat: bool, echo: list[str] | None):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            events = _stream(
                loop, engine, submission, chat, rid, created, model_name, include_usage, echo, body.alternatives()
            )
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        choices = Choices(engine, submission, chat, echo, body.alternatives())
        collect = asyncio.ensure_future(choices.collect())
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():  # the client left: free its blocks now
            loop.abort(submission)
            collect.cancel()
            raise ServerError(499, "the client closed the request", "client_closed")
        gone.cancel()
        if choices.error:
            raise ServerError(500, "the engine failed while serving this request; try again", "server_error")
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices.bodies(_FINISH),
            "usage": usage(submission, choices.token_counts()),
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = body.prompts()
        submission = await submit(body, prompts, chat=False)
        echo = None
        if body.echo:
            echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts for _ in range(body.n)]
        return await respond(request, body, submission, False, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        submission = await submit(body, [body.conversation()], chat=True)
        return await respond(request, body, submission, True, None)

    return app


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _param_of(message: str, chat: bool) -> str | None:
    """The request field an engine validation message is about."""
    head = message.split(": ", 1)[1] if message.startswith("prompt ") and ": " in message[:12] else message
    for field in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs"):
        if head.startswith(f"{field}="):
            return field
    if "prompt" in head[:40] or "chat template" in head:
        return "messages" if chat else "prompt"
    if head.startswith("invalid json_schema") or head.startswith("invalid json_object"):
        return "response_format"
    for field in ("regex", "grammar", "choice"):
        if head.startswith(f"invalid {field}"):
            return field
    return None


async def _stream(
    loop: EngineLoop, engine, submission: Submission, chat, rid, created, model_name, include_usage, echo, k=0
) -> AsyncIterator[str]:
    """Server-sent events: one chunk per request per step, then usage (if asked) and [DONE]."""
    make = chat_chunk if chat else completion_chunk
    finished = 0
    counts = [0] * len(submission.streams)
    try:
        if chat:
            for s in submission.streams:
                yield _event(make(rid, created, model_name, s.index, role="assistant", usage_field=include_usage))
        elif echo:
            for s in submission.streams:
                yield _event(make(rid, created, model_name, s.index, text=echo[s.index], usage_field=include_usage))
        async for index, delta in submission.events():
            counts[index] += len(delta.token_ids)
            if delta.finish_reason == "error":
                yield _event(error_body("the engine failed while serving this request", "server_error"))
                finished += 1
                continue
            tokens = None
            if delta.logprobs:
                tokens = token_entries(engine.tokenizer, delta.token_ids, delta.logprobs, delta.top_logprobs, k)
            finish = _FINISH.get(delta.finish_reason) if delta.finish_reason else None
            yield _event(
                make(
                    rid,
                    created,
                    model_name,
                    index,
                    text=delta.text,
                    logprobs=tokens,
                    finish=finish,
                    usage_field=include_usage,
                )
            )
            if delta.finish_reason is not None:
                finished += 1
        if include_usage:
            yield _event(
                {
                    "id": rid,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model_name,
                    "choices": [],
                    "usage": usage(submission, counts),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        if finished < len(submission.streams):  # the client went away mid-stream
            loop.abort(submission)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
