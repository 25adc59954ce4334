"""The fleet store's front ends: ``FleetStore`` over a sync ``redis.Redis`` (the engine's presence thread,
scripts, tests) and ``AsyncFleetStore`` over a ``redis.asyncio.Redis`` (gateway, operator).

Both offer the same typed methods (the async ones return awaitables); each method runs one operation
generator of a concern module, so an operation is written once and the front ends differ only in how
they run a round trip (``runner``). Clients must not decode responses (hashes are binary).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

import redis
import redis.asyncio

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store import (
    admission,
    kv_index,
    model_load,
    model_policy,
    replicas,
    tenants,
    tokenizers,
    wake_locks,
)
from kvfleet_common.fleet_store.admission import Admission, AdmitResult, Reservation, UsageRecord
from kvfleet_common.fleet_store.kv_index import KVApplyResult, KVEvent
from kvfleet_common.fleet_store.model_load import ModelLoad
from kvfleet_common.fleet_store.runner import (
    Op,
    check_binary_client,
    reconnect_policy,
    run_async,
    run_sync,
)
from kvfleet_common.schemas import Heartbeat, ModelPolicy, TenantRecord


class _Operations:
    """The typed methods, one per operation, each running its concern's generator. In ``AsyncFleetStore``
    every method returns an awaitable of the same result."""

    def _run(self, op: Op) -> Any:
        raise NotImplementedError

    # replica side
    def publish_heartbeat(self, hb: Heartbeat, ttl: float = keys.HEARTBEAT_TTL_S) -> bool:
        """Write the heartbeat and refresh the replica's TTLs. Returns False if the heartbeat key did not
        exist before (first beat, or Redis lost it: the replica should resync its block index).
        Raises SupersededError if a newer boot epoch of the same name is registered."""
        return self._run(replicas.op_publish_heartbeat(hb, ttl))

    def claim_name(self, name: str, new_replica_id: str, ttl: float = keys.HEARTBEAT_TTL_S) -> str | None:
        """Make ``new_replica_id`` the current epoch of ``name``, deleting what the previous epoch owned
        (heartbeat, block index, set membership). Returns the previous id, if any.
        Raises SupersededError if the name is held by a newer epoch."""
        return self._run(replicas.op_claim_name(name, new_replica_id, ttl))

    def deregister_replica(self, replica_id: str) -> bool:
        """Remove the replica's heartbeat, blocks and name record now. Returns whether it was registered."""
        return self._run(replicas.op_deregister(replica_id))

    def apply_kv_events(
        self, replica_id: str, events: Sequence[KVEvent], first_seq: int | None = None
    ) -> KVApplyResult:
        """Apply ordered events atomically. ``first_seq`` numbers the first event (the rest follow);
        with it the index refuses events that do not continue its ``kv_seq_applied`` (-> resync) and
        ignores a batch it already applied. Without it events are appended unchecked."""
        return self._run(kv_index.op_apply_kv_events(replica_id, events, first_seq))

    def replace_replica_blocks(
        self, replica_id: str, hashes: Iterable[bytes], seq: int | None = None
    ) -> KVApplyResult:
        """Full resync: the block index becomes exactly ``hashes`` (uploaded in chunks, swapped in
        atomically) and ``kv_seq_applied`` becomes ``seq``."""
        return self._run(kv_index.op_replace_blocks(replica_id, hashes, seq))

    def stage_blocks(self, replica_id: str, hashes: Sequence[bytes], fresh: bool = False) -> None:
        """Upload part of a resync (for snapshots too large for one call; ``replace_replica_blocks``
        is stage + commit). ``fresh=True`` discards a previous partial upload."""
        return self._run(kv_index.op_stage_blocks(replica_id, hashes, fresh))

    def commit_staged_blocks(self, replica_id: str, num_hashes: int, seq: int | None = None) -> KVApplyResult:
        """Make the staged upload the block index, if it holds exactly ``num_hashes`` distinct hashes
        (else ``incomplete``: staging expired or Redis lost it; start again)."""
        return self._run(kv_index.op_commit_staged(replica_id, num_hashes, seq))

    def get_heartbeat(self, replica_id: str) -> Heartbeat | None:
        return self._run(replicas.op_get_heartbeat(replica_id))

    # gateway side
    def live_replicas(self, model: str) -> list[Heartbeat]:
        """Heartbeats of the model's replicas within their TTL (sorted by id); prunes expired ids."""
        return self._run(replicas.op_live_replicas(model))

    def prefix_match(
        self, model: str, block_hashes: Sequence[bytes], replica_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """replica id -> number of leading ``block_hashes`` it caches, in one round trip.
        ``replica_ids=None`` checks every registered replica of ``model``."""
        return self._run(kv_index.op_prefix_match(model, block_hashes, replica_ids))

    def list_models(self) -> list[str]:
        """Models with a policy or at least one live replica (sleeping included), sorted; a model
        whose replicas all died and that has no policy is dropped (its next heartbeat re-adds it)."""
        return self._run(replicas.op_list_models())

    # tenants
    def create_tenant(self, record: TenantRecord) -> bool:
        """Create the tenant only if the name is free (atomically): False if it exists. The name must
        pass ``keys.check_tenant_name`` (ValueError)."""
        return self._run(tenants.op_put_tenant_status_is(record, "create", 1))

    def update_tenant(self, record: TenantRecord) -> bool:
        """Replace an existing tenant's record (atomically): False, and nothing written, if it is gone."""
        return self._run(tenants.op_put_tenant_status_is(record, "update", 2))

    def upsert_tenant(self, record: TenantRecord) -> bool:
        """Create or replace (the operator's sync: the Tenant resource is the source of truth). Returns
        whether it was created. The name must pass ``keys.check_tenant_name`` (ValueError)."""
        return self._run(tenants.op_put_tenant_status_is(record, "upsert", 1))

    def put_tenant(self, record: TenantRecord) -> None:
        """``upsert_tenant``, ignoring whether it created the tenant."""
        return self._run(tenants.op_put_tenant_status_is(record, "upsert", None))

    def get_tenant(self, name: str) -> TenantRecord | None:
        return self._run(tenants.op_get_tenant(name))

    def list_tenants(self) -> list[TenantRecord]:
        return self._run(tenants.op_list_tenants())

    def delete_tenant(self, name: str) -> bool:
        """Delete the tenant and every API key lookup it owns. Returns whether it existed."""
        return self._run(tenants.op_delete_tenant(name))

    def add_api_key(self, tenant_name: str, sha256_hex: str) -> str:
        """Register the SHA-256 of an API key for the tenant; returns its key id (stable per key).
        FleetStoreError if the tenant is unknown or the key belongs to another tenant."""
        return self._run(tenants.op_add_api_key(tenant_name, sha256_hex))

    def remove_api_key(self, tenant_name: str, key_id: str) -> bool:
        return self._run(tenants.op_remove_api_key(tenant_name, key_id))

    def list_api_keys(self, tenant_name: str) -> dict[str, str]:
        """key id -> SHA-256 hex of the tenant's API keys."""
        return self._run(tenants.op_list_api_keys(tenant_name))

    def tenant_for_key_hash(self, sha256_hex: str) -> TenantRecord | None:
        """The tenant owning the API key with this SHA-256 (one round trip), or None."""
        return self._run(tenants.op_tenant_for_key_hash(sha256_hex))

    # models
    def put_model_policy(self, policy: ModelPolicy) -> None:
        """Write the model's policy and list the model in ``kvf:models`` (one transaction)."""
        return self._run(model_policy.op_put_model_policy(policy))

    def get_model_policy(self, model: str) -> ModelPolicy | None:
        return self._run(model_policy.op_get_model_policy(model))

    def delete_model_policy(self, model: str) -> bool:
        return self._run(model_policy.op_delete_model_policy(model))

    def touch_activity(self, model: str, now: float | None = None) -> None:
        return self._run(model_policy.op_touch_activity(model, now))

    def last_activity(self, model: str) -> float | None:
        return self._run(model_policy.op_last_activity(model))

    def purge_model(self, model: str) -> None:
        """Delete everything about the model: replicas (heartbeats, block indexes, names, in-flight
        counters), policy, activity, wake lock and tokenizers. Replicas still running re-register."""
        return self._run(model_policy.op_purge_model(model))

    def publish_tokenizer(self, model: str, files: Mapping[str, bytes]) -> str:
        """Store tokenizer files; returns their revision (SHA-256 of the contents, see tokenizer_revision)."""
        return self._run(tokenizers.op_publish_tokenizer(model, files))

    def fetch_tokenizer(self, model: str, revision: str) -> dict[str, bytes] | None:
        return self._run(tokenizers.op_fetch_tokenizer(model, revision))

    def acquire_wake_lock(self, model: str, holder: str, ttl_ms: int = keys.WAKE_LOCK_TTL_MS) -> bool:
        """Take the model's wake lock if free (SET NX PX); True if ``holder`` now holds it."""
        return self._run(wake_locks.op_acquire_wake_lock(model, holder, ttl_ms))

    def release_wake_lock(self, model: str, holder: str) -> bool:
        """Release the lock only if ``holder`` still holds it (it may have expired and been retaken)."""
        return self._run(wake_locks.op_release_wake_lock(model, holder))

    def admit(self, request: Admission, now: float | None = None) -> AdmitResult:
        """Admission + routing facts for one request in one round trip (the gateway's hot path)."""
        return self._run(admission.op_admit(request, now))

    def report_gateway(
        self,
        gateway_id: str,
        replica_load: Mapping[str, tuple[int, int]],
        tenant_inflight: Mapping[str, int],
        usage: Sequence[UsageRecord] = (),
        now: float | None = None,
        *,
        leases: Mapping[str, Iterable[str]] | None = None,
        released: Mapping[str, Iterable[str]] | None = None,
        refunds: Sequence[Reservation] = (),
        model_load: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Publish a gateway's in-flight load (replica -> (requests, queued prompt tokens); tenant ->
        requests; model -> (requests in flight, requests held)), renew / remove its concurrency leases
        and settle finished requests (usage charged, reservations refunded), in one round trip (see
        ``admission.op_report_gateway``)."""
        return self._run(
            admission.op_report_gateway(
                gateway_id, replica_load, tenant_inflight, usage, now, leases, released, refunds, model_load
            )
        )

    def model_load(self, model: str, now: float | None = None) -> ModelLoad:
        """The model's demand as the live gateways report it (in flight, held, queued prompt tokens), summed
        in two round trips (see ``model_load.op_model_load``): the operator's autoscaler reads it each tick."""
        return self._run(model_load.op_model_load(model, now))

    def remove_gateway(self, gateway_id: str) -> None:
        return self._run(admission.op_remove_gateway(gateway_id))

    def tenant_usage(self, names: Sequence[str], now: float | None = None) -> dict[str, dict[str, Any]]:
        return self._run(admission.op_tenant_usage(names, now))

    def record_usage(
        self, tenant_name: str, requests: int, tokens: int, now: float | None = None
    ) -> tuple[int, int]:
        """Add to the tenant's current-minute counters; returns the minute's (requests, tokens) totals."""
        return self._run(admission.op_record_usage(tenant_name, requests, tokens, now))


class FleetStore(_Operations):
    """Sync fleet store over ``redis.Redis`` (decode_responses must be False)."""

    def __init__(self, client: redis.Redis) -> None:
        check_binary_client(client)
        self.client = client

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> FleetStore:
        """A client with ``reconnect_policy`` unless the caller gives its own ``retry``."""
        return cls(redis.Redis.from_url(url, **{**reconnect_policy(sync=True), **kwargs}))

    def _run(self, op: Op) -> Any:
        return run_sync(self.client, op)

    def close(self) -> None:
        self.client.close()


class AsyncFleetStore(_Operations):
    """Async fleet store over ``redis.asyncio.Redis``: the same methods, each returning an awaitable."""

    def __init__(self, client: redis.asyncio.Redis, max_concurrent_ops: int | None = None) -> None:
        """``max_concurrent_ops``: operations beyond this many wait, first come first served, for one to
        finish (each operation holds one connection at a time). Without a limit redis-py's pool opens
        up to 100 connections and then *fails* the command with "Too many connections": a gateway with
        100+ requests in flight took that for Redis being down and admitted requests without their
        quotas until the next success. (redis-py's BlockingConnectionPool waits instead, but a freed
        connection goes to whichever caller asks next, not to the longest waiter: under load some
        requests waited seconds.)"""
        check_binary_client(client)
        self.client = client
        self._slots = asyncio.Semaphore(max_concurrent_ops) if max_concurrent_ops else None

    @classmethod
    def from_url(cls, url: str, *, max_concurrent_ops: int | None = None, **kwargs: Any) -> AsyncFleetStore:
        """A client with ``reconnect_policy`` unless the caller gives its own ``retry``; its pool allows
        twice ``max_concurrent_ops`` connections (room for direct use of ``client``)."""
        options = {**reconnect_policy(sync=False), **kwargs}
        if max_concurrent_ops:
            options.setdefault("max_connections", max(100, 2 * max_concurrent_ops))
        return cls(redis.asyncio.Redis.from_url(url, **options), max_concurrent_ops)

    def _run(self, op: Op) -> Awaitable[Any]:
        if self._slots is None:
            return run_async(self.client, op)
        return self._run_limited(op)

    async def _run_limited(self, op: Op) -> Any:
        assert self._slots is not None
        async with self._slots:
            return await run_async(self.client, op)

    async def aclose(self) -> None:
        await self.client.aclose()
