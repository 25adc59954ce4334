"""The autoscaler: each tick, what the gateways and engines report of a model -> `autoscaling.decide` -> the
model's Deployment. This module is the I/O around the pure policy.

- Runs as a kopf timer on models with ``spec.autoscaling`` (every ``--autoscale-seconds``). With peering,
  kopf pauses every operator but the highest-priority live one, so only the leader ever scales.
- Reads, per tick: the Deployment (replicas asked for, ready), the gateways' in-flight and held counts
  (`FleetStore.model_load`, summed over live gateways), the verified heartbeats (running, waiting, KV usage)
  and the model's last request time. A tick that cannot read Redis changes nothing: a scaler blind to the
  load must not remove capacity.
- Applies a change by patching the Deployment's ``spec.replicas``. Before a scale-down it marks each pod with
  ``controller.kubernetes.io/pod-deletion-cost`` = its replica's running + waiting requests, so the
  ReplicaSet removes the idlest; the removed pod then drains (the engine finishes its in-flight requests on
  SIGTERM while its heartbeat says ``draining`` and gateways route around it).
- Reports: ``status.autoscaling`` (desired replicas, reason, message, last scale time, cold starts), an Event
  per change, and the operator's Prometheus metrics.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

import kopf
import redis.exceptions

from kvfleet_common.schemas import Heartbeat
from kvfleet_operator import manifests
from kvfleet_operator.autoscaling import Decision, LoadSample, ScalerMemory, decide
from kvfleet_operator.handlers.context import OperatorContext, OperatorMemo
from kvfleet_operator.handlers.model_status import model_path, refresh_model_status
from kvfleet_operator.kube import KubeError, object_path
from kvfleet_operator.spec import ModelSpec, model_spec_from
from kvfleet_operator.status import rfc3339
from kvfleet_operator.validation import SpecError

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def is_autoscaled(spec: dict[str, Any], **_: Any) -> bool:
    """kopf's ``when`` filter of the autoscaler timer."""
    return bool(spec.get("autoscaling"))


async def sample_model(
    context: OperatorContext, model: ModelSpec, deployment: dict[str, Any]
) -> tuple[LoadSample, list[Heartbeat]]:
    """One tick's view of the model, and the verified heartbeats it was taken from (Redis errors propagate:
    the caller skips the tick)."""
    store = context.store()
    load = await store.model_load(model.served_name)
    heartbeats = context.verified(await store.live_replicas(model.served_name))
    last_request = await store.last_activity(model.served_name)
    dep_status = deployment.get("status") or {}
    serving = [hb for hb in heartbeats if hb.state in ("awake", "sleeping")]
    return LoadSample(
        at=time.time(),
        replicas=int((deployment.get("spec") or {}).get("replicas", 0) or 0),
        ready=int(dep_status.get("readyReplicas", 0) or 0),
        in_flight=load.in_flight,
        held=load.held,
        running=sum(hb.running for hb in heartbeats),
        waiting=sum(hb.waiting for hb in heartbeats),
        kv_usage=sum(hb.kv_usage for hb in serving),
        last_request_at=last_request,
    ), heartbeats


async def mark_deletion_costs(
    context: OperatorContext, model: ModelSpec, heartbeats: list[Heartbeat]
) -> None:
    """Give each of the model's pods a deletion cost = its replica's requests in ``heartbeats`` (this tick's;
    no heartbeat: -1, first to go), so that a scale-down removes the idlest replicas. Best effort: a failed
    patch only loses the hint."""
    kube = context.kube()
    work = {hb.name: hb.running + hb.waiting for hb in heartbeats if hb.state != "draining"}
    pods = await kube.list(
        object_path("v1", "Pod", model.namespace), label_selector=manifests.selector_string(model)
    )
    wanted = manifests.selector_labels(model).items()
    for pod in pods:
        meta = pod.get("metadata", {})
        if not wanted <= (meta.get("labels") or {}).items() or meta.get("deletionTimestamp"):
            continue
        cost = str(work.get(meta["name"], -1))
        if (meta.get("annotations") or {}).get(DELETION_COST) == cost:
            continue
        try:
            await kube.merge_patch(
                object_path("v1", "Pod", model.namespace, meta["name"]),
                {"metadata": {"annotations": {DELETION_COST: cost}}},
            )
        except KubeError as e:
            logging.getLogger(__name__).debug("deletion cost of pod %s: %s", meta["name"], e)


def autoscaling_status(
    decision: Decision, previous: dict[str, Any], sample: LoadSample, now: datetime
) -> dict[str, Any]:
    """``status.autoscaling`` after a decision. Pure. A cold start is recorded when it is asked for and
    when its first replica is ready (``lastColdStart``: startedAt, readyAt, seconds); a wake of sleeping
    replicas is the gateway's and shows in the Sleeping condition and the gateway's hold metrics."""
    status = {
        "desiredReplicas": decision.replicas,
        "reason": decision.reason,
        "message": decision.message,
        "lastScaleTime": previous.get("lastScaleTime"),
        "coldStarts": int(previous.get("coldStarts", 0) or 0),
        "lastColdStart": dict(previous.get("lastColdStart") or {}) or None,
    }
    if decision.changed:
        status["lastScaleTime"] = rfc3339(now)
    if decision.reason == "ColdStart":
        status["coldStarts"] += 1
        status["lastColdStart"] = {"startedAt": rfc3339(now)}
    cold = status["lastColdStart"]
    if cold and "readyAt" not in cold and sample.ready > 0 and decision.reason != "ColdStart":
        started = datetime.fromisoformat(cold["startedAt"].replace("Z", "+00:00"))
        cold["readyAt"] = rfc3339(now)
        cold["seconds"] = round((now - started).total_seconds(), 1)
    return {k: v for k, v in status.items() if v is not None}


async def autoscale_model(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
    """The autoscaler timer (module docstring). ``memo.scaler`` is this model's `ScalerMemory`."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        model = model_spec_from(dict(body))
    except (SpecError, ValueError):
        return  # reconcile_model reports it
    if model.autoscaling is None:
        return
    context = memo.context
    kube = context.kube()
    deployment = await kube.get(object_path("apps/v1", "Deployment", model.namespace, model.name))
    if deployment is None:
        return  # reconcile_model creates it
    try:
        sample, heartbeats = await sample_model(context, model, deployment)
    except (redis.exceptions.RedisError, OSError) as e:
        logger.warning("autoscaler: Redis unavailable, keeping %s as it is: %s", model.name, e)
        return
    decision = decide(model.autoscaling, memo.get("scaler") or ScalerMemory(), sample)
    memo.scaler = decision.memory
    metrics = context.metrics
    metrics.observe(model.namespace, model.name, decision, sample)
    if decision.changed:
        if decision.replicas < decision.previous:
            await mark_deletion_costs(context, model, heartbeats)
        await kube.merge_patch(
            object_path("apps/v1", "Deployment", model.namespace, model.name),
            {"spec": {"replicas": decision.replicas}},
        )
        kopf.event(body, type="Normal", reason=decision.reason,
                   message=f"{decision.previous} -> {decision.replicas} replicas: {decision.message}")  # fmt: skip
        logger.info("autoscaler: %s %d -> %d (%s: %s)", model.name, decision.previous, decision.replicas,
                    decision.reason, decision.message)  # fmt: skip
    previous = (body.get("status") or {}).get("autoscaling") or {}
    status = autoscaling_status(decision, previous, sample, datetime.now(tz=UTC))
    # The message carries live numbers (idle seconds, load): written only along with a change that matters,
    # not every tick.
    if _without_message(status) != _without_message(previous):
        await kube.merge_patch(
            model_path(model.namespace, model.name, "status"), {"status": {"autoscaling": status}}
        )
    if decision.changed:
        await refresh_model_status(context, model.namespace, model.name)


def _without_message(status: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in status.items() if k != "message"}
