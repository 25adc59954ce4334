"""The one state every handler of an operator run shares (`OperatorContext`), and how it reaches them.

kopf hands each handler a `memo`: the object given to `kopf.operator(memo=...)`, shallow-copied per
Kubernetes object. `OperatorMemo.context` is therefore the same `OperatorContext` in every copy (the whole
run shares it), while a key set on the memo inside an object's handler stays with that object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx
import kopf

from kvfleet_common.fleet_store.store import AsyncFleetStore
from kvfleet_common.replica_credentials import ReplicaKeyRing, parse_key
from kvfleet_common.schemas import Heartbeat
from kvfleet_operator.autoscaling import ScalerMemory
from kvfleet_operator.kube import KubeClient
from kvfleet_operator.metrics import OperatorMetrics
from kvfleet_operator.spec import OperatorConfig

# Seconds before kopf retries a handler that failed for a passing reason (API server or Redis unavailable).
RETRY_DELAY = 15.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    server: str | None = None  # API server URL without auth (tests); None: in-cluster or kubeconfig
    idle_check_seconds: float = 30.0
    resync_seconds: float = 60.0
    sleep_request_timeout: float = 30.0
    peering: str | None = None  # the kopf peering object's name; None: standalone
    peering_namespaces: tuple[str, ...] = ()  # where its KopfPeerings are; empty: a ClusterKopfPeering
    autoscale_seconds: float = 2.0  # the autoscaler's tick (handlers.autoscaler)


class OperatorContext:
    """Configuration and clients of one operator run.

    Invariants: one per run (several runs may share a process: tests start operators side by side); the
    clients are made on first use, inside the operator's event loop, since each binds to the loop that
    made it; the Kubernetes client exists only once kopf logged in (it uses kopf's credentials, so both
    talk to the same cluster as the same identity); `close()`, at kopf's cleanup, closes what was made.
    """

    def __init__(self, config: OperatorConfig, options: RuntimeOptions) -> None:
        self.config = config
        self.options = options
        self.connection: kopf.ConnectionInfo | None = None  # set by the login handler
        self.peering_watch: asyncio.Task[None] | None = None  # see peering.watch_peering
        self._kube: KubeClient | None = None
        self._store: AsyncFleetStore | None = None
        self._http: httpx.AsyncClient | None = None
        self.metrics = OperatorMetrics()
        self.metrics_port: int | None = None  # where they are served (runner), if they are
        root = config.replica_key_root
        self._replica_keys = ReplicaKeyRing(parse_key(root)) if root else None

    def verified(self, heartbeats: list[Heartbeat]) -> list[Heartbeat]:
        """The heartbeats signed by an engine of their model (kvfleet_common.replica_credentials): the only
        replicas the operator counts or calls. Without a root, all of them."""
        if self._replica_keys is None:
            return list(heartbeats)
        now, out = time.time(), []
        for hb in heartbeats:
            fault = self._replica_keys.fault(hb, now)
            if fault is None:
                out.append(hb)
            else:
                logger.debug("ignoring replica %r of model %r: %s", hb.replica_id, hb.model, fault)
        return out

    def engine_admin_token(self, served_name: str) -> str:
        """The bearer token of a model's engine admin endpoints: derived from its key, or (no root) the
        platform admin token."""
        if self._replica_keys is None:
            return self.config.admin_token
        return self._replica_keys.admin_token(served_name)

    def kube(self) -> KubeClient:
        if self._kube is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
            self._kube = KubeClient(self.connection)
        return self._kube

    def store(self) -> AsyncFleetStore:
        """The fleet's Redis records (model policies, tenants, keys, heartbeats, activity)."""
        if self._store is None:
            self._store = AsyncFleetStore.from_url(self.config.redis_url, socket_timeout=10)
        return self._store

    def http(self) -> httpx.AsyncClient:
        """For the engines' admin endpoints (idle-sleep)."""
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=self.options.sleep_request_timeout)
        return self._http

    async def close(self) -> None:
        """Stop the peering watch and close every client made; each is forgotten before it is closed."""
        if self.peering_watch is not None:
            watch, self.peering_watch = self.peering_watch, None
            watch.cancel()
        if self._kube is not None:
            kube, self._kube = self._kube, None
            await kube.close()
        if self._store is not None:
            store, self._store = self._store, None
            await store.aclose()
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()


class OperatorMemo(kopf.Memo):
    """kopf's memo. kopf shallow-copies it per object: `context` is shared by the whole run, any other key
    belongs to the one object whose handler set it."""

    context: OperatorContext
    active_since: float  # per InferenceModel: when this run first checked it (see models.resync_model)
    scaler: ScalerMemory  # per autoscaled InferenceModel: the autoscaler's memory (handlers.autoscaler)


def operator_memo(config: OperatorConfig, options: RuntimeOptions) -> OperatorMemo:
    """The memo to start kopf with: a fresh context, so nothing is shared with another run."""
    memo = OperatorMemo()
    memo.context = OperatorContext(config, options)
    return memo
