"""An InferenceModel's status, following its Deployment, its pods and its replicas' heartbeats.

Deployment events of a model refresh its status (conditions follow the Deployment). Pods are not watched
(kopf filters labels client-side, so it would stream every pod of the cluster): the refresh lists the
model's pods by label, on Deployment events, after each reconcile and on the model's timer.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import kopf
import redis.exceptions

from kvfleet_operator import crds, manifests
from kvfleet_operator.handlers.context import OperatorContext, OperatorMemo
from kvfleet_operator.kube import object_path
from kvfleet_operator.spec import model_spec_from
from kvfleet_operator.status import (
    asked_replicas,
    cold_starting,
    model_status,
    newly_true,
    rfc3339,
    status_changed,
)
from kvfleet_operator.validation import SpecError


def model_path(namespace: str, name: str, subresource: str = "") -> str:
    return object_path(crds.API_VERSION, crds.MODEL_KIND, namespace, name, subresource)


async def refresh_model_status(context: OperatorContext, namespace: str, name: str) -> None:
    """Re-read the model and what it owns, and write its status if anything changed.

    Skips a model being deleted or with an invalid spec (whose status says Failed); Redis being down only
    leaves the heartbeats out. Posts an Event when Degraded or Ready newly turns True."""
    kube = context.kube()
    body = await kube.get(model_path(namespace, name))
    if body is None or body.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        model = model_spec_from(body)
    except SpecError:
        return
    selector = manifests.selector_string(model)
    deployment = await kube.get(object_path("apps/v1", "Deployment", namespace, name))
    wanted = manifests.selector_labels(model)
    pods = [
        pod
        for pod in await kube.list(object_path("v1", "Pod", namespace), label_selector=selector)
        # The API server filters by the selector already; re-checking costs nothing and keeps a
        # server that ignores labelSelector (the test emulator) from mixing models up.
        if wanted.items() <= (pod.get("metadata", {}).get("labels") or {}).items()
    ]
    last_activity: float | None = None
    try:
        store = context.store()
        heartbeats = context.verified(await store.live_replicas(model.served_name))
        last_activity = await store.last_activity(model.served_name)
    except (redis.exceptions.RedisError, OSError):
        heartbeats = []
    previous = body.get("status", {}) or {}
    status = model_status(
        desired_replicas=asked_replicas(model, previous),
        cold_starting=cold_starting(previous),
        generation=model.generation,
        served_name=model.served_name,
        selector=selector,
        deployment=deployment,
        heartbeats=heartbeats,
        pods=pods,
        previous_conditions=previous.get("conditions", []),
        now=datetime.now(tz=UTC),
    )
    if last_activity is not None:
        status["lastActivity"] = rfc3339(datetime.fromtimestamp(last_activity, tz=UTC))
    if not status_changed(previous, status):
        return
    await kube.merge_patch(model_path(namespace, name, "status"), {"status": status})
    degraded = newly_true(previous.get("conditions", []), status["conditions"], "Degraded")
    if degraded is not None:
        kopf.warn(body, reason=degraded["reason"], message=degraded["message"] or "the model is degraded")
    ready = newly_true(previous.get("conditions", []), status["conditions"], "Ready")
    if ready is not None:
        kopf.event(body, type="Normal", reason="Ready", message=ready["message"])


def owner_model(meta: dict[str, Any]) -> str | None:
    """The name of the InferenceModel owning an object, from its ownerReferences; None if none does."""
    for ref in meta.get("ownerReferences", []) or []:
        if ref.get("kind") == crds.MODEL_KIND and ref.get("apiVersion", "").startswith(crds.GROUP + "/"):
            return ref.get("name")
    return None


async def follow_deployment(meta: kopf.Meta, memo: OperatorMemo, **_: Any) -> None:
    """A model's Deployment changed: refresh the owning model's status."""
    name = owner_model(dict(meta))
    if name is not None:
        await refresh_model_status(memo.context, meta["namespace"], name)
