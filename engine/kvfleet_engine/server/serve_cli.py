"""``kvfleet engine serve``: one engine replica behind an OpenAI-compatible HTTP server.

Process layout: this process runs uvicorn + FastAPI + AsyncLLM (tokenize, detokenize, stream);
it spawns the engine core process (scheduler + model) and talks to it over ZMQ. SIGTERM drains:
the port closes, in-flight requests get ``--shutdown-timeout`` seconds to finish (then each one left is
aborted: a stream ends with an SSE error event and ``[DONE]``, a request waiting for its answer gets a
503), the replica deregisters from Redis and the core stops; the process exits about a second later.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys

import uvicorn

from kvfleet_common.server_kit.connection_flags import add_connection_args, uvicorn_connection_options
from kvfleet_common.server_kit.graceful import BoundedShutdownServer
from kvfleet_common.server_kit.http import ApiError
from kvfleet_engine.engine_args import EngineArgs

logger = logging.getLogger("kvfleet_engine.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet engine serve", description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model id clients use (default: the dir name)")
    p.add_argument("--redis-url", default=os.environ.get("KVFLEET_REDIS_URL"),
                   help="announce the replica and its KV cache in Redis (env KVFLEET_REDIS_URL)")  # fmt: skip
    p.add_argument("--admin-token", default=os.environ.get("KVFLEET_ADMIN_TOKEN"),
                   help="bearer token for /sleep, /wake_up, /is_sleeping (env KVFLEET_ADMIN_TOKEN)")  # fmt: skip
    p.add_argument("--replica-key", default=os.environ.get("KVFLEET_REPLICA_KEY"),
                   help="this model's replica key (hex; env KVFLEET_REPLICA_KEY, from the operator's per-model "
                        "Secret): signs the heartbeats, and without --admin-token the admin token is derived "
                        "from it. Gateways with a replica key root route only to signed replicas")  # fmt: skip
    p.add_argument("--replica-name", default=os.environ.get("KVFLEET_REPLICA_NAME"),
                   help="stable replica name in Redis, e.g. the pod name (default: host:port)")  # fmt: skip
    p.add_argument("--base-url", default=os.environ.get("KVFLEET_BASE_URL"),
                   help="URL the gateway reaches this replica at (default: http://<host>:<port>)")  # fmt: skip
    p.add_argument("--max-request-body-bytes", type=int, default=32 << 20)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM; then the ones left end with an "
                        "error (a stream: an SSE error event and [DONE])")  # fmt: skip
    add_connection_args(p, closes_first="the gateway's upstream pool (60 s)")
    p.add_argument("--log-level", default="info")
    return p


def serve_main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvfleet_common.server_kit.gc_heap import mark_server_process
    from kvfleet_common.server_kit.tracing import setup_tracing
    from kvfleet_engine.async_llm import AsyncLLM
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.core.core_process import PresenceOptions
    from kvfleet_engine.models.architectures import get_model_class
    from kvfleet_engine.server.app import build_app

    try:
        config = EngineConfig.create(EngineArgs.from_cli_args(args))
        get_model_class(config.model)
    except (ValueError, NotImplementedError) as e:
        print(f"kvfleet engine serve: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or config.model.path.name
    replica_key = None
    if args.replica_key:
        from kvfleet_common.replica_credentials import engine_admin_token, parse_key

        try:
            replica_key = parse_key(args.replica_key, "replica key")
        except ValueError as e:
            print(f"kvfleet engine serve: {e}", file=sys.stderr)
            return 2
        args.admin_token = args.admin_token or engine_admin_token(replica_key)
    elif args.redis_url:
        logger.warning("no --replica-key (KVFLEET_REPLICA_KEY): heartbeats go out unsigned, and gateways "
                       "configured with a replica key root will not route to this replica")  # fmt: skip
    mark_server_process()  # the start-up heap is frozen out of garbage collection (kvfleet_common.server_kit.gc_heap)
    presence = None
    if args.redis_url:
        host = args.host if args.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        presence = PresenceOptions(
            redis_url=args.redis_url,
            name=args.replica_name or f"{host}-{args.port}",  # ":" is not allowed in Redis names
            model=name,
            base_url=args.base_url or f"http://{host}:{args.port}",
            replica_key=replica_key,
        )
    setup_tracing("kvfleet-engine")
    engine = AsyncLLM(config, presence)
    app = build_app(engine, name, args.admin_token, args.max_request_body_bytes)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,
            lifespan="on",
            **uvicorn_connection_options(args),
        ),
        app,
        args.shutdown_timeout,
    )
    server.run()
    return 0 if engine.dead_reason is None else 1


class DrainingServer(BoundedShutdownServer):
    """On the first SIGTERM/SIGINT, mark the replica draining (``/health`` and Redis heartbeats say
    so) before the graceful shutdown closes the port and waits for in-flight requests, at most
    ``shutdown_timeout`` seconds: then each one left ends with an error (``kvfleet_common.server_kit.graceful``)."""

    def __init__(self, config: uvicorn.Config, app, shutdown_timeout: float) -> None:
        super().__init__(config, shutdown_timeout, self._end_requests)
        self.app = app
        self._tasks: set[asyncio.Task] = set()

    def _end_requests(self) -> None:
        ended = self.app.state.engine.fail_requests(
            lambda: ApiError(503, "the replica is shutting down and ended this request; retry",
                             code="replica_shutting_down", headers={"Retry-After": "1"})
        )  # fmt: skip
        logger.info("shutdown timeout reached: %d request(s) ended", ended)

    def handle_exit(self, sig, frame) -> None:
        state = self.app.state
        if not state.draining:
            state.draining = True
            logger.info("draining (signal %s): finishing in-flight requests", sig)
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to tell the core
                task = asyncio.get_running_loop().create_task(_set_draining(state.engine))
                self._tasks.add(task)
        super().handle_exit(sig, frame)


async def _set_draining(engine) -> None:
    try:
        await engine.set_state("draining")
    except Exception:
        logger.debug("could not mark the replica draining", exc_info=True)
