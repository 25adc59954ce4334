"""The engine's OpenAI-compatible HTTP server (one replica): routes, admin endpoints, lifespan.

The engine core process is started in the app's lifespan, so the port opens only once the model
is loaded; ``/health`` then says whether the core is alive (503 once it died: requests fail fast).
Admin endpoints (sleep / wake / cache reset) need ``Authorization: Bearer <admin token>``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

import kvfleet_common
from kvfleet_common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    error_body,
)
from kvfleet_common.server_kit.gc_heap import freeze_long_lived
from kvfleet_common.server_kit.http import ApiError, BodySizeLimit, bearer_matches, install_error_handlers
from kvfleet_common.server_kit.request_limits import BoundedJsonRoute
from kvfleet_common.server_kit.runtime_metrics import watch_loop_lag
from kvfleet_engine.async_llm import AsyncLLM
from kvfleet_engine.server.metrics import EngineMetrics
from kvfleet_engine.server.serving import OpenAIServing

logger = logging.getLogger("kvfleet_engine.server")

DEFAULT_MAX_BODY_BYTES = 32 << 20

_ERRORS = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in [
        (400, "invalid request"),
        (404, "unknown model"),
        (413, "body too large"),
        (503, "unavailable"),
    ]
}


def require_admin(request: Request) -> None:
    """Dependency of the admin endpoints: ``Authorization: Bearer <admin token>``, compared in constant time."""
    admin_token = request.app.state.admin_token
    if not admin_token:
        raise ApiError(403, "admin endpoints are disabled: start the server with --admin-token")
    if len(request.headers.getlist("authorization")) > 1:
        raise ApiError(400, "more than one Authorization header: send exactly one", code="invalid_request")
    if not bearer_matches(request, admin_token):
        raise ApiError(
            401,
            "a valid admin token is required (Authorization: Bearer <token>)",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


Admin = Annotated[None, Depends(require_admin)]


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    admin_token: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    start_engine: bool = True,
) -> FastAPI:
    metrics = EngineMetrics(served_model_name)
    serving = OpenAIServing(engine, served_model_name, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_engine:
            await engine.start()
        freeze_long_lived("engine server started")
        lag = asyncio.create_task(watch_loop_lag(metrics.loop_lag), name="loop-lag")
        logger.info("serving %s (max_model_len=%d)", served_model_name, engine.config.max_model_len)
        try:
            yield
        finally:
            lag.cancel()
            engine.shutdown()

    app = FastAPI(
        title="kvfleet engine",
        version=kvfleet_common.__version__,
        description="One kvfleet engine replica: OpenAI-compatible generation, tokenization, sleep/wake.",
        lifespan=lifespan,
    )
    app.state.engine = engine
    app.state.serving = serving
    app.state.draining = False
    app.state.admin_token = admin_token
    app.router.route_class = BoundedJsonRoute  # JSON nesting bounded before FastAPI parses a body
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    # ---- OpenAI API --------------------------------------------------------------------------------

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        card = ModelCard(id=served_model_name, root=str(engine.config.model.path),
                         max_model_len=engine.config.max_model_len)  # fmt: skip
        return ModelList(data=[card])

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        if body.model is not None:
            serving.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            text = serving.render_chat(body)
            ids = await serving.tokenize_text(text, add_special_tokens=False)
        else:
            ids = await serving.tokenize_text(body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=engine.config.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            serving.check_model(body.model)
        vocab = engine.config.model.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise ApiError(400, f"token ids out of vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))

    # ---- health, version, metrics ----------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.dead_reason is not None:
            return JSONResponse(
                {"status": "dead", **error_body(503, engine.dead_reason, code="engine_dead")}, status_code=503
            )
        state = "draining" if app.state.draining else ("sleeping" if engine.sleep_level else "awake")
        return JSONResponse({"status": "ok", "state": state})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvfleet_common.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.update_from_stats(engine.stats, healthy=engine.dead_reason is None)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- admin: sleep / wake ---------------------------------------------------------------------

    @app.post("/sleep", responses={401: _ERRORS[400] | {"description": "admin token required"}})
    async def sleep(_: Admin, level: Annotated[int, Query(ge=1, le=2)] = 1) -> JSONResponse:
        serving.check_alive_for_admin()
        await engine.sleep(level)
        logger.info("asleep at level %d", level)
        return JSONResponse({"status": "sleeping", "level": level})

    @app.post("/wake_up")
    async def wake_up(_: Admin, tags: Annotated[list[str] | None, Query()] = None) -> JSONResponse:
        serving.check_alive_for_admin()
        try:
            await engine.wake_up(tags)
        except RuntimeError as e:
            raise ApiError(400, str(e), param="tags") from None
        logger.info("awake (%s)", ",".join(tags) if tags else "weights,kv_cache")
        return JSONResponse({"status": "sleeping" if engine.sleep_level else "awake"})

    @app.get("/is_sleeping")
    async def is_sleeping(_: Admin) -> dict:
        serving.check_alive_for_admin()
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(_: Admin) -> dict:
        serving.check_alive_for_admin()
        return {"reset": await engine.reset_prefix_cache()}

    return app
