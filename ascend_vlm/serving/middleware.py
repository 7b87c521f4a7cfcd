"""ASGI middleware of the server, outermost first: :class:`BearerAuth` (with ``--api-key``,
every path but ``/health`` needs ``Authorization: Bearer KEY``, compared in constant time) and
:class:`BodyLimit` (a request body over the limit is refused with 413, whether it announces
its length or streams it in chunks). Both answer with OpenAI's error object."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from ascend_vlm.serving.errors import error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
OPEN_PATHS = ("/health",)


async def send_error(send: Send, status: int, body: dict[str, Any], headers=()) -> None:
    """Answer ``status`` with the JSON ``body``."""
    payload = json.dumps(body).encode()
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()), *headers],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


class BearerAuth:
    """Refuse (401) any HTTP request but to :data:`OPEN_PATHS` without the bearer ``api_key``;
    ``on_refusal(path)`` is told of each refusal."""

    def __init__(self, app: App, api_key: str, on_refusal: Callable[[str], None]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                self._on_refusal(scope["path"])
                body = error_body(
                    401, "Authorization: expected 'Bearer <the server's --api-key>'",
                    param=None, code="invalid_api_key",
                )  # fmt: skip
                await send_error(send, 401, body, [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse (413) a request body over ``max_bytes`` (``flag`` names the limit in the
    message); ``on_refusal(path)`` is told of each refusal."""

    def __init__(
        self, app: App, max_bytes: int, flag: str, on_refusal: Callable[[str], None]
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._flag = flag
        self._on_refusal = on_refusal

    def _body(self) -> dict[str, Any]:
        return error_body(
            413,
            f"request body: larger than {self._flag} ({self.max_bytes} bytes)",
            param=None,
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            self._on_refusal(scope["path"])
            await send_error(send, 413, self._body())
            return
        received = 0
        answered = False

        async def counted_receive() -> dict[str, Any]:
            # Past the limit: answer 413 now and tell the app the client left; whatever it
            # answers then is dropped.
            nonlocal received, answered
            message = await receive()
            if message["type"] == "http.request" and not answered:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    answered = True
                    self._on_refusal(scope["path"])
                    await send_error(send, 413, self._body())
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not answered:
                await send(message)

        await self.app(scope, counted_receive, guarded_send)
