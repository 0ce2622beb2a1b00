"""ASGI middleware that guards the API: a bearer key and a body-size limit. Plain ASGI (not
Starlette's BaseHTTPMiddleware) so that streamed responses and client disconnects pass through
untouched."""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def _send_error(send, status: int, message: str, kind: str, headers=()) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """Requests under ``prefix`` without ``Authorization: Bearer <key>`` get 401 and nothing else."""

    def __init__(self, app, api_key: str, prefix: str = "/v1/") -> None:
        self.app, self.expected, self.prefix = app, f"Bearer {api_key}".encode(), prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _send_error(
                    send,
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    "authentication_error",
                    [(b"www-authenticate", b"Bearer")],
                )
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies over ``max_bytes`` get 413: by Content-Length before anything is read,
    and while the app reads a body sent without one."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _send_error(send, 413, message, "invalid_request_error")
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)  # answered 413 by the app's HTTPException handler
            return msg

        await self.app(scope, limited_receive, send)


class _TooLarge(HTTPException):
    """Raised while the app reads the body; the app's HTTPException handler answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than {max_bytes} bytes")
