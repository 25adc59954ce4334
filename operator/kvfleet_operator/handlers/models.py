"""InferenceModel lifecycle: apply what a model owns, keep its Redis policy, clean up on delete.

- create/update/resume -> validate, server-side apply the owned objects, write the model's Redis policy,
  refresh status. An invalid spec fails for good (status Failed, reason InvalidSpec) until it changes.
- the timer -> re-assert the Redis policy (Redis may have lost it), idle-sleep, refresh status.
- delete (kopf's finalizer) -> delete the owned objects, wait (bounded) for the engine pods to stop,
  then purge the model from Redis.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import redis.exceptions

from kvfleet_common.schemas import ModelPolicy
from kvfleet_operator import manifests
from kvfleet_operator.handlers.context import RETRY_DELAY, OperatorContext, OperatorMemo
from kvfleet_operator.handlers.idle_sleep import sleep_idle_replicas
from kvfleet_operator.handlers.model_status import model_path, refresh_model_status
from kvfleet_operator.kube import KubeError, object_path
from kvfleet_operator.spec import ModelSpec, model_spec_from
from kvfleet_operator.status import asked_replicas, failed_status
from kvfleet_operator.validation import SpecError

POD_STOP_POLL_S = 2.0
POD_STOP_MARGIN_S = 60  # beyond the grace period, waiting for a model's pods to go


def model_policy_record(model: ModelSpec) -> ModelPolicy:
    """What the gateway reads about the model from Redis."""
    return ModelPolicy(
        model=model.served_name,
        routing_policy=model.routing_policy,  # type: ignore[arg-type]  # same enum as the CRD
        sleep_idle_seconds=model.sleep_idle_seconds or None,
        sleep_level=model.sleep_level,  # type: ignore[arg-type]
        allowed_tenants=None if model.allowed_tenants is None else list(model.allowed_tenants),
        # the gateways hold a request for a model with no replica while the autoscaler starts one
        scale_from_zero=model.autoscaling is not None,
    )


async def write_invalid_spec_status(body: kopf.Body, error: SpecError, context: OperatorContext) -> None:
    meta = body.get("metadata", {})
    status = failed_status(
        generation=int(meta.get("generation", 0) or 0),
        reason="InvalidSpec",
        message=str(error),
        previous_conditions=body.get("status", {}).get("conditions", []),
        now=datetime.now(tz=UTC),
    )
    await context.kube().merge_patch(
        model_path(meta["namespace"], meta["name"], "status"), {"status": status}
    )


async def reconcile_model(
    body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, reason: str, **_: Any
) -> None:
    """Apply the model's objects and its Redis policy; a renamed servedName purges the old name.

    Posts a Created/Updated Event, except on resume (an operator restart re-applies every model)."""
    context = memo.context
    try:
        model = model_spec_from(dict(body))
        policy = model_policy_record(model)
    except ValueError as e:  # SpecError, or a name the Redis contract refuses
        error = e if isinstance(e, SpecError) else SpecError(str(e))
        kopf.warn(body, reason="InvalidSpec", message=str(error))
        await write_invalid_spec_status(body, error, context)
        raise kopf.PermanentError(f"invalid spec: {error}") from e
    kube, store = context.kube(), context.store()
    previous_name = body.get("status", {}).get("servedName")
    # An autoscaled model's Deployment keeps the autoscaler's last decision (re-applying never undoes it).
    model = dataclasses.replace(model, replicas=asked_replicas(model, body.get("status")))
    try:
        for obj in manifests.children(model, context.config):
            await kube.apply(obj)
    except KubeError as e:
        kopf.warn(body, reason="ApplyFailed", message=str(e))
        raise kopf.TemporaryError(f"applying the model's objects failed: {e}", delay=RETRY_DELAY) from e
    try:
        if previous_name and previous_name != model.served_name:
            await store.purge_model(previous_name)
        await store.put_model_policy(policy)
    except (redis.exceptions.RedisError, OSError) as e:
        raise kopf.TemporaryError(f"Redis unavailable: {e}", delay=RETRY_DELAY) from e
    if str(reason) != "resume":  # an operator restart re-applies every model: not news worth an Event
        gpus = model.engine.accelerators_per_pod if model.accelerator == "nvidia" else 0
        kopf.event(
            body,
            type="Normal",
            reason="Created" if str(reason) == "create" else "Updated",
            message=f"{model.replicas} replica(s) of {model.served_name} ({gpus} GPU(s) each)"
            + (" now, autoscaled" if model.autoscaling else ""),
        )
    logger.info("applied %s: %d replicas", model.name, model.replicas)
    await refresh_model_status(context, model.namespace, model.name)


async def delete_model(
    body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, runtime: timedelta, **_: Any
) -> None:
    """Delete the owned objects, then purge every name the model was served under from Redis.

    The purge waits for the engine pods to stop (an engine still running would re-register the model),
    for at most the pods' grace period plus POD_STOP_MARGIN_S."""
    context = memo.context
    meta = body["metadata"]
    names = {body.get("status", {}).get("servedName")}
    model: ModelSpec | None = None
    try:
        model = model_spec_from(dict(body))
        names.add(model.served_name)
        children = manifests.children(model, context.config)
    except SpecError:
        children = []
    kube = context.kube()
    # Kubernetes garbage-collects owned objects too; deleting them here also covers objects whose
    # ownerReference was removed, and API servers without a garbage collector.
    for obj in reversed(children):
        await kube.delete(
            object_path(obj["apiVersion"], obj["kind"], meta["namespace"], obj["metadata"]["name"])
        )
    if model is not None:
        # An engine still running after the purge re-registers and re-publishes the model's tokenizer
        # (it takes the purge for a Redis that lost its data), and tokenizer records have no TTL: purge
        # once the pods are gone. Bounded: a pod on a lost node may never report its end.
        pods = await kube.list(
            object_path("v1", "Pod", meta["namespace"]), label_selector=manifests.selector_string(model)
        )
        wanted = manifests.selector_labels(model).items()
        left = [p["metadata"]["name"] for p in pods if wanted <= (p["metadata"].get("labels") or {}).items()]
        patience = model.termination_grace_period_seconds + POD_STOP_MARGIN_S
        if left and runtime.total_seconds() < patience:
            raise kopf.TemporaryError(
                f"waiting for {len(left)} engine pod(s) to stop before purging Redis: {', '.join(left)}",
                delay=POD_STOP_POLL_S,
            )
        if left:
            logger.warning("purging Redis although pods %s did not stop within %d s", left, patience)
    try:
        for name in names - {None}:
            await context.store().purge_model(name)
    except (redis.exceptions.RedisError, OSError) as e:
        raise kopf.TemporaryError(
            f"Redis unavailable, cannot purge the model yet: {e}", delay=RETRY_DELAY
        ) from e
    context.metrics.forget(meta["namespace"], meta["name"])
    logger.info("deleted %s and purged its Redis records", meta["name"])


async def resync_model(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
    """The model's timer: re-assert its Redis policy, idle-sleep, refresh its status.

    Skips models being deleted or with an invalid spec (reconcile_model reports those). Redis being
    down is logged and the status still refreshed. ``memo.active_since`` is per model (kopf's memo
    copy): set on the model's first tick, it starts the idle clock of a model never used."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        model = model_spec_from(dict(body))
        policy = model_policy_record(model)
    except ValueError:
        return  # reported by reconcile_model
    if "active_since" not in memo:
        memo.active_since = time.time()
    context = memo.context
    try:
        # Re-assert: a Redis restart without persistence would otherwise leave the model unconfigured.
        await context.store().put_model_policy(policy)
        await sleep_idle_replicas(body, model, context, memo.active_since, logger)
    except (redis.exceptions.RedisError, OSError) as e:
        logger.warning("Redis unavailable during the periodic check: %s", e)
    await refresh_model_status(context, model.namespace, model.name)
