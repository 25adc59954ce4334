"""Idle-sleep (scale-to-zero of the weights): a model idle for `sleepIdleSeconds` has its idle replicas
put to sleep through the engines' `/sleep` endpoint. Which replicas is decided by the pure
`status.replicas_to_sleep`; this module only does the I/O."""

from __future__ import annotations

import logging
import time

import httpx
import kopf

from kvfleet_operator.handlers.context import OperatorContext
from kvfleet_operator.spec import ModelSpec
from kvfleet_operator.status import replicas_to_sleep


async def sleep_idle_replicas(
    body: kopf.Body, model: ModelSpec, context: OperatorContext, active_since: float, logger: logging.Logger
) -> None:
    """Put the model's idle, awake replicas to sleep (level `sleepLevel`) and post an IdleSleep Event.

    ``active_since`` is when this run first checked the model: a model never used is idle from then on.
    A replica that refuses is reported (SleepFailed warning) and the others still go to sleep; Redis
    errors propagate to the caller."""
    if model.sleep_idle_seconds <= 0:
        return
    store = context.store()
    last = await store.last_activity(model.served_name)
    heartbeats = context.verified(await store.live_replicas(model.served_name))  # never a forged replica
    targets = replicas_to_sleep(
        idle_seconds=model.sleep_idle_seconds,
        last_activity=last,
        active_since=active_since,
        now=time.time(),
        heartbeats=heartbeats,
    )
    if not targets:
        return
    http = context.http()
    admin_token = context.engine_admin_token(model.served_name)  # the model's own, not the platform's
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    slept: list[str] = []
    for hb in targets:
        try:
            resp = await http.post(
                f"{hb.base_url.rstrip('/')}/sleep", params={"level": model.sleep_level}, headers=headers
            )
            resp.raise_for_status()
            slept.append(hb.name)
        except httpx.HTTPError as e:
            kopf.warn(body, reason="SleepFailed", message=f"replica {hb.name}: {e}")
    if slept:
        idle_for = time.time() - max(last or 0.0, active_since)
        kopf.event(
            body,
            type="Normal",
            reason="IdleSleep",
            message=f"put {len(slept)} replica(s) to sleep (level {model.sleep_level}) after "
            f"{idle_for:.0f} s idle: {', '.join(slept)}",
        )
        logger.info("idle-sleep: %s", slept)
