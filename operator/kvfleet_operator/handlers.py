"""kopf handlers: the thin I/O shell around the pure modules (validation, manifests, status).

`build_registry()` returns a fresh `kopf.OperatorRegistry` holding every handler, so tests can run several
operators in one process. Shared clients live in kopf's memo (`OperatorMemo`): the Kubernetes client is made
from the credentials kopf logged in with, the Redis registry and the HTTP client at startup.

What each resource gets:
- InferenceModel: create/update/resume -> validate, server-side apply the owned objects, write the model's
  Redis config, refresh status; a timer re-asserts the Redis config (Redis may have lost it), runs
  idle-sleep and refreshes status; delete (finalizer) -> delete the owned objects and purge Redis.
- Deployment events of a model -> refresh that model's status (conditions follow the Deployment). Pods are
  not watched (kopf filters labels client-side, so it would stream every pod of the cluster): the status
  refresh lists the model's pods by label, on Deployment events and on the timer.
- Tenant: create/update/resume and a timer -> record + hashed key in Redis; delete (finalizer) -> removed.
  A key Secret the operator may not read (403) fails the Tenant for good (status Failed, reason
  SecretForbidden): only the periodic resync looks again, in case access was granted since.
- Peering: with mandatory peering kopf waits, silently, for the peering object; `watch_peering` says so in
  the log until the object exists (it is the Helm chart that creates it).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import httpx
import kopf
import redis.exceptions

from kvfleet_common.registry import AsyncRegistry, RegistryError
from kvfleet_common.schemas import ModelConfig, TenantRecord
from kvfleet_operator import crds, manifests
from kvfleet_operator.kube import KubeClient, KubeError, object_path
from kvfleet_operator.spec import ModelSpec, OperatorConfig, model_spec_from, tenant_spec_from
from kvfleet_operator.status import (
    Condition,
    failed_status,
    merge_conditions,
    model_status,
    newly_true,
    replicas_to_sleep,
    rfc3339,
)
from kvfleet_operator.validation import SpecError

RETRY_DELAY = 15.0
POD_STOP_POLL_S = 2.0
POD_STOP_MARGIN_S = 60  # beyond the grace period, waiting for a model's pods to go
SECRET_RETRY_DELAY = 30.0
PEERING_CHECK_INTERVAL = 60.0
# Tenant failures that only a change of the Tenant or of the operator's permissions can mend.
PERMANENT_TENANT_FAILURES = frozenset({"SecretForbidden"})
PEERING_LOGGER = logging.getLogger("kvfleet_operator.peering")


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    server: str | None = None  # API server URL without auth (tests); None: in-cluster or kubeconfig
    idle_check_seconds: float = 30.0
    resync_seconds: float = 60.0
    sleep_request_timeout: float = 30.0
    peering: str | None = None  # the kopf peering object's name; None: standalone
    peering_namespaces: tuple[str, ...] = ()  # where its KopfPeerings are; empty: a ClusterKopfPeering


class OperatorMemo(kopf.Memo):
    """Shared state. kopf shallow-copies the memo per object: clients are shared, per-object keys are not."""

    config: OperatorConfig
    options: RuntimeOptions
    connection: kopf.ConnectionInfo | None
    clients: dict[str, Any]  # "kube", "registry", "http": made on first use, inside the operator's loop


def new_memo(config: OperatorConfig, options: RuntimeOptions) -> OperatorMemo:
    memo = OperatorMemo()
    memo.config = config
    memo.options = options
    memo.connection = None
    memo.clients = {}  # the same dict in every per-object copy
    return memo


def _kube(memo: OperatorMemo) -> KubeClient:
    clients = memo.clients
    if "kube" not in clients:
        if memo.connection is None:
            raise kopf.TemporaryError("not logged in to the Kubernetes API yet", delay=1)
        clients["kube"] = KubeClient(memo.connection)
    return clients["kube"]


def _registry(memo: OperatorMemo) -> AsyncRegistry:
    if memo.clients.get("registry") is None:
        memo.clients["registry"] = AsyncRegistry.from_url(memo.config.redis_url, socket_timeout=10)
    return memo.clients["registry"]


def _http(memo: OperatorMemo) -> httpx.AsyncClient:
    if memo.clients.get("http") is None:
        memo.clients["http"] = httpx.AsyncClient(timeout=memo.options.sleep_request_timeout)
    return memo.clients["http"]


def _now() -> datetime:
    return datetime.now(tz=UTC)


def _model_path(namespace: str, name: str, subresource: str = "") -> str:
    return object_path(crds.API_VERSION, crds.MODEL_KIND, namespace, name, subresource)


def _status_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())


def model_config_record(model: ModelSpec) -> ModelConfig:
    """What the gateway reads about the model from Redis."""
    return ModelConfig(
        model=model.served_name,
        routing_policy=model.routing_policy,  # type: ignore[arg-type]  # same enum as the CRD
        sleep_idle_seconds=model.sleep_idle_seconds or None,
        sleep_level=model.sleep_level,  # type: ignore[arg-type]
        allowed_tenants=None if model.allowed_tenants is None else list(model.allowed_tenants),
    )


def tenant_record(spec: Any) -> TenantRecord:
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


def peering_paths(options: RuntimeOptions) -> dict[str, str]:
    """Description -> REST path of each peering object the operator waits for (namespace globs skipped)."""
    if options.peering is None:
        return {}
    if not options.peering_namespaces:
        path = object_path("kopf.dev/v1", "ClusterKopfPeering", None, options.peering)
        return {f"ClusterKopfPeering {options.peering!r}": path}
    return {
        f"KopfPeering {options.peering!r} in namespace {ns!r}": object_path(
            "kopf.dev/v1", "KopfPeering", ns, options.peering
        )
        for ns in options.peering_namespaces
        if not any(c in ns for c in "*?![]")
    }


def peering_missing_message(options: RuntimeOptions, missing: list[str]) -> str:
    namespaced = bool(options.peering_namespaces)
    kind = "KopfPeering" if namespaced else "ClusterKopfPeering"
    example = {"apiVersion": "kopf.dev/v1", "kind": kind, "metadata": {"name": options.peering}}
    return (
        f"waiting for the kopf peering object ({'; '.join(missing)}): this operator does nothing until it "
        "exists. The Helm chart creates it. Running by hand, either create it (the kopf.dev CRDs are in "
        f"crds/kopf-*.yaml): echo '{json.dumps(example)}' | kubectl apply "
        + ("-n NAMESPACE " if namespaced else "")
        + "-f -   or run a single operator with --standalone."
    )


async def watch_peering(memo: OperatorMemo) -> None:
    """Log a warning every PEERING_CHECK_INTERVAL while a peering object is missing; return once all exist."""
    paths = peering_paths(memo.options)
    warned = False
    while paths:
        missing: list[str] = []
        for what, path in paths.items():
            try:
                if await _kube(memo).get(path) is None:
                    missing.append(what)
            except (KubeError, kopf.TemporaryError, aiohttp.ClientError, OSError, TimeoutError) as e:
                # e.g. a 403 or an unreachable API server: kopf reports those itself
                PEERING_LOGGER.debug("cannot check %s: %s", what, e)
        if not missing:
            if warned:
                PEERING_LOGGER.info("peering object found: %s", "; ".join(paths))
            return
        PEERING_LOGGER.warning(peering_missing_message(memo.options, missing))
        warned = True
        await asyncio.sleep(PEERING_CHECK_INTERVAL)


def build_registry(options: RuntimeOptions) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    model_resource = (crds.GROUP, crds.VERSION, crds.MODEL_PLURAL)
    tenant_resource = (crds.GROUP, crds.VERSION, crds.TENANT_PLURAL)

    # ---- activities ----------------------------------------------------------------------------------

    @kopf.on.login(registry=registry)
    async def login(
        memo: OperatorMemo, logger: logging.Logger, settings: kopf.OperatorSettings, **kwargs: Any
    ):
        if memo.options.server:
            info = kopf.ConnectionInfo(server=memo.options.server, insecure=True, default_namespace="default")
        else:
            info = (
                kopf.login_with_service_account(settings=settings, logger=logger, **kwargs)
                or kopf.login_via_client(settings=settings, logger=logger, **kwargs)
                or kopf.login_with_kubeconfig(settings=settings, logger=logger, **kwargs)
            )
        memo.connection = info
        if memo.options.peering is not None and "peering_watch" not in memo.clients:
            memo.clients["peering_watch"] = asyncio.get_running_loop().create_task(watch_peering(memo))
        return info

    @kopf.on.cleanup(registry=registry)
    async def close_clients(memo: OperatorMemo, **_: Any) -> None:
        clients = memo.clients
        if clients.get("peering_watch") is not None:
            clients.pop("peering_watch").cancel()
        if clients.get("kube") is not None:
            await clients.pop("kube").close()
        if clients.get("registry") is not None:
            await clients.pop("registry").aclose()
        if clients.get("http") is not None:
            await clients.pop("http").aclose()

    # ---- InferenceModel ------------------------------------------------------------------------------

    async def write_failed(body: kopf.Body, error: SpecError, memo: OperatorMemo) -> None:
        meta = body.get("metadata", {})
        status = failed_status(
            generation=int(meta.get("generation", 0) or 0),
            reason="InvalidSpec",
            message=str(error),
            previous_conditions=body.get("status", {}).get("conditions", []),
            now=_now(),
        )
        await _kube(memo).merge_patch(
            _model_path(meta["namespace"], meta["name"], "status"), {"status": status}
        )

    @kopf.on.resume(*model_resource, registry=registry)
    @kopf.on.create(*model_resource, registry=registry)
    @kopf.on.update(*model_resource, registry=registry)
    async def reconcile_model(
        body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, reason: str, **_: Any
    ):
        try:
            model = model_spec_from(dict(body))
            config_record = model_config_record(model)
        except ValueError as e:  # SpecError, or a name the Redis contract refuses
            error = e if isinstance(e, SpecError) else SpecError(str(e))
            kopf.warn(body, reason="InvalidSpec", message=str(error))
            await write_failed(body, error, memo)
            raise kopf.PermanentError(f"invalid spec: {error}") from e
        kube, registry_ = _kube(memo), _registry(memo)
        previous_name = body.get("status", {}).get("servedName")
        try:
            for obj in manifests.children(model, memo.config):
                await kube.apply(obj)
        except KubeError as e:
            kopf.warn(body, reason="ApplyFailed", message=str(e))
            raise kopf.TemporaryError(f"applying the model's objects failed: {e}", delay=RETRY_DELAY) from e
        try:
            if previous_name and previous_name != model.served_name:
                await registry_.purge_model(previous_name)
            await registry_.put_model_config(config_record)
        except (redis.exceptions.RedisError, OSError) as e:
            raise kopf.TemporaryError(f"Redis unavailable: {e}", delay=RETRY_DELAY) from e
        if str(reason) != "resume":  # an operator restart re-applies every model: not news worth an Event
            gpus = model.engine.accelerators_per_pod if model.accelerator == "nvidia" else 0
            kopf.event(
                body,
                type="Normal",
                reason="Created" if str(reason) == "create" else "Updated",
                message=f"{model.replicas} replica(s) of {model.served_name} ({gpus} GPU(s) each)",
            )
        logger.info("applied %s: %d replicas", model.name, model.replicas)
        await refresh_model_status(memo, model.namespace, model.name)

    @kopf.on.delete(*model_resource, registry=registry)
    async def delete_model(
        body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, runtime: timedelta, **_: Any
    ) -> None:
        meta = body["metadata"]
        names = {body.get("status", {}).get("servedName")}
        model: ModelSpec | None = None
        try:
            model = model_spec_from(dict(body))
            names.add(model.served_name)
            children = manifests.children(model, memo.config)
        except SpecError:
            children = []
        kube = _kube(memo)
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
            left = [
                p["metadata"]["name"] for p in pods if wanted <= (p["metadata"].get("labels") or {}).items()
            ]
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
                await _registry(memo).purge_model(name)
        except (redis.exceptions.RedisError, OSError) as e:
            raise kopf.TemporaryError(
                f"Redis unavailable, cannot purge the model yet: {e}", delay=RETRY_DELAY
            ) from e
        logger.info("deleted %s and purged its Redis records", meta["name"])

    @kopf.timer(
        *model_resource,
        interval=options.idle_check_seconds,
        initial_delay=options.idle_check_seconds,
        registry=registry,
    )
    async def model_tick(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
        if body.get("metadata", {}).get("deletionTimestamp"):
            return
        try:
            model = model_spec_from(dict(body))
            config_record = model_config_record(model)
        except ValueError:
            return  # reported by reconcile_model
        if "active_since" not in memo:
            memo.active_since = time.time()
        try:
            registry_ = _registry(memo)
            # Re-assert: a Redis restart without persistence would otherwise leave the model unconfigured.
            await registry_.put_model_config(config_record)
            await idle_sleep(body, model, memo, logger)
        except (redis.exceptions.RedisError, OSError) as e:
            logger.warning("Redis unavailable during the periodic check: %s", e)
        await refresh_model_status(memo, model.namespace, model.name)

    async def idle_sleep(
        body: kopf.Body, model: ModelSpec, memo: OperatorMemo, logger: logging.Logger
    ) -> None:
        if model.sleep_idle_seconds <= 0:
            return
        registry_ = _registry(memo)
        last = await registry_.last_activity(model.served_name)
        heartbeats = await registry_.live_replicas(model.served_name)
        targets = replicas_to_sleep(
            idle_seconds=model.sleep_idle_seconds,
            last_activity=last,
            active_since=memo.active_since,
            now=time.time(),
            heartbeats=heartbeats,
        )
        if not targets:
            return
        http = _http(memo)
        headers = {"Authorization": f"Bearer {memo.config.admin_token}"} if memo.config.admin_token else {}
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
            idle_for = time.time() - max(last or 0.0, memo.active_since)
            kopf.event(
                body,
                type="Normal",
                reason="IdleSleep",
                message=f"put {len(slept)} replica(s) to sleep (level {model.sleep_level}) after "
                f"{idle_for:.0f} s idle: {', '.join(slept)}",
            )
            logger.info("idle-sleep: %s", slept)

    # ---- status following the Deployment and pods ----------------------------------------------------

    async def refresh_model_status(memo: OperatorMemo, namespace: str, name: str) -> None:
        kube = _kube(memo)
        body = await kube.get(_model_path(namespace, name))
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
            registry_ = _registry(memo)
            heartbeats = await registry_.live_replicas(model.served_name)
            last_activity = await registry_.last_activity(model.served_name)
        except (redis.exceptions.RedisError, OSError):
            heartbeats = []
        previous = body.get("status", {}) or {}
        status = model_status(
            desired_replicas=model.replicas,
            generation=model.generation,
            served_name=model.served_name,
            selector=selector,
            deployment=deployment,
            heartbeats=heartbeats,
            pods=pods,
            previous_conditions=previous.get("conditions", []),
            now=_now(),
        )
        if last_activity is not None:
            status["lastActivity"] = rfc3339(datetime.fromtimestamp(last_activity, tz=UTC))
        if not _status_changed(previous, status):
            return
        await kube.merge_patch(_model_path(namespace, name, "status"), {"status": status})
        degraded = newly_true(previous.get("conditions", []), status["conditions"], "Degraded")
        if degraded is not None:
            kopf.warn(body, reason=degraded["reason"], message=degraded["message"] or "the model is degraded")
        ready = newly_true(previous.get("conditions", []), status["conditions"], "Ready")
        if ready is not None:
            kopf.event(body, type="Normal", reason="Ready", message=ready["message"])

    def owner_model(meta: dict[str, Any]) -> str | None:
        for ref in meta.get("ownerReferences", []) or []:
            if ref.get("kind") == crds.MODEL_KIND and ref.get("apiVersion", "").startswith(crds.GROUP + "/"):
                return ref.get("name")
        return None

    @kopf.on.event(
        "apps", "v1", "deployments", labels={manifests.MODEL_LABEL: kopf.PRESENT}, registry=registry
    )
    async def deployment_changed(meta: kopf.Meta, memo: OperatorMemo, **_: Any) -> None:
        name = owner_model(dict(meta))
        if name is not None:
            await refresh_model_status(memo, meta["namespace"], name)

    # ---- Tenant --------------------------------------------------------------------------------------

    async def write_tenant_status(
        body: kopf.Body, memo: OperatorMemo, ok: bool, reason: str, message: str
    ) -> None:
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
                now=_now(),
            ),
        }
        if _status_changed(previous, status):
            path = object_path(crds.API_VERSION, crds.TENANT_KIND, None, meta["name"], "status")
            await _kube(memo).merge_patch(path, {"status": status})

    async def tenant_failed(body: kopf.Body, memo: OperatorMemo, reason: str, message: str) -> None:
        if body.get("status", {}).get("phase") != "Failed":
            kopf.warn(body, reason=reason, message=message)
        await write_tenant_status(body, memo, False, reason, message)

    async def sync_tenant(body: kopf.Body, memo: OperatorMemo) -> tuple[str, str] | None:
        """Write the tenant and its key hash to Redis; returns (reason, message) of a failure, or None."""
        try:
            spec = tenant_spec_from(dict(body), memo.config.namespace)
        except SpecError as e:
            await tenant_failed(body, memo, "InvalidSpec", str(e))
            raise kopf.PermanentError(f"invalid spec: {e}") from e
        where = f"Secret {spec.secret_namespace}/{spec.secret_name}"
        try:
            secret = await _kube(memo).get(
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
        registry_ = _registry(memo)
        try:
            await registry_.upsert_tenant(tenant_record(spec))  # the resource is the truth: create or replace
            key_id = await registry_.add_api_key(spec.name, key_hash)
            # A rotated key replaces the old one: only the Secret's current key authenticates.
            for old_id in await registry_.list_api_keys(spec.name):
                if old_id != key_id:
                    await registry_.remove_api_key(spec.name, old_id)
        except RegistryError as e:
            return "KeyConflict", str(e)
        except (redis.exceptions.RedisError, OSError) as e:
            raise kopf.TemporaryError(f"Redis unavailable: {e}", delay=RETRY_DELAY) from e
        await write_tenant_status(body, memo, True, "Synced", f"API key {key_id} registered")
        return None

    @kopf.on.resume(*tenant_resource, registry=registry)
    @kopf.on.create(*tenant_resource, registry=registry)
    @kopf.on.update(*tenant_resource, registry=registry)
    async def reconcile_tenant(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        failure = await sync_tenant(body, memo)
        if failure is not None:
            await tenant_failed(body, memo, *failure)
            if failure[0] in PERMANENT_TENANT_FAILURES:  # retrying soon cannot help: no hot loop
                raise kopf.PermanentError(failure[1])
            raise kopf.TemporaryError(failure[1], delay=SECRET_RETRY_DELAY)

    @kopf.timer(
        *tenant_resource,
        interval=options.resync_seconds,
        initial_delay=options.resync_seconds,
        registry=registry,
    )
    async def resync_tenant(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
        """Picks up rotated keys and late Secrets, and restores what a restarted Redis lost."""
        if body.get("metadata", {}).get("deletionTimestamp"):
            return
        failure = await sync_tenant(body, memo)
        if failure is not None:
            await tenant_failed(body, memo, *failure)

    @kopf.on.delete(*tenant_resource, registry=registry)
    async def delete_tenant(body: kopf.Body, memo: OperatorMemo, logger: logging.Logger, **_: Any) -> None:
        name = body["metadata"]["name"]
        try:
            await _registry(memo).delete_tenant(name)
        except (redis.exceptions.RedisError, OSError) as e:
            raise kopf.TemporaryError(
                f"Redis unavailable, cannot remove the tenant yet: {e}", delay=RETRY_DELAY
            ) from e
        logger.info("tenant %s removed from Redis", name)

    return registry
