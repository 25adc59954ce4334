"""The operator's Prometheus metrics (served on ``--metrics-port`` by `runner`): what the autoscaler decides.

One registry per operator run (tests run several operators in one process). Labels are the model's
namespace and name (InferenceModel names are bounded by the cluster, not by clients)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvfleet_operator.autoscaling import Decision, LoadSample


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("namespace", "model")
        self.desired = Gauge("kvfleet_operator_autoscaler_desired_replicas",
                             "Replicas the autoscaler asks for", labels, registry=self.registry)  # fmt: skip
        self.ready = Gauge("kvfleet_operator_autoscaler_ready_replicas",
                           "Ready replicas the autoscaler saw", labels, registry=self.registry)  # fmt: skip
        self.load = Gauge("kvfleet_operator_autoscaler_load",
                          "The load the autoscaler saw (kind: in_flight, held, running, waiting, kv_usage)",
                          (*labels, "kind"), registry=self.registry)  # fmt: skip
        self.decisions = Counter("kvfleet_operator_autoscaler_scale_events",
                                 "Changes of the replicas asked for, by reason (ColdStart, ScaleUp, ScaleDown, "
                                 "ScaleToZero, BelowMinimum, AboveMaximum)",
                                 (*labels, "reason"), registry=self.registry)  # fmt: skip
        self.cold_starts = Counter("kvfleet_operator_cold_starts",
                                   "Scale-ups from zero replicas for a held request", labels,
                                   registry=self.registry)  # fmt: skip

    def observe(self, namespace: str, model: str, decision: Decision, sample: LoadSample) -> None:
        self.desired.labels(namespace, model).set(decision.replicas)
        self.ready.labels(namespace, model).set(sample.ready)
        for kind, value in (("in_flight", sample.in_flight), ("held", sample.held), ("running", sample.running),
                            ("waiting", sample.waiting), ("kv_usage", sample.kv_usage)):  # fmt: skip
            self.load.labels(namespace, model, kind).set(value)
        if decision.changed:
            self.decisions.labels(namespace, model, decision.reason).inc()
        if decision.reason == "ColdStart":
            self.cold_starts.labels(namespace, model).inc()

    def forget(self, namespace: str, model: str) -> None:
        """A deleted model's gauges go with it (its counters stay: Prometheus's rate() needs them to end, not
        vanish)."""
        for metric in (self.desired, self.ready):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, model)
        for kind in ("in_flight", "held", "running", "waiting", "kv_usage"):
            with contextlib.suppress(KeyError):
                self.load.remove(namespace, model, kind)
