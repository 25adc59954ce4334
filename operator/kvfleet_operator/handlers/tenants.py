"""Tenants: each Tenant's record and the hash of its API key (read from its Secret) in Redis.

- create/update/resume and a timer -> record + hashed key in Redis; a rotated key replaces the old one.
- delete (kopf's finalizer) -> the tenant and its keys are removed from Redis.
A key Secret the operator may not read (403) fails the Tenant for good (status Failed, reason
SecretForbidden): only the periodic resync looks again, in case access was granted since. Other Secret
problems (missing, no key) are retried every SECRET_RETRY_DELAY.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from datetime import UTC, datetime
from typing import Any

import kopf
import redis.exceptions

from kvfleet_common.fleet_store.runner import FleetStoreError
from kvfleet_common.schemas import TenantRecord
from kvfleet_operator import crds
from kvfleet_operator.handlers.context import RETRY_DELAY, OperatorContext, OperatorMemo
from kvfleet_operator.kube import KubeError, object_path
from kvfleet_operator.spec import TenantSpec, tenant_spec_from
from kvfleet_operator.status import Condition, merge_conditions, status_changed
from kvfleet_operator.validation import SpecError

SECRET_RETRY_DELAY = 30.0
# Tenant failures that only a change of the Tenant or of the operator's permissions can mend.
PERMANENT_TENANT_FAILURES = frozenset({"SecretForbidden"})


def tenant_record(spec: TenantSpec) -> TenantRecord:
    return TenantRecord(
        name=spec.name,
        models=list(spec.models),
        requests_per_minute=spec.requests_per_minute or None,
        tokens_per_minute=spec.tokens_per_minute or None,
        max_concurrent=spec.max_concurrent or None,
        priority=spec.priority,
        cache_salt=spec.cache_salt,
    )


def api_key_from_secret(secret: dict[str, Any], key: str) -> str | None:
    """The API key stored under ``key``: ``data`` is base64 as the API server returns it; ``stringData``
    is only ever seen on API servers that do not convert it (the test emulator)."""
    if key in (secret.get("data") or {}):
        return base64.b64decode(secret["data"][key]).decode().strip()
    value = (secret.get("stringData") or {}).get(key)
    return value.strip() if isinstance(value, str) else None


async def write_tenant_status(
    body: kopf.Body, context: OperatorContext, ok: bool, reason: str, message: str
) -> None:
    """Phase Active/Failed and the Ready condition; written only when something changed."""
    meta = body["metadata"]
    generation = int(meta.get("generation", 0) or 0)
    previous = body.get("status", {}) or {}
    status = {
        "observedGeneration": generation,
        "phase": "Active" if ok else "Failed",
        "conditions": merge_conditions(
            previous.get("conditions", []),
            [Condition("Ready", ok, reason, message)],
            generation=generation,
            now=datetime.now(tz=UTC),
        ),
    }
    if status_changed(previous, status):
        path = object_path(crds.API_VERSION, crds.TENANT_KIND, None, meta["name"], "status")
        await context.kube().merge_patch(path, {"status": status})


async def report_tenant_failure(body: kopf.Body, context: OperatorContext, reason: str, message: str) -> None:
    """Status Failed; a warning Event only when the Tenant was not Failed already (no Event per retry)."""
    if body.get("status", {}).get("phase") != "Failed":
        kopf.warn(body, reason=reason, message=message)
    await write_tenant_status(body, context, False, reason, message)


async def sync_tenant(body: kopf.Body, context: OperatorContext) -> tuple[str, str] | None:
    """Write the tenant and its key hash to Redis; returns (reason, message) of a failure, or None.

    Raises kopf.PermanentError for an invalid spec, kopf.TemporaryError when the API server or Redis is
    unavailable."""
    try:
        spec = tenant_spec_from(dict(body), context.config.namespace)
    except SpecError as e:
        await report_tenant_failure(body, context, "InvalidSpec", str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    where = f"Secret {spec.secret_namespace}/{spec.secret_name}"
    try:
        secret = await context.kube().get(
            object_path("v1", "Secret", spec.secret_namespace, spec.secret_name)
        )
    except KubeError as e:
        if e.status == 403:
            return "SecretForbidden", (
                f"the operator may not read {where} (HTTP 403): it reads Tenant key Secrets only in "
                "the namespaces its RBAC allows (with the Helm chart: the release namespace and "
                "operator.tenantSecretNamespaces). Move the Secret or grant access; the periodic "
                "resync checks again"
            )
        raise kopf.TemporaryError(f"reading {where} failed: {e}", delay=RETRY_DELAY) from e
    if secret is None:
        return "SecretNotFound", f"{where} does not exist"
    api_key = api_key_from_secret(secret, spec.secret_key)
    if not api_key:
        return "SecretKeyMissing", f"{where} has no (non-empty) key {spec.secret_key!r}"
    key_hash = hashlib.sha256(api_key.encode()).hexdigest()
    store = context.store()
    try:
        await store.upsert_tenant(tenant_record(spec))  # the resource is the truth: create or replace
        key_id = await store.add_api_key(spec.name, key_hash)
        # A rotated key replaces the old one: only the Secret's current key authenticates.
        for old_id in await store.list_api_keys(spec.name):
            if old_id != key_id:
                await store.remove_api_key(spec.name, old_id)
    except FleetStoreError as e:
        return "KeyConflict", str(e)
    except (redis.exceptions.RedisError, OSError) as e:
        raise kopf.TemporaryError(f"Redis unavailable: {e}", delay=RETRY_DELAY) from e
    await write_tenant_status(body, context, True, "Synced", f"API key {key_id} registered")
    return None


async def reconcile_tenant(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
    """Sync the tenant; a failure is retried in SECRET_RETRY_DELAY, or never (PERMANENT_TENANT_FAILURES)."""
    context = memo.context
    failure = await sync_tenant(body, context)
    if failure is not None:
        await report_tenant_failure(body, context, *failure)
        if failure[0] in PERMANENT_TENANT_FAILURES:  # retrying soon cannot help: no hot loop
            raise kopf.PermanentError(failure[1])
        raise kopf.TemporaryError(failure[1], delay=SECRET_RETRY_DELAY)


async def resync_tenant(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
    """The tenant's timer: picks up rotated keys and late Secrets, and restores what a restarted Redis lost."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    failure = await sync_tenant(body, memo.context)
    if failure is not None:
        await report_tenant_failure(body, memo.context, *failure)


async def delete_tenant(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
    """Remove the tenant and its keys from Redis (kopf keeps the finalizer until this succeeds)."""
    name = body["metadata"]["name"]
    try:
        await memo.context.store().delete_tenant(name)
    except (redis.exceptions.RedisError, OSError) as e:
        raise kopf.TemporaryError(
            f"Redis unavailable, cannot remove the tenant yet: {e}", delay=RETRY_DELAY
        ) from e
    logger.info("tenant %s removed from Redis", name)
