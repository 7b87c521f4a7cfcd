"""The HTTP face of the server: a FastAPI app over an :class:`~ascend_vlm.serving.engine.
Engine`, with OpenAI's routes and error objects.

Routes: ``POST /v1/chat/completions`` (JSON, or server-sent events with ``stream: true``),
``GET /v1/models``, ``GET /health`` (200 while admitting, 503 while draining, so a readiness
probe takes the replica out), ``GET /metrics`` (:mod:`~ascend_vlm.serving.metrics`).

Every error is OpenAI's error object (:mod:`~ascend_vlm.serving.errors`): FastAPI's 422 for a
body that does not validate becomes 400 naming the field as the client spelled it; an unknown
``model`` 404; a request over a budget of the batch 400 naming the budget's flag, one the
model cannot encode 400 naming ``messages``; a full queue 429; draining 503; any other
failure (the model's, or the server's while taking the request) 500, logged. A stream that fails after it started ends with an ``{"error": ...}`` event
and ``data: [DONE]``. A client that leaves (disconnects) cancels its request, which frees its
batch row at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ascend_vlm.batching import BudgetError, RequestResult
from ascend_vlm.batching.command_line import budget_message
from ascend_vlm.serving.conversion import (
    FINISH_REASONS,
    ResponseHeader,
    ServedModels,
    chunk,
    completion,
    generation_request,
    usage,
)
from ascend_vlm.serving.engine import (
    Admitted,
    Draining,
    Engine,
    EngineFailure,
    QueueFull,
    RequestStream,
)
from ascend_vlm.serving.errors import ApiError, error_body
from ascend_vlm.serving.limits import LIMIT_FLAGS, ServingLimits
from ascend_vlm.serving.metrics import CONTENT_TYPE, ServingMetrics
from ascend_vlm.serving.middleware import BearerAuth, BodyLimit
from ascend_vlm.serving.protocol import ChatCompletionRequest

LOG = logging.getLogger(__name__)
CHAT_PATH = "/v1/chat/completions"
# The status logged for a request whose client left first (nginx's convention; nobody reads it).
CLIENT_CLOSED_REQUEST = 499
# Seconds between checks that a waiting non-streaming client is still connected.
DISCONNECT_POLL_SECONDS = 0.25
# The request field a budget's refusal points at.
BUDGET_PARAMS = {
    "max_batch_tokens": "messages",
    "max_visual_tokens_per_step": "messages",
    "max_kv_bytes": "max_completion_tokens",
}
_TYPE_NAMES = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\]A-Z-]")


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


def _param(location: tuple, body: Any) -> str | None:
    """A pydantic error location in the request ``body`` as a dotted request field, without
    pydantic's union-member names and repeated discriminator tags. The location is followed
    through ``body``: a key the client sent is kept as sent (``maxTokens`` too), and only an
    item that is no key of ``body`` and reads as a type's name is pydantic's own."""
    parts: list[str] = []
    value = body
    for item in location[1:] if location[:1] == ("body",) else location:
        sent = isinstance(value, dict) and item in value
        sent = sent or (isinstance(value, list) and isinstance(item, int) and item < len(value))
        if sent:
            value = value[item]
        elif isinstance(item, str) and _TYPE_NAMES.search(item):
            continue
        else:  # a field the client left out, or a discriminator tag
            value = None
        text = str(item)
        if not parts or parts[-1] != text:
            parts.append(text)
    return ".".join(parts) or None


def _validation_error(error: RequestValidationError) -> ApiError:
    """The 400 for a body that does not validate: it names the deepest field at fault (a
    union's members fail at different depths; the deepest is the one the client meant) with
    what was wrong there."""
    problems = error.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request body"}
    if first.get("type") == "json_invalid":
        why = first.get("ctx", {}).get("error", "not JSON")
        return ApiError(400, f"body: expected a JSON object ({why})", None, "invalid_json")
    located = [(_param(tuple(problem["loc"]), error.body), problem["msg"]) for problem in problems]
    param = max((where for where, _ in located), key=lambda where: len((where or "").split(".")))
    messages = list(dict.fromkeys(message for where, message in located if where == param))[:3]
    return ApiError(400, f"{param or 'body'}: {'; or '.join(messages)}", param, "invalid_value")


def _budget_error(error: BudgetError) -> ApiError:
    budget = str(error).partition(": ")[0]
    param = BUDGET_PARAMS.get(budget)
    return ApiError(400, budget_message(error), param=param, code="budget_exceeded")


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class _Exchange:
    """One chat-completion request in flight: its stream, timings and metrics."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServingMetrics,
        stream: RequestStream,
        header: ResponseHeader,
        received: float,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.stream = stream
        self.header = header
        self.received = received
        self.first_token: float | None = None
        self.admitted: Admitted | None = None

    async def next(self, request: Request | None) -> Any:
        """The stream's next item; with ``request``, raise _ClientGone when its client left."""
        if request is None:
            return await self.stream.get()
        getter = asyncio.ensure_future(self.stream.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    return getter.result()
                if await request.is_disconnected():
                    raise _ClientGone
        finally:
            getter.cancel()

    async def admit(self, request: Request) -> Admitted:
        """Wait for the engine to accept the request; ApiError when it refused it: 400 for the
        request's fault (a budget, or messages the model cannot encode), else 500 (logged,
        counted)."""
        item = await self.next(request)
        if isinstance(item, BudgetError):
            raise _budget_error(item)
        if isinstance(item, ValueError):
            raise ApiError(
                400, f"messages: cannot be encoded ({item})", "messages", "invalid_value"
            )
        if isinstance(item, Exception):
            LOG.error("%s: the generator raised at submission", self.header.request_id,
                      exc_info=item)  # fmt: skip
            self.metrics.count("error")
            message = f"the server failed to take the request: {type(item).__name__}: {item}"
            raise ApiError(500, message, code="server_error")
        self.admitted = item
        self.metrics.prompt_tokens.inc(item.prompt_tokens)
        self.metrics.visual_tokens.inc(item.visual_tokens)
        return item

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
            self.metrics.time_to_first_token.observe(self.first_token - self.received)

    def failure(self, item: Any) -> ApiError | None:
        """None when ``item`` (the stream's last) answered the request; else the error to
        report, counted."""
        if isinstance(item, RequestResult) and item.finish_reason in FINISH_REASONS:
            now = time.perf_counter()
            tokens = len(item.tokens)
            self.metrics.generated_tokens.inc(tokens)
            if tokens > 1 and self.first_token is not None:
                self.metrics.time_per_output_token.observe((now - self.first_token) / (tokens - 1))
            self.metrics.request_duration.observe(now - self.received)
            self.metrics.count("ok")
            return None
        if isinstance(item, RequestResult) and item.finish_reason == "cancelled":
            self.metrics.count("unavailable")
            return ApiError(503, "the server shut down before the answer ended", code="draining")
        self.metrics.count("error")
        # An EngineFailure says "the model failed: <error>"; anything else ended it unanswered.
        message = str(item) if isinstance(item, EngineFailure) else "the model failed"
        return ApiError(500, message, code="server_error")

    async def answer(self, request: Request) -> dict[str, Any]:
        """The whole ``chat.completion`` (the non-streaming answer)."""
        while True:
            item = await self.next(request)
            if isinstance(item, str):
                self.token()
                continue
            error = self.failure(item)
            if error is not None:
                raise error
            return completion(self.header, item, self.admitted)

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of a streaming answer: a role chunk, a chunk per text
        delta, the finish chunk (carrying ``usage`` unless a usage chunk follows), the usage
        chunk when ``include_usage``, then ``[DONE]``."""
        ended = False
        try:
            yield _sse(chunk(self.header, {"role": "assistant", "content": ""}))
            while True:
                item = await self.stream.get()
                if isinstance(item, str):
                    self.token()
                    if item:
                        yield _sse(chunk(self.header, {"content": item}))
                    continue
                ended = True
                error = self.failure(item)
                if error is not None:
                    yield _sse(error.body())
                else:
                    counts = usage(self.admitted, item)
                    reason = FINISH_REASONS[item.finish_reason]
                    yield _sse(chunk(self.header, {}, reason, None if include_usage else counts))
                    if include_usage:
                        yield _sse(chunk(self.header, None, usage_object=counts))
                yield _sse("[DONE]")
                return
        finally:
            if not ended:  # the client left mid-stream
                self.engine.cancel(self.header.request_id)
                self.metrics.count("cancelled")


def _install_error_handlers(app: FastAPI, count_refusal: Any) -> None:
    """Answer every error with OpenAI's error object; ``count_refusal(path, status)`` counts
    the chat requests refused before their handler ran."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        count_refusal(request.url.path, "invalid")
        refusal = _validation_error(error)
        return JSONResponse(refusal.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        body = error_body(error.status_code, f"{request.url.path}: {error.detail}")
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        count_refusal(request.url.path, "error")
        body = error_body(500, f"internal error: {type(error).__name__}", code="server_error")
        return JSONResponse(body, status_code=500)


class _ChatCompletions:
    """The ``POST /v1/chat/completions`` handler over ``engine``."""

    def __init__(
        self,
        engine: Engine,
        served: ServedModels,
        limits: ServingLimits,
        metrics: ServingMetrics,
        decoded_images: Any = None,
    ) -> None:
        self.engine = engine
        self.served = served
        self.limits = limits
        self.metrics = metrics
        self.decoded_images = decoded_images

    async def _submit(self, body: ChatCompletionRequest, request_id: str) -> RequestStream:
        """The request handed to the engine; ApiError (counted) when it is refused."""
        try:
            adapter = self.served.adapter_for(body.model)
            generation = await run_in_threadpool(
                generation_request, body, adapter, self.limits, request_id, self.decoded_images
            )
            return self.engine.submit(generation, asyncio.get_running_loop())
        except ApiError:
            self.metrics.count("invalid")
            raise
        except QueueFull as error:
            self.metrics.count("queue_full")
            raise ApiError(429, str(error), code="queue_full") from None
        except Draining as error:
            self.metrics.count("unavailable")
            raise ApiError(503, str(error), code="draining") from None

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Any:
        received = time.perf_counter()
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._submit(body, request_id)
        header = ResponseHeader.now(request_id, body.model)
        exchange = _Exchange(self.engine, self.metrics, stream, header, received)
        try:
            await exchange.admit(request)
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(
                    exchange.events(include_usage),
                    media_type="text/event-stream",
                    headers={"cache-control": "no-cache"},
                )
            return await exchange.answer(request)
        except ApiError as error:
            if error.status == 400:
                self.metrics.count("invalid")
            raise
        except (_ClientGone, asyncio.CancelledError) as gone:
            self.engine.cancel(request_id)
            self.metrics.count("cancelled")
            if isinstance(gone, asyncio.CancelledError):
                raise
            return Response(status_code=CLIENT_CLOSED_REQUEST)


def build_app(
    engine: Engine,
    served: ServedModels,
    limits: ServingLimits,
    api_key: str | None = None,
    vision_cache: Any = None,
    decoded_images: Any = None,
) -> Any:
    """The server's ASGI app over a started ``engine``: FastAPI with the routes, inside the
    body-size limit and, with ``api_key``, the bearer check. ``vision_cache``: the model's
    :class:`~ascend_vlm.reuse.VisionCache`, whose hits and misses ``/metrics`` reports.
    ``decoded_images``: the cache of decoded request images
    (:func:`~ascend_vlm.serving.images.decoded_image_cache`; None: every image decoded)."""
    metrics = ServingMetrics(
        queue_depth=lambda: engine.queue_depth,
        running_rows=lambda: engine.running_rows,
        kv_bytes=lambda: engine.kv_bytes,
        kv_tokens=lambda: engine.kv_tokens,
        vision_cache=lambda: vision_cache,
    )
    created = int(time.time())
    app = FastAPI(title="ascend_vlm", summary="OpenAI-compatible VLM server")

    def count_refusal(path: str, status: str) -> None:
        if path == CHAT_PATH:
            metrics.count(status)

    _install_error_handlers(app, count_refusal)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the server admits requests; 503 while it drains or once its engine
        stopped."""
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if engine.admitting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "draining"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The served model and each resident adapter."""
        return served.listing(created)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """The metrics in Prometheus' text format."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    app.post(
        CHAT_PATH,
        summary="OpenAI's chat completion: JSON, or server-sent events with stream: true",
    )(_ChatCompletions(engine, served, limits, metrics, decoded_images).__call__)
    guarded: Any = BodyLimit(
        app,
        limits.max_body_bytes,
        LIMIT_FLAGS["max_body_bytes"],
        lambda path: count_refusal(path, "invalid"),
    )
    if api_key:
        guarded = BearerAuth(guarded, api_key, lambda path: count_refusal(path, "unauthorized"))
    return guarded
