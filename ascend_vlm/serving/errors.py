"""OpenAI's error object, and the one exception every layer of the server raises to answer
with it.

Every error the server answers is ``{"error": {"message", "type", "param", "code"}}`` with an
HTTP status: ``param`` names the request field at fault (dotted, e.g.
``messages.0.content.1.image_url.url``) or is null, ``code`` is a short machine-readable
reason (``invalid_value``, ``budget_exceeded``, ``queue_full`` ...).
"""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An answer with OpenAI's error object: ``status`` (HTTP), ``message`` (names the field
    or limit and what was expected), ``param`` (the field, or None) and ``code``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's clients read."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for an answer of HTTP ``status``."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
