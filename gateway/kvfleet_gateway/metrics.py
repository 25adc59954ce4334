"""Prometheus metrics of the gateway (names prefixed ``kvfleet_gateway_``), on a private registry.

Label values come from small, known sets only: models the fleet knows, tenants the admin created, the
gateway's own endpoint, reason and status names. A model name a client made up is counted under
``UNKNOWN_MODEL``: any tenant could otherwise grow ``/metrics`` (and the gateway's memory) without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvfleet_common.server_kit.runtime_metrics import add_process_collectors, loop_lag_histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# sub-millisecond resolution: the added latency budget is 2 ms (bench/gateway_overhead.py)
_OVERHEAD_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)  # fmt: skip
# a wake takes seconds, a cold start (a pod scheduled, an engine loading its weights) up to minutes
_HOLD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

M = TypeVar("M", Counter, Gauge, Histogram)

UNKNOWN_MODEL = "(unknown)"  # the label of every model name the fleet does not know (no real name has "()")


class Children(Generic[M]):
    """A labelled metric whose children are looked up once per label values.

    prometheus_client's ``labels()`` checks and stringifies the values and takes a lock on every call;
    a proxied request makes about fifteen such calls. Label values here come from a small set (models,
    tenants, status codes), so the children are kept in a dict. Only for metrics that are never
    ``clear()``-ed (a cleared child would keep being updated here, unseen)."""

    __slots__ = ("_children", "metric")

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def labels(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


ModelCounts = Mapping[str, tuple[int, int, int]]  # model -> (requests in flight, held, queued prompt tokens)


class ModelLoadGauges(Collector):
    """This gateway's per-model demand, read from the load tracker's counters when scraped (the request path
    pays nothing more): the gauges an HPA or KEDA sums over the gateway pods. Every model the fleet knows
    has a sample, 0 when idle, so a sum over gateways is never "no data"."""

    def __init__(self) -> None:
        self.source: Callable[[], ModelCounts] = dict  # set once the gateway's load tracker runs

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(self._families())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        for model, counts in sorted(self.source().items()):
            for family, value in zip(families, counts):
                family.add_metric([model], value)
        return iter(families)

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("kvfleet_gateway_model_requests_in_flight",
                              "Requests this gateway is proxying to the model's replicas now", labels=["model"]),
            GaugeMetricFamily("kvfleet_gateway_model_requests_held",
                              "Requests this gateway holds until the model has an awake replica (cold start "
                              "from zero replicas, or a wake of sleeping ones)", labels=["model"]),
            GaugeMetricFamily("kvfleet_gateway_model_queued_prompt_tokens",
                              "Prompt tokens this gateway routed to the model's replicas that are not prefilled "
                              "yet", labels=["model"]),
        )  # fmt: skip


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        add_process_collectors(r)
        self.loop_lag = loop_lag_histogram("kvfleet_gateway", r)
        self.requests = Children(Counter(
            "kvfleet_gateway_requests", "Finished client requests by model, tenant, endpoint and status code",
            ["model", "tenant", "endpoint", "status"], registry=r,
        ))  # fmt: skip
        self.inflight = Children(Gauge(
            "kvfleet_gateway_inflight_requests", "Requests this gateway is proxying now", ["model"], registry=r,
        ))  # fmt: skip
        self.ttft = Children(Histogram(
            "kvfleet_gateway_time_to_first_token_seconds",
            "Client-visible time from request arrival to the first upstream byte of a streamed response",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.duration = Children(Histogram(
            "kvfleet_gateway_request_duration_seconds", "Client-visible request duration",
            ["model", "endpoint"], buckets=_LATENCY_BUCKETS, registry=r,
        ))  # fmt: skip
        self.overhead = Children(Histogram(
            "kvfleet_gateway_routing_overhead_seconds",
            "Time from request arrival to the upstream request being sent (body, auth, tokenize, Redis, policy)",
            ["model"], buckets=_OVERHEAD_BUCKETS, registry=r,
        ))  # fmt: skip
        self.decisions = Children(Counter(
            "kvfleet_gateway_routing_decisions",
            "Routing decisions by policy and whether the chosen replica was predicted to hold part of the prompt",
            ["model", "policy", "prefix_hit"], registry=r,
        ))  # fmt: skip
        self.fallbacks = Children(Counter(
            "kvfleet_gateway_routing_fallbacks",
            "Requests routed without full information or retried elsewhere (reason: redis_unavailable, "
            "no_tokenizer, retry_connect, retry_status, replica_asleep)",
            ["model", "reason"], registry=r,
        ))  # fmt: skip
        self.predicted_cached = Children(Counter(
            "kvfleet_gateway_predicted_cached_tokens", "Prompt tokens the router predicted the replica caches",
            ["model"], registry=r,
        ))  # fmt: skip
        self.actual_cached = Children(Counter(
            "kvfleet_gateway_actual_cached_tokens",
            "Prompt tokens the engine reported as cached (usage.prompt_tokens_details.cached_tokens)",
            ["model"], registry=r,
        ))  # fmt: skip
        self.prediction_error = Children(Histogram(
            "kvfleet_gateway_cached_tokens_prediction_error",
            "|predicted - actual| cached prompt tokens per request",
            ["model"], buckets=(0, 1, 16, 64, 256, 1024, 4096), registry=r,
        ))  # fmt: skip
        self.tenant_tokens = Children(Counter(
            "kvfleet_gateway_tenant_tokens", "Tokens charged to tenants (kind: prompt, completion, cached)",
            ["tenant", "model", "kind"], registry=r,
        ))  # fmt: skip
        self.rejected = Children(Counter(
            "kvfleet_gateway_rejected_requests",
            "Requests refused before routing (reason: auth, forbidden, unknown_model, concurrency, requests, "
            "tokens, no_replica, wake_timeout, cold_start_timeout)",
            ["reason"], registry=r,
        ))  # fmt: skip
        self.wakes = Children(Counter(
            "kvfleet_gateway_wakes", "Wake-ups of sleeping models triggered by requests (outcome: woke, failed)",
            ["model", "outcome"], registry=r,
        ))  # fmt: skip
        self.holds = Children(Counter(
            "kvfleet_gateway_holds",
            "Requests held until their model had an awake replica, by how the hold ended (kind: cold_start, "
            "wake; outcome: served, timeout, shutdown)", ["model", "kind", "outcome"], registry=r,
        ))  # fmt: skip
        self.hold_seconds = Children(Histogram(
            "kvfleet_gateway_hold_seconds", "How long requests were held for an awake replica (kind: cold_start, "
            "wake)", ["model", "kind"], buckets=_HOLD_BUCKETS, registry=r,
        ))  # fmt: skip
        self.model_load = ModelLoadGauges()
        r.register(self.model_load)
        self.upstream_errors = Children(Counter(
            "kvfleet_gateway_upstream_errors",
            "Upstream failures (kind: connect, status, midstream)", ["model", "kind"], registry=r,
        ))  # fmt: skip
        self.redis_round_trips = Children(Counter(
            "kvfleet_gateway_redis_round_trips", "Redis round trips by operation (path: request or background)",
            ["op", "path"], registry=r,
        ))  # fmt: skip
        self.redis_errors = Children(Counter(
            "kvfleet_gateway_redis_errors", "Redis operations that failed (connection lost, timeout)", ["op"],
            registry=r,
        ))  # fmt: skip
        self.replicas = Gauge(
            "kvfleet_gateway_replicas", "Replicas the gateway sees per model and state", ["model", "state"],
            registry=r,
        )  # fmt: skip
        self.unverified_replicas = Gauge(
            "kvfleet_gateway_unverified_replicas",
            "Replicas in Redis whose heartbeat does not verify with the model's replica key (forged, unsigned, "
            "stale or from another model's engines): left out of routing and admin calls", ["model"], registry=r,
        )  # fmt: skip
