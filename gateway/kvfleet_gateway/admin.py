"""Admin API: tenants and their API keys, models and replicas, usage, sleep / wake.

Authenticated with ``Authorization: Bearer <admin token>`` (``--admin-token`` / ``KVFLEET_ADMIN_TOKEN``).
API keys are shown once, at creation; Redis stores only their SHA-256. Sleep and wake reach only verified
replicas, with their model's own admin token (``kvfleet_gateway.replica_trust``); the models listing shows
verified replicas and counts the others (``unverified_replicas``).

Tenant names follow the Tenant resource's rule (``redis_keys.check_tenant_name``: lowercase DNS-style,
one URL path segment). ``POST /admin/tenants`` only ever creates (atomically: of concurrent creates of a
name exactly one gets 201, the others 409); changes go through ``PATCH``. The operator writes tenants
with ``FleetStore.upsert_tenant`` instead (the Tenant resource is the source of truth). The per-tenant
routes also accept a name stored before the rule (one with ``/``), so such a tenant can still be read,
changed, deleted and have its keys revoked.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvfleet_common import redis_keys
from kvfleet_common.fleet_store.runner import FleetStoreError
from kvfleet_common.schemas import Heartbeat, TenantRecord
from kvfleet_common.server_kit.http import ApiError, bearer_matches

API_KEY_PREFIX = "kvf-"


def new_api_key() -> tuple[str, str]:
    """A fresh API key and its SHA-256 hex (the only form Redis ever sees)."""
    key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return key, hashlib.sha256(key.encode()).hexdigest()


def require_admin(request: Request) -> None:
    token = request.app.state.config.admin_token
    if not token:
        raise ApiError(403, "the admin API is disabled: start the gateway with --admin-token")
    if not bearer_matches(request, token):
        raise ApiError(401, "a valid admin token is required (Authorization: Bearer <token>)",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


Admin = Annotated[None, Depends(require_admin)]
Level = Annotated[int, Query(ge=1, le=2, description="1: offload weights to host memory; 2: discard them")]
_TenantName = Field(
    min_length=1,
    max_length=253,
    pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$",
    description="lowercase letters, digits, '-' and '.', like a Kubernetes object name (the Tenant resource's)",
)


class TenantLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: list[Annotated[str, Field(min_length=1, pattern=r"^\S+$")]] | None = None
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_concurrent: int | None = Field(None, ge=1)
    priority: int | None = Field(None, ge=-1000, le=1000)
    cache_salt: str | None = Field(None, max_length=256)


class TenantCreate(TenantLimits):
    name: str = _TenantName


class TenantOut(BaseModel):
    name: str
    models: list[str]
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    priority: int
    cache_isolated: bool  # the salt itself is a secret of the platform: never shown
    key_ids: list[str] = []


class TenantCreated(BaseModel):
    name: str
    api_key: str
    key_id: str


class KeyCreated(BaseModel):
    key_id: str
    api_key: str


def _out(rec: TenantRecord, key_ids: list[str]) -> TenantOut:
    return TenantOut(
        name=rec.name, models=list(rec.models), requests_per_minute=rec.requests_per_minute,
        tokens_per_minute=rec.tokens_per_minute, max_concurrent=rec.max_concurrent, priority=rec.priority,
        cache_isolated=bool(rec.cache_salt), key_ids=sorted(key_ids),
    )  # fmt: skip


def _record(name: str, fields: dict[str, Any]) -> TenantRecord:
    try:
        return TenantRecord(name=name, **{k: v for k, v in fields.items() if v is not None})
    except (ValueError, TypeError, msgspec.ValidationError) as e:
        raise ApiError(400, str(e)) from None


def build_admin_router() -> APIRouter:
    router = APIRouter(prefix="/admin", tags=["admin"])

    def state(request: Request):
        return request.app.state

    # ---- tenants -------------------------------------------------------------------------------------

    @router.post("/tenants", status_code=201, response_model=TenantCreated)
    async def create_tenant(_: Admin, body: TenantCreate, request: Request) -> TenantCreated:
        st = state(request)
        store = st.store
        fields = body.model_dump(exclude={"name"})
        if fields["cache_salt"] is None:  # default: the tenant's own cache, unguessable by others
            fields["cache_salt"] = secrets.token_hex(16)
        rec = _record(body.name, fields)
        exists = ApiError(409, f"tenant {body.name!r} already exists", param="name", code="tenant_exists")
        if not await store.create_tenant(rec):  # atomic: one of concurrent creates wins
            raise exists
        key, key_hash = new_api_key()
        try:
            key_id = await store.add_api_key(rec.name, key_hash)
        except FleetStoreError:  # deleted again before its first key was added
            raise ApiError(409, f"tenant {body.name!r} was deleted while being created", param="name",
                           code="tenant_conflict") from None  # fmt: skip
        st.tenants.forget()
        return TenantCreated(name=rec.name, api_key=key, key_id=key_id)

    @router.get("/tenants", response_model=list[TenantOut])
    async def list_tenants(_: Admin, request: Request) -> list[TenantOut]:
        store = state(request).store
        records = await store.list_tenants()
        keys = await asyncio.gather(*(store.list_api_keys(r.name) for r in records))
        return [_out(r, list(k)) for r, k in zip(records, keys)]

    async def _get(request: Request, name: str) -> TenantRecord:
        try:
            redis_keys.check_name(name, "tenant")
        except ValueError as e:
            raise ApiError(400, str(e), param="name") from None
        rec = await state(request).store.get_tenant(name)
        if rec is None:
            raise ApiError(404, f"tenant {name!r} does not exist", code="tenant_not_found")
        return rec

    # The key routes come first: ``{name:path}`` (for names stored before the naming rule, with ``/``)
    # would otherwise take ``acme/keys/<id>`` for a tenant name.
    @router.post("/tenants/{name:path}/keys", status_code=201, response_model=KeyCreated)
    async def add_key(_: Admin, name: str, request: Request) -> KeyCreated:
        st = state(request)
        await _get(request, name)
        key, key_hash = new_api_key()
        try:
            key_id = await st.store.add_api_key(name, key_hash)
        except FleetStoreError as e:
            raise ApiError(404, str(e), code="tenant_not_found") from None
        st.tenants.forget()
        return KeyCreated(key_id=key_id, api_key=key)

    @router.delete("/tenants/{name:path}/keys/{key_id}")
    async def remove_key(_: Admin, name: str, key_id: str, request: Request) -> dict:
        st = state(request)
        await _get(request, name)
        if not await st.store.remove_api_key(name, key_id):
            raise ApiError(404, f"tenant {name!r} has no key {key_id!r}", code="key_not_found")
        st.tenants.forget(name)
        return {"name": name, "key_id": key_id, "deleted": True}

    @router.get("/tenants/{name:path}", response_model=TenantOut)
    async def get_tenant(_: Admin, name: str, request: Request) -> TenantOut:
        rec = await _get(request, name)
        return _out(rec, list(await state(request).store.list_api_keys(name)))

    @router.patch("/tenants/{name:path}", response_model=TenantOut)
    async def patch_tenant(_: Admin, name: str, body: TenantLimits, request: Request) -> TenantOut:
        st = state(request)
        rec = await _get(request, name)
        changes = body.model_dump(exclude_unset=True)
        if changes.get("cache_salt", "") is None:
            del changes["cache_salt"]  # null keeps the salt (it cannot be read back, only replaced)
        merged = {f: getattr(rec, f) for f in rec.__struct_fields__ if f != "name"} | changes
        new = _record(name, merged)  # null limits are unlimited; null models/priority take the defaults
        if not await st.store.update_tenant(new):  # never recreates a tenant deleted meanwhile
            raise ApiError(404, f"tenant {name!r} does not exist", code="tenant_not_found")
        st.tenants.forget(name)
        return _out(new, list(await st.store.list_api_keys(name)))

    @router.delete("/tenants/{name:path}")
    async def delete_tenant(_: Admin, name: str, request: Request) -> dict:
        st = state(request)
        await _get(request, name)
        await st.store.delete_tenant(name)
        st.tenants.forget(name)
        return {"name": name, "deleted": True}

    # ---- models, usage -------------------------------------------------------------------------------

    def _replica_json(hb: Heartbeat, st) -> dict:
        inflight, queued = st.load.local_replica_load(hb.replica_id)
        return {
            "id": hb.replica_id, "name": hb.name, "url": hb.base_url, "state": hb.state,
            "load": {"running": hb.running, "waiting": hb.waiting, "kv_usage": hb.kv_usage,
                     "gateway_inflight": inflight, "gateway_queued_tokens": queued},
            "prefill_tokens_per_s": hb.prefill_tokens_per_s, "decode_tokens_per_s": hb.decode_tokens_per_s,
            "block_size": hb.block_size, "max_model_len": hb.max_model_len, "version": hb.version,
            "heartbeat_age_s": None,
        }  # fmt: skip

    @router.get("/models")
    async def list_models(_: Admin, request: Request) -> dict:
        st = state(request)
        store = st.store
        out = []
        for name in await store.list_models():
            live, policy = await asyncio.gather(store.live_replicas(name), store.get_model_policy(name))
            replicas, unverified = st.trust.split(live)
            out.append({
                "name": name,
                "routing_policy": policy.routing_policy if policy else st.config.default_policy,
                "config": msgspec.to_builtins(policy) if policy else None,
                "replicas": [_replica_json(hb, st) for hb in replicas],
                "unverified_replicas": len(unverified),
            })  # fmt: skip
        return {"data": out}

    @router.get("/usage")
    async def usage(_: Admin, request: Request, tenant: Annotated[str | None, Query()] = None) -> dict:
        store = state(request).store
        if tenant is not None:
            try:
                redis_keys.check_name(tenant, "tenant")
            except ValueError as e:
                raise ApiError(400, str(e), param="tenant") from None
        names = [tenant] if tenant else [r.name for r in await store.list_tenants()]
        return {"data": await store.tenant_usage(names)}

    # ---- sleep / wake --------------------------------------------------------------------------------

    async def _replicas(request: Request, model: str, replica: str | None) -> list[Heartbeat]:
        try:
            redis_keys.check_name(model, "model")
        except ValueError as e:
            raise ApiError(400, str(e), param="model") from None
        replicas = state(request).trust.verified(await state(request).store.live_replicas(model))
        if not replicas:
            raise ApiError(404, f"no live (verified) replica of model {model!r}", code="model_not_found")
        if replica is not None:
            replicas = [hb for hb in replicas if replica in (hb.replica_id, hb.name)]
            if not replicas:
                raise ApiError(
                    404, f"model {model!r} has no live replica {replica!r}", code="replica_not_found"
                )
        return replicas

    async def _sleep(request: Request, model: str, replica: str | None, level: int) -> JSONResponse:
        from kvfleet_gateway.wake import call_replica

        st = state(request)
        targets = [hb for hb in await _replicas(request, model, replica) if hb.state in ("awake", "sleeping")]
        results = await asyncio.gather(
            *(call_replica(st.http, hb, "sleep", st.trust.admin_token(model), level) for hb in targets)
        )
        body = {
            "model": model,
            "level": level,
            "replicas": {hb.replica_id: d for hb, (_, d) in zip(targets, results)},
        }
        st.fleet.request_refresh()
        return JSONResponse(body, status_code=200 if all(ok for ok, _ in results) else 502)

    async def _wake(request: Request, model: str, replica: str | None) -> JSONResponse:
        st = state(request)
        targets = await _replicas(request, model, replica)
        results = await st.waker.wake_replicas(model, targets)
        ok = all(v == "ok" for v in results.values())
        return JSONResponse({"model": model, "replicas": results}, status_code=200 if ok else 502)

    @router.post("/models/{model:path}/replicas/{replica}/sleep")
    async def sleep_replica(_: Admin, model: str, replica: str, request: Request, level: Level = 1):
        return await _sleep(request, model, replica, level)

    @router.post("/models/{model:path}/replicas/{replica}/wake")
    async def wake_replica(_: Admin, model: str, replica: str, request: Request):
        return await _wake(request, model, replica)

    @router.post("/models/{model:path}/sleep")
    async def sleep_model(_: Admin, model: str, request: Request, level: Level = 1):
        return await _sleep(request, model, None, level)

    @router.post("/models/{model:path}/wake")
    async def wake_model(_: Admin, model: str, request: Request):
        return await _wake(request, model, None)

    return router
