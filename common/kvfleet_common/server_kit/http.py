"""HTTP pieces the engine server and the gateway share: OpenAI-shaped errors, a body-size limit, bearer checks.

Needs FastAPI (the engine and gateway extras); the operator never imports it.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with the right
status; validation errors are 400 (not FastAPI's 422), and an unexpected exception is a 500 with
a short message (the traceback goes to the log, never to the client).
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfleet_common.openai_protocol import error_body

logger = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    """The 400 for pydantic / FastAPI validation errors: the first problem, named by its field."""
    message, param = _validation_message(errors)
    return JSONResponse(error_body(400, message, param, "invalid_request"), status_code=400)


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            None,
        )
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param


def too_large_response(max_bytes: int) -> JSONResponse:
    return JSONResponse(
        error_body(413, f"the request body exceeds {max_bytes} bytes", code="request_too_large"),
        status_code=413,
    )


def unexpected_error_response(exc: BaseException) -> JSONResponse:
    """A 500 that names the exception's type only (the caller logs the traceback)."""
    return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return unexpected_error_response(exc)


def bearer_token(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_matches(request: Request, secret: str) -> bool:
    """Whether the request carries ``secret`` as its bearer token (constant-time compare)."""
    token = bearer_token(request)
    return token is not None and hmac.compare_digest(token.encode(), secret.encode())


MAX_REQUEST_ID_CHARS = 200
_REQUEST_ID = re.compile(rf"[!-~]{{1,{MAX_REQUEST_ID_CHARS}}}")  # visible ASCII: no spaces, no controls


def client_request_id(request: Request) -> str | None:
    """The client's ``X-Request-Id`` when it is one to carry on: 1-200 visible ASCII characters. Otherwise
    None, and the server names the request itself (as Heroku's router does with an id it will not take).

    The id goes into every log line of the request, onto the spans, to the replica and back in the
    response; an id of any size (up to the 64 KiB head bound) or with spaces would bloat or break those
    lines, and refusing a request over a tracing header would be worse."""
    value = request.headers.get("x-request-id")
    return value if value is not None and _REQUEST_ID.fullmatch(value) else None


def declared_length_exceeds(scope: Scope, max_bytes: int) -> bool:
    """Whether the request's Content-Length says more than ``max_bytes``."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit() and int(value) > max_bytes:
            return True
    return False


class BodySizeLimit:
    """413 for request bodies over ``max_bytes`` (by Content-Length, or counted while streaming in)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if declared_length_exceeds(scope, self.max_bytes):
            await self._reject(send)
            return
        seen = 0
        too_big = False

        async def counting_receive() -> Message:
            nonlocal seen, too_big
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    too_big = True
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, counting_receive, send)
        except _BodyTooLarge:
            await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = too_large_response(self.max_bytes)
        await send({"type": "http.response.start", "status": 413, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})


class _BodyTooLarge(Exception):
    pass
