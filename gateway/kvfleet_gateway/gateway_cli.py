"""``kvfleet gateway``: run the multi-tenant OpenAI gateway (uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvfleet_common.server_kit.connection_flags import add_connection_args, uvicorn_connection_options
from kvfleet_gateway.routing import POLICIES

# regexes searched in the URL (OpenTelemetry's excluded_urls)
INSTRUMENTATION_EXCLUDED_URLS = "/health,/ready,/metrics,/v1/completions,/v1/chat/completions"
# below Kubernetes' default terminationGracePeriodSeconds (30 s); the chart gives the pod this + 10 s
SHUTDOWN_GRACE_S = 25.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet gateway", description=__doc__)
    p.add_argument(
        "--redis-url",
        default=os.environ.get("KVFLEET_REDIS_URL"),
        help="Redis shared by engines, gateways and the operator (env KVFLEET_REDIS_URL)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument(
        "--admin-token",
        default=os.environ.get("KVFLEET_ADMIN_TOKEN"),
        help="bearer token of the admin API (env KVFLEET_ADMIN_TOKEN); without --replica-key-root also the "
        "engines' admin token",
    )
    p.add_argument(
        "--replica-key-root",
        default=os.environ.get("KVFLEET_REPLICA_KEY_ROOT"),
        help="the platform's replica key root (hex, env KVFLEET_REPLICA_KEY_ROOT; the operator's): route only "
        "to replicas whose heartbeats verify, and call each model's engines with that model's derived admin "
        "token. Without it every replica in Redis is trusted (local development only)",
    )
    p.add_argument(
        "--default-policy",
        choices=POLICIES,
        default="prefix-aware",
        help="routing policy of models without a config in Redis",
    )
    p.add_argument(
        "--gateway-id", default=None, help="id of this gateway in Redis (default: host-pid-random)"
    )
    p.add_argument("--max-request-body-bytes", type=int, default=32 << 20)
    p.add_argument(
        "--wake-timeout",
        type=float,
        default=120.0,
        help="seconds a request waits for a sleeping model to wake, or for a model scaled to zero to get a "
        "replica, before a 503",
    )
    p.add_argument(
        "--registry-max-staleness",
        type=float,
        default=30.0,
        help="seconds to keep routing from the last fleet snapshot while Redis is unreachable",
    )
    p.add_argument(
        "--registry-refresh",
        type=float,
        default=0.5,
        help="seconds between reads of the fleet snapshot (heartbeats, model policies) from Redis",
    )
    p.add_argument(
        "--recent-routes-ttl",
        type=float,
        default=30.0,
        help="seconds a prefix this gateway routed counts as cached on that replica before the KV index "
        "confirms it (0: trust only the index)",
    )
    p.add_argument(
        "--upstream-read-timeout",
        type=float,
        default=600.0,
        help="seconds without a byte from a replica (a non-streaming answer comes whole, at its end) before "
        "the request fails (504; a stream: an SSE error event); it is never sent to another replica, since the "
        "first may still be running it",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=SHUTDOWN_GRACE_S,
        help="seconds requests in flight get to finish after SIGTERM; then each stream still running ends with "
        "an SSE error event and [DONE], and the gateway deregisters and exits within ~2 s more (keep it below "
        f"the pod's terminationGracePeriodSeconds; default {SHUTDOWN_GRACE_S:g})",
    )
    p.add_argument(
        "--no-fast-path",
        dest="fast_path",
        action="store_false",
        help="serve /v1/chat/completions and /v1/completions through FastAPI's middleware stack like the other "
        "endpoints (slower; the default answers them ahead of it: kvfleet_gateway.fast_path)",
    )
    add_connection_args(p, closes_first="the load balancer in front (60 s on most)")
    p.add_argument("--log-level", default="info")
    return p  # fmt: skip


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not args.redis_url:
        print("kvfleet gateway: --redis-url (or KVFLEET_REDIS_URL) is required")
        return 2
    if not args.upstream_read_timeout > 0 or args.shutdown_grace < 0:
        print("kvfleet gateway: --upstream-read-timeout must be positive, --shutdown-grace not negative")
        return 2
    import uvicorn

    from kvfleet_common.redis_url import RedisCredentialsError, check_credentials, mask_url
    from kvfleet_common.replica_credentials import ROOT_SOURCE_ENV, configured_root
    from kvfleet_common.server_kit.gc_heap import mark_server_process
    from kvfleet_common.server_kit.graceful import BoundedShutdownServer
    from kvfleet_common.server_kit.tracing import setup_tracing
    from kvfleet_gateway.app import build_app
    from kvfleet_gateway.config import GatewayConfig

    level = getattr(logging, args.log_level.upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(
        logging.WARNING
    )  # one line per upstream call is noise; ours says more
    setup_tracing("kvfleet-gateway")
    kw = {"gateway_id": args.gateway_id} if args.gateway_id else {}
    try:
        root = configured_root(args.replica_key_root, os.environ.get(ROOT_SOURCE_ENV))
        config = GatewayConfig(
            redis_url=args.redis_url, admin_token=args.admin_token, default_policy=args.default_policy,
            replica_key_root=root,
            max_body_bytes=args.max_request_body_bytes, wake_timeout_s=args.wake_timeout,
            fleet_max_staleness_s=args.registry_max_staleness, recent_routes_ttl_s=args.recent_routes_ttl,
            fleet_refresh_s=args.registry_refresh, fast_path=args.fast_path,
            upstream_read_timeout_s=args.upstream_read_timeout, **kw,
        )  # fmt: skip
    except ValueError as e:
        print(f"kvfleet gateway: {e}")
        return 2
    # Fail fast on a wrong or missing password; a Redis that is merely down is waited for (503s meanwhile).
    try:
        if not check_credentials(args.redis_url):
            logging.getLogger("kvfleet_gateway").warning(
                "Redis at %s is not reachable yet; starting anyway and retrying", mask_url(args.redis_url)
            )
    except RedisCredentialsError as e:
        print(f"kvfleet gateway: {e}", file=sys.stderr)
        return 2
    if root is None:
        logging.getLogger("kvfleet_gateway").warning(
            "NO REPLICA KEY ROOT (--replica-key-root / KVFLEET_REPLICA_KEY_ROOT): every replica registered in "
            "Redis gets traffic and the engines' admin token, whoever registered it. Local development only."
        )
    app = build_app(config)
    mark_server_process()  # the start-up heap is frozen out of garbage collection (kvfleet_common.server_kit.gc_heap)
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        # No span per ASGI send/receive: a stream would get one per relayed chunk. The proxied endpoints are
        # left out entirely: their route span is the server span (kvfleet_gateway.proxy).
        FastAPIInstrumentor.instrument_app(
            app, excluded_urls=INSTRUMENTATION_EXCLUDED_URLS, exclude_spans=["send", "receive"]
        )
    except ImportError:
        pass
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                               **uvicorn_connection_options(args))  # fmt: skip

    def end_requests() -> None:  # past the grace period (docs/GATEWAY.md, "Shutdown")
        app.state.waker.stop()  # requests still waiting for a model to wake get a 503 now
        app.state.http.cut(f"the shutdown grace period of {args.shutdown_grace:g} s is over")

    BoundedShutdownServer(uv_config, args.shutdown_grace, end_requests).run()
    return 0
