"""The gateway's FastAPI app: the OpenAI endpoints for tenants, the admin API, health and metrics.

State lives in Redis; this process holds caches and background tasks only (fleet snapshot refresh,
load reporting), so any number of gateways can run side by side.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Annotated

import redis.exceptions
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvfleet_common
from kvfleet_common.fleet_store.store import AsyncFleetStore
from kvfleet_common.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvfleet_common.redis_url import mask_url
from kvfleet_common.schemas import TenantRecord
from kvfleet_common.server_kit.gc_heap import freeze_long_lived
from kvfleet_common.server_kit.graceful import cancel_and_wait
from kvfleet_common.server_kit.http import BodySizeLimit, install_error_handlers
from kvfleet_common.server_kit.request_limits import BoundedJsonRoute
from kvfleet_common.server_kit.runtime_metrics import watch_loop_lag
from kvfleet_gateway.admin import build_admin_router
from kvfleet_gateway.auth import require_tenant
from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.fast_path import GatewayApp, redis_down_response
from kvfleet_gateway.fleet import FleetView
from kvfleet_gateway.load import LoadTracker
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.proxy import Proxy
from kvfleet_gateway.replica_trust import ReplicaTrust
from kvfleet_gateway.store_calls import RedisUnavailable, StoreCalls
from kvfleet_gateway.tenant_cache import TenantCache
from kvfleet_gateway.tokenization import TokenizerCache
from kvfleet_gateway.upstream import Upstream
from kvfleet_gateway.wake import Waker

logger = logging.getLogger("kvfleet_gateway")

_ERRORS = {
    s: {"model": ErrorResponse, "description": d}
    for s, d in [(400, "invalid request"), (401, "invalid API key"), (403, "model not allowed"),
                 (404, "unknown model"), (413, "body too large"), (429, "rate limited"), (503, "unavailable")]
}  # fmt: skip


Tenant = Annotated[TenantRecord, Depends(require_tenant)]


def build_app(config: GatewayConfig) -> FastAPI:
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = AsyncFleetStore.from_url(
            config.redis_url, max_concurrent_ops=config.max_concurrent_redis_ops,
            socket_timeout=5.0, socket_connect_timeout=2.0, health_check_interval=10,
        )  # fmt: skip
        calls = StoreCalls(store, metrics)
        trust = ReplicaTrust(config.replica_key_root, config.admin_token)
        fleet = FleetView(calls, metrics, config.fleet_refresh_s, config.fleet_max_staleness_s, trust)
        http = Upstream(
            config.upstream_connect_timeout_s, config.upstream_read_timeout_s, config.max_upstream_connections
        )
        load = LoadTracker(config.gateway_id, calls, config.load_report_interval_s)
        tokenizers = TokenizerCache(lambda m, rev: calls("fetch_tokenizer", "background",
                                                         lambda: store.fetch_tokenizer(m, rev)))  # fmt: skip
        waker = Waker(fleet, calls, http, metrics, trust, config.gateway_id, config.wake_timeout_s, load)
        metrics.model_load.source = lambda: load.model_counts(fleet.models)
        st = app.state
        st.store, st.fleet, st.http, st.load, st.waker, st.trust = store, fleet, http, load, waker, trust
        st.tenants = TenantCache(calls, config.tenant_cache_ttl_s, config.fleet_max_staleness_s)
        st.proxy = Proxy(config, fleet, calls, load, tokenizers, waker, metrics, http)
        try:
            await fleet.refresh()
        except Exception as e:  # start anyway: the refresher keeps trying; requests get 503 meanwhile
            logger.warning("initial fleet snapshot read failed (%s); retrying in the background", e)
        freeze_long_lived("gateway started")
        tasks = [asyncio.create_task(fleet.run(), name="fleet-refresh"),
                 asyncio.create_task(load.run(), name="load-report"),
                 asyncio.create_task(watch_loop_lag(metrics.loop_lag), name="loop-lag")]  # fmt: skip
        logger.info("gateway %s ready (redis %s, %d models)", config.gateway_id, mask_url(config.redis_url),
                    len(fleet.models))  # fmt: skip
        try:
            yield
        finally:  # after the server's bounded drain (kvfleet_common.server_kit.graceful); each step bounded too
            waker.stop()  # a request still waiting for a model to wake gets its 503 now
            http.cut("the gateway is shutting down")  # a response still relayed ends now, with an error event
            for t in await cancel_and_wait(tasks, 1.0):
                logger.warning("background task %s did not stop", t.get_name())
            try:  # usage flushed, this gateway's load and leases removed from Redis
                await asyncio.wait_for(load.close(), 2.0)
            except TimeoutError:
                logger.warning("could not flush usage and deregister from Redis within 2 s")
            await http.aclose()
            await store.aclose()

    app = GatewayApp(
        title="kvfleet gateway",
        version=kvfleet_common.__version__,
        description="One OpenAI-compatible endpoint for every tenant and model, routed to the replica that "
        "already caches the prompt's prefix. Admin API under /admin.",
        lifespan=lifespan,
    )
    app.fast_path = config.fast_path
    app.router.route_class = BoundedJsonRoute  # JSON nesting bounded before FastAPI parses a body
    app.state.config = config
    app.state.metrics = metrics
    install_error_handlers(app)

    @app.exception_handler(redis.exceptions.ConnectionError)
    @app.exception_handler(redis.exceptions.TimeoutError)
    async def _redis_down(_: Request, exc: redis.exceptions.RedisError) -> Response:
        # the admin API reads and writes Redis directly: while it is down that is a 503, not a bug
        return redis_down_response(exc)

    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(tenant: Tenant, request: Request) -> ModelList:
        fleet: FleetView = request.app.state.fleet
        cards = []
        for name, view in sorted(fleet.models.items()):
            if not tenant.allows_model(name) or (
                view.policy is not None and not view.policy.allows_tenant(tenant.name)
            ):
                continue
            max_len = max((hb.max_model_len for hb in view.replicas), default=None)
            cards.append(ModelCard(id=name, root=name, max_model_len=max_len))
        return ModelList(data=cards)

    @app.post("/v1/completions", responses=_ERRORS)
    async def completions(body: CompletionRequest, tenant: Tenant, request: Request):
        sent = await request.body()  # read by the route already: kept, forwarded as it is
        return await request.app.state.proxy.handle("completions", body, tenant, request, sent)

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, tenant: Tenant, request: Request):
        sent = await request.body()  # read by the route already: kept, forwarded as it is
        return await request.app.state.proxy.handle("chat", body, tenant, request, sent)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """Liveness: the process serves. ``registry`` (the field's historical name) tells whether the
        fleet snapshot read from Redis is fresh."""
        fleet: FleetView = request.app.state.fleet
        try:
            fleet.check_fresh()
            snapshot = "ok"
        except RedisUnavailable:
            snapshot = "stale"
        return JSONResponse({"status": "ok", "registry": snapshot, "models": len(fleet.models),
                             "gateway_id": config.gateway_id})  # fmt: skip

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Readiness: 503 while the gateway cannot route (Redis unreachable past the staleness bound)."""
        try:
            request.app.state.fleet.check_fresh()
        except RedisUnavailable as e:
            return JSONResponse({"status": "unavailable", "detail": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvfleet_common.__version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(build_admin_router())
    return app
