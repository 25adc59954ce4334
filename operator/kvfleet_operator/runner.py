"""Starting kopf: settings (where kopf keeps its state, peering) and the entry points for the CLI (blocking)
and for tests/benchmarks (a background thread with its own event loop)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import kopf
import prometheus_client

from kvfleet_operator.handlers import kopf_registry
from kvfleet_operator.handlers.context import RuntimeOptions, operator_memo
from kvfleet_operator.spec import OperatorConfig

FINALIZER = "kvfleet.io/finalizer"


def operator_settings(*, peering: str | None, priority: int, clusterwide: bool) -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = FINALIZER
    # kopf's bookkeeping goes to annotations, so the CRDs' status schemas stay strict (no status.kopf).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kvfleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kvfleet.io", key="last-handled-configuration"
    )
    # Only warnings become Kubernetes Events automatically; the handlers post their own Normal events.
    settings.posting.level = logging.WARNING
    settings.networking.request_timeout = 60
    settings.networking.connect_timeout = 10
    # On shutdown, let a timer finish its current round instead of abandoning it mid-request.
    settings.background.instant_exit_timeout = 5.0
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.peering.standalone = peering is None
    if peering is not None:
        settings.peering.name = peering
        settings.peering.priority = priority
        settings.peering.clusterwide = clusterwide
        # Never act without the peering object: two replicas acting at once is worse than none acting.
        settings.peering.mandatory = True
    return settings


@dataclass(frozen=True, slots=True)
class RunArgs:
    config: OperatorConfig
    options: RuntimeOptions
    namespaces: tuple[str, ...] = ()
    peering: str | None = "kvfleet"
    priority: int = 0
    liveness: str | None = None
    identity: str | None = None  # peering identity (default: kopf's host@pid)
    metrics_port: int | None = None  # serve the operator's Prometheus metrics on this port (0: any free one)
    metrics_host: str = "0.0.0.0"


async def run_async(args: RunArgs, *, stop_flag: object = None, ready_flag: object = None) -> None:
    """Run kopf until ``stop_flag`` (any flag kopf accepts, e.g. a threading.Event) is set; with
    ``metrics_port``, serve the operator's Prometheus metrics meanwhile."""
    clusterwide = not args.namespaces
    settings = operator_settings(peering=args.peering, priority=args.priority, clusterwide=clusterwide)
    options = dataclasses.replace(args.options, peering=args.peering, peering_namespaces=args.namespaces)
    memo = operator_memo(args.config, options)
    metrics_server = None
    if args.metrics_port is not None:
        metrics_server, _ = prometheus_client.start_http_server(
            args.metrics_port, args.metrics_host, registry=memo.context.metrics.registry
        )
        memo.context.metrics_port = metrics_server.server_port
    try:
        await kopf.operator(
            registry=kopf_registry(options),
            settings=settings,
            memo=memo,
            clusterwide=clusterwide,
            namespaces=list(args.namespaces),
            standalone=args.peering is None,
            priority=args.priority,
            peering_name=args.peering,
            identity=args.identity,  # type: ignore[arg-type]  # kopf's Identity is a NewType of str
            liveness_endpoint=args.liveness,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()


def run_operator(
    config: OperatorConfig,
    *,
    namespaces: Sequence[str] = (),
    peering: str | None = "kvfleet",
    priority: int = 0,
    liveness: str | None = None,
    idle_check_seconds: float = 30.0,
    resync_seconds: float = 60.0,
    autoscale_seconds: float = 2.0,
    metrics_port: int | None = None,
    verbose: bool = False,
    server: str | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (the CLI)."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = RunArgs(
        config=config,
        options=RuntimeOptions(
            server=server,
            idle_check_seconds=idle_check_seconds,
            resync_seconds=resync_seconds,
            autoscale_seconds=autoscale_seconds,
        ),
        namespaces=tuple(namespaces),
        peering=peering,
        priority=priority,
        liveness=liveness,
        metrics_port=metrics_port,
    )
    if peering is not None:
        kind = "KopfPeering in each watched namespace" if namespaces else "ClusterKopfPeering"
        logging.getLogger("kvfleet_operator").info(
            "peering %r (%s): only the highest-priority live replica acts; without the peering object "
            "none does (--standalone runs without one)",
            peering,
            kind,
        )
    asyncio.run(run_async(args))


class OperatorThread:
    """The operator in a background thread with its own event loop (tests, benchmarks).

    ``start()`` returns once kopf is ready (watching); ``stop()`` asks kopf to finish and joins."""

    def __init__(self, args: RunArgs) -> None:
        self.args = args
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvfleet-operator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(run_async(self.args, stop_flag=self._stop, ready_flag=self._ready))
        except BaseException as e:  # surfaced by start()/stop()
            self._error = e
            self._ready.set()

    def start(self, timeout: float = 30.0) -> OperatorThread:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the operator did not become ready")
        if self._error is not None:
            raise RuntimeError("the operator failed to start") from self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the operator did not stop")
