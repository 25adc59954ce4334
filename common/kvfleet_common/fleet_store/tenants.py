"""Tenants and their API keys.

A tenant's record and its membership in ``kvf:tenants`` are written by one script, so a create of a
taken name, or an update of a deleted tenant, is refused atomically. API keys are stored only as
SHA-256 hex, each owned by at most one tenant.
"""

from __future__ import annotations

from typing import Literal

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Eval, FleetStoreError, Op, Script, as_text
from kvfleet_common.schemas import TenantRecord, decode_tenant, encode_json

PUT_TENANT = Script.load("put_tenant")
DELETE_TENANT = Script.load("delete_tenant")
ADD_API_KEY = Script.load("add_api_key")
REMOVE_API_KEY = Script.load("remove_api_key")
TENANT_FOR_KEY_HASH = Script.load("tenant_for_key_hash")

TenantWrite = Literal["create", "update", "upsert"]


def api_key_id(sha256_hex: str) -> str:
    """Stable id of an API key: re-adding the same key is idempotent, and the id reveals nothing new."""
    return "k" + keys.check_sha256_hex(sha256_hex)[:16]


def op_put_tenant(record: TenantRecord, mode: TenantWrite = "upsert") -> Op:
    """Write the record: ``create`` only if the name is free, ``update`` only if it exists, ``upsert``
    either way. Returns 1 created, 2 replaced, 0 refused. New names must pass ``check_tenant_name``."""
    if mode not in ("create", "update", "upsert"):
        raise ValueError(f"unknown tenant write mode {mode!r}")
    if mode != "update":
        keys.check_tenant_name(record.name)
    status = yield Eval(
        PUT_TENANT, [keys.tenant(record.name), keys.tenants()], [encode_json(record), record.name, mode]
    )
    return int(status)


def op_put_tenant_status_is(record: TenantRecord, mode: TenantWrite, wanted: int | None) -> Op:
    """``op_put_tenant`` whose status is compared with ``wanted`` (None: no result)."""
    status = yield from op_put_tenant(record, mode)
    return None if wanted is None else status == wanted


def op_get_tenant(name: str) -> Op:
    (data,) = yield Batch([("GET", keys.tenant(name))])
    return decode_tenant(data) if data is not None else None


def op_list_tenants() -> Op:
    (names,) = yield Batch([("SMEMBERS", keys.tenants())])
    names = sorted(as_text(n) for n in names)
    if not names:
        return []
    (datas,) = yield Batch([("MGET", *(keys.tenant(n) for n in names))])
    return [decode_tenant(d) for d in datas if d is not None]


def op_delete_tenant(name: str) -> Op:
    existed = yield Eval(
        DELETE_TENANT,
        [keys.tenant(name), keys.tenant_keys(name), keys.tenants(), keys.usage(name), keys.inflight(name)],
        [name, *keys.api_key_template().args()],
    )
    return bool(existed)


def op_add_api_key(tenant_name: str, sha256_hex: str) -> Op:
    key_id = api_key_id(sha256_hex)
    status = yield Eval(
        ADD_API_KEY,
        [keys.tenant(tenant_name), keys.tenant_keys(tenant_name), keys.api_key(sha256_hex)],
        [tenant_name, sha256_hex, key_id],
    )
    if status == -1:
        raise FleetStoreError(f"unknown tenant {tenant_name!r}: put_tenant first")
    if status == -2:
        raise FleetStoreError("this API key already belongs to another tenant")
    return key_id


def op_remove_api_key(tenant_name: str, key_id: str) -> Op:
    removed = yield Eval(
        REMOVE_API_KEY,
        [keys.tenant_keys(tenant_name)],
        [tenant_name, key_id, *keys.api_key_template().args()],
    )
    return bool(removed)


def op_list_api_keys(tenant_name: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.tenant_keys(tenant_name))])
    return {as_text(k): as_text(v) for k, v in fields.items()}


def op_tenant_for_key_hash(sha256_hex: str) -> Op:
    data = yield Eval(TENANT_FOR_KEY_HASH, [keys.api_key(sha256_hex)], keys.tenant_template().args())
    return decode_tenant(data) if data else None
