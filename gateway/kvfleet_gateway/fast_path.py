"""The two proxied endpoints (``POST /v1/chat/completions``, ``POST /v1/completions``), answered ahead of
FastAPI's request machinery.

Why: they carry all of the traffic, and on their way through FastAPI each request passed a dozen ASGI
layers (error and exception middlewares, FastAPI's telemetry, the OpenTelemetry middleware, the body-size
limit, routing, dependency solving, body parsing), and each relayed event of a stream went back out
through a send wrapper per layer: about a fifth of the gateway's samples (py-spy, sequential one-token
streams), on the path to every first token. Here the same steps run directly, with the same pieces, in the
order FastAPI ran them (0.2 ms, 12 %, less gateway CPU per one-token stream; docs/BENCHMARKS.md):

    body over the size limit (413) -> body not JSON (400) -> the tenant's key (401) -> the body's fields
    (400, pydantic, the same request models) -> ``Proxy.handle`` (404 / 403 / 429 / 503 / the answer)

Errors have the same shapes and messages (``kvfleet_common.server_kit.http``), a Redis outage is a 503, a bug a 500
without a traceback. Everything else (``/v1/models``, the admin API, health, metrics, docs) goes to
FastAPI, where the two endpoints are still declared: they document the API (OpenAPI), and serve it with
``--no-fast-path`` (``GatewayConfig.fast_path``), which the tests use to show both paths answer alike.

Not seen by the proxied requests: FastAPI's and OpenTelemetry's HTTP instrumentation (already excluded
for them: ``Proxy.handle`` opens their server span) and any middleware added to the FastAPI app.

Ahead of both paths, for every route (``edge_problem``): a request with two ``Authorization`` headers is a 400
(which one would count?), and so is a path whose percent-escapes stand for characters that never need one
(letters, digits, ``-._~``, ``/``, ``%``): ``/%61dmin/tenants`` would reach ``/admin/tenants`` after a path
filter in front of the gateway let it through as something else. A body nesting JSON deeper than
``MAX_JSON_DEPTH`` is a 400 before it is parsed (``kvfleet_common.server_kit.request_limits``).
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import pydantic
import redis.exceptions
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest
from kvfleet_common.server_kit.http import (
    ApiError,
    declared_length_exceeds,
    too_large_response,
    unexpected_error_response,
    validation_error_response,
)
from kvfleet_common.server_kit.request_limits import json_too_deep, json_too_deep_error
from kvfleet_gateway.auth import require_tenant
from kvfleet_gateway.proxy import RECEIVED_AT
from kvfleet_gateway.store_calls import store_unavailable_error

logger = logging.getLogger("kvfleet_gateway")

# path -> (the proxy's endpoint name, the request model)
ROUTES: dict[str, tuple[str, type[pydantic.BaseModel]]] = {
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
    "/v1/completions": ("completions", CompletionRequest),
}


class _TooLarge(Exception):
    pass


_EMPTY = object()  # a request without a body (FastAPI too asks for the key first, then says it is missing)


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with the proxied endpoints served by ``serve_proxied`` when
    ``fast_path`` is on (a POST to one of ``ROUTES``, no root path)."""

    fast_path: bool = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refused := edge_problem(scope)) is not None:
            logger.info(
                "%s %r refused: %s", scope["method"], scope.get("raw_path", b"")[:200], refused.message
            )
            await refused.response()(scope, receive, send)
            return
        if (
            self.fast_path
            and scope["type"] == "http"
            and scope["method"] == "POST"
            and not scope.get("root_path")
            and (route := ROUTES.get(scope["path"])) is not None
        ):
            scope["app"] = self  # what Starlette sets: request.app
            await serve_proxied(route[0], route[1], scope, receive, send)
            return
        await super().__call__(scope, receive, send)


_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
# characters a path never needs to escape, and "/" and "%": escaped, they only hide which route is meant
_ROUTING_CHARS = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~/%")


def edge_problem(scope: Scope) -> ApiError | None:
    """Why a request is refused whatever its route (see the module docstring); None for almost all."""
    raw_path = scope.get("raw_path") or b""
    if b"%" in raw_path and any(int(m[1], 16) in _ROUTING_CHARS for m in _ESCAPE.finditer(raw_path)):
        return ApiError(400, "the request path percent-encodes characters that need no encoding (letters, "
                        "digits, -._~, / or %): send them as they are", code="invalid_request")  # fmt: skip
    if sum(name == b"authorization" for name, _ in scope["headers"]) > 1:
        return ApiError(400, "more than one Authorization header: send exactly one", code="invalid_request")
    return None


async def serve_proxied(
    endpoint: str, model: type[pydantic.BaseModel], scope: Scope, receive: Receive, send: Send
) -> None:
    scope[RECEIVED_AT] = time.perf_counter()  # the request's clock starts before its body is read
    request = Request(scope, receive)
    state = scope["app"].state
    try:
        raw = await _read_body(scope, receive, state.config.max_body_bytes)
        if raw is None:  # the client left before its body arrived
            return
        response = await _answer(endpoint, model, raw, request)
    except _TooLarge:
        response = _rejected(request, too_large_response(state.config.max_body_bytes))
    await response(scope, receive, send)


async def _answer(endpoint: str, model: type[pydantic.BaseModel], raw: bytes, request: Request) -> Response:
    try:
        try:
            if json_too_deep(raw):
                return _rejected(request, json_too_deep_error().response())
            data = json.loads(raw) if raw.strip() else _EMPTY
        except RecursionError:  # json_too_deep let it through: never, for valid JSON
            return _rejected(request, json_too_deep_error().response())
        except ValueError as e:  # not JSON, or not UTF-8
            msg = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            return _rejected(
                request, validation_error_response([{"type": "json_invalid", "ctx": {"error": msg}}])
            )
        try:
            tenant = await require_tenant(request)
        except ApiError as e:
            return _rejected(request, e.response())
        if data is _EMPTY:
            return _rejected(request, ApiError(400, "the request body is empty: send a JSON object",
                                               code="invalid_request").response())  # fmt: skip
        try:
            body = model.model_validate(data)
        except pydantic.ValidationError as e:
            return _rejected(request, validation_error_response(e.errors(include_url=False)))
        return await request.app.state.proxy.handle(endpoint, body, tenant, request, raw)  # logs its own line
    except ApiError as e:
        return e.response()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        return redis_down_response(e)
    except Exception as e:
        logger.exception("unhandled error in POST %s", request.url.path)
        return unexpected_error_response(e)


def redis_down_response(exc: Exception) -> Response:
    logger.warning("redis unavailable: %s", exc)
    return store_unavailable_error("the fleet store (Redis) is unavailable").response()


def _rejected(request: Request, response: Response) -> Response:
    """The request's log line when it never reached the proxy (which logs its own)."""
    logger.info("POST %s rejected: %d %s", request.url.path, response.status_code,
                json.loads(response.body).get("error", {}).get("message", ""))  # fmt: skip
    return response


async def _read_body(scope: Scope, receive: Receive, max_bytes: int) -> bytes | None:
    """The whole request body; None if the client disconnected first. Raises ``_TooLarge``."""
    if declared_length_exceeds(scope, max_bytes):
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message: dict[str, Any] = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
