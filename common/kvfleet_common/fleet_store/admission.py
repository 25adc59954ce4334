"""Gateways: admission (tenant limits and routing facts in one round trip), their in-flight load,
concurrency leases, and tenants' usage.

Admission checks and takes in one script (request counted, tokens reserved, concurrency lease taken),
so no burst of parallel requests, on one gateway or many, gets past a limit; a lease expires unless its
gateway renews it, so a dead gateway leaks no slot. Each gateway writes only its own load hash, with
absolute counts, so its counts vanish with it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.kv_index import MATCH_CHUNK, check_hashes
from kvfleet_common.fleet_store.runner import Batch, Eval, Op, Script, as_text, ttl_ms
from kvfleet_common.schemas import TenantRecord

ADMIT = Script.load("admit")
# admit.lua's ARGV 15-20, the same for every request (built once: admission is the gateway's hot path)
_ADMIT_KEY_MATERIAL = (*keys.gateway_load_template().args(), *keys.replica_blocks_template().args(),
                       keys.LOAD_FIELD_REPLICA_REQUESTS, keys.LOAD_FIELD_REPLICA_PROMPT_TOKENS)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Admission:
    """What the gateway asks Redis before proxying one request (see ``op_admit``).

    ``lease``: a fresh id (unique fleet-wide) for the request's concurrency slot, taken in
    ``kvf:inflight:<tenant>`` by the same atomic call that checks the limit ('' when the tenant has no
    ``max_concurrent``). ``reserve_tokens``: the request's estimate (prompt + most completion tokens),
    reserved in the tokens/min window at admission and settled by ``op_report_gateway``. ``released``:
    leases of this tenant the asking gateway already released and has not removed yet; removed first."""

    gateway_id: str
    tenant: TenantRecord
    model: str
    candidates: Sequence[str]  # replica ids
    block_hashes: Sequence[bytes]
    lease: str = ""
    reserve_tokens: int = 0
    released: Sequence[str] = ()


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """``refused`` is None when admitted, else "concurrency" | "requests" | "tokens" (what ran out).

    Per candidate (same order as asked): leading blocks it caches, and the requests in flight to it and
    queued prompt tokens routed to it by *other* gateways."""

    refused: str | None
    used: int = 0  # when refused: the count that hit the limit (the sliding minute's estimate)
    window: tuple[int, int] = (0, 0)  # when refused by a rate: (this minute's, the previous minute's) count
    minute: int = 0  # the rate-limit minute the request was counted (and its tokens reserved) in
    matched_blocks: tuple[int, ...] = ()
    inflight: tuple[int, ...] = ()
    pending_tokens: tuple[int, ...] = ()


def rate_retry_after(limit: int, window: tuple[int, int], now: float, need: int = 1) -> float:
    """Seconds until the sliding-minute estimate leaves room for ``need`` more under ``limit``, if nothing
    else is counted meanwhile.

    The estimate (as in ``lua/admit.lua``) is ``this minute + previous minute × (1 − elapsed fraction)``: the
    previous minute fades out linearly. If it cannot fade enough within this minute, this minute's count
    becomes the fading one after the boundary."""
    size = keys.RATELIMIT_WINDOW_S
    this, previous = window
    into = now % size
    room = limit - need  # the estimate must fall to this
    if this <= room:
        if previous <= 0 or this + previous * (1 - into / size) <= room:
            return 0.0
        return size * (1 - (room - this) / previous) - into  # < size - into because this <= room
    faded = size * (1 - room / this) if this > 0 and room >= 0 else size
    return size - into + faded


@dataclass(frozen=True, slots=True)
class Reservation:
    """Tokens one admitted request reserved in its tenant's tokens/min window of ``minute``."""

    tenant: str
    minute: int
    tokens: int


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """Tokens one finished request used, charged to its tenant (and to the tokens/min window)."""

    tenant: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


USAGE_COUNTERS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


def op_admit(a: Admission, now: float | None) -> Op:
    now = time.time() if now is None else float(now)
    t = a.tenant
    minute, into = divmod(now, keys.RATELIMIT_WINDOW_S)
    keys.check_name(a.gateway_id, "gateway id")
    candidates = [keys.parse_replica_id(r) and r for r in a.candidates]
    released = list(a.released)
    reply = yield Eval(
        ADMIT,
        [keys.gateways(), keys.ratelimit(t.name, int(minute)), keys.model_activity(a.model),
         keys.ratelimit(t.name, int(minute) - 1), keys.inflight(t.name)],
        [a.gateway_id, repr(now), keys.GATEWAY_LOAD_TTL_S, int(now * 1000), t.requests_per_minute or 0,
         t.tokens_per_minute or 0, t.max_concurrent or 0, a.lease, keys.RATELIMIT_TTL_S,
         repr(1.0 - into / keys.RATELIMIT_WINDOW_S), len(candidates), MATCH_CHUNK, max(0, int(a.reserve_tokens)),
         ttl_ms(keys.LEASE_TTL_S), *_ADMIT_KEY_MATERIAL, len(released), *released, *candidates,
         *check_hashes(a.block_hashes)],
    )  # fmt: skip
    status = as_text(reply[0])
    if status != "ok":
        return AdmitResult(refused=status, used=int(reply[1]), window=(int(reply[2]), int(reply[3])))
    matched, inflight, pending = (tuple(int(x) for x in part) for part in reply[1:4])
    return AdmitResult(
        None, minute=int(minute), matched_blocks=matched, inflight=inflight, pending_tokens=pending
    )


def op_report_gateway(
    gateway_id: str,
    replica_load: Mapping[str, tuple[int, int]],
    tenant_inflight: Mapping[str, int],
    usage: Sequence[UsageRecord],
    now: float | None,
    leases: Mapping[str, Iterable[str]] | None = None,
    released: Mapping[str, Iterable[str]] | None = None,
    refunds: Sequence[Reservation] = (),
    model_load: Mapping[str, tuple[int, int]] | None = None,
) -> Op:
    """One pipeline: replace this gateway's load hash (absolute values; TTL refreshed; ``model_load``:
    model -> (requests in flight to its replicas, requests held for it), read by ``op_model_load``), mark it alive,
    renew its live concurrency leases (``leases``: tenant -> ids; ``ZADD XX``, so a lease removed
    meanwhile is never revived), remove released ones (``released``), and settle finished requests:
    their real usage is added to the tenants' counters and to the tokens/min window of this minute,
    their reservations (``refunds``) are taken back from the window they were made in (skipped once
    that window is older than the previous minute: it no longer counts)."""
    now = time.time() if now is None else float(now)
    load_key = keys.gateway_load(gateway_id)
    fields: list[Any] = []
    for rid, (inflight, pending) in sorted(replica_load.items()):
        keys.parse_replica_id(rid)
        if inflight or pending:
            fields += [
                keys.LOAD_FIELD_REPLICA_REQUESTS + rid,
                int(inflight),
                keys.LOAD_FIELD_REPLICA_PROMPT_TOKENS + rid,
                int(pending),
            ]
    for name, n in sorted(tenant_inflight.items()):
        if n:
            fields += [keys.LOAD_FIELD_TENANT_REQUESTS + keys.check_name(name, "tenant"), int(n)]
    for model, (inflight, held) in sorted((model_load or {}).items()):
        keys.check_name(model, "model")
        if inflight:
            fields += [keys.LOAD_FIELD_MODEL_REQUESTS + model, int(inflight)]
        if held:
            fields += [keys.LOAD_FIELD_MODEL_HELD + model, int(held)]
    cmds: list[tuple[Any, ...]] = [("DEL", load_key)]
    if fields:
        cmds += [("HSET", load_key, *fields), ("PEXPIRE", load_key, ttl_ms(keys.GATEWAY_LOAD_TTL_S))]
    cmds += [
        ("ZADD", keys.gateways(), repr(now), gateway_id),
        ("ZREMRANGEBYSCORE", keys.gateways(), "-inf", repr(now - 6 * keys.GATEWAY_LOAD_TTL_S)),
    ]
    for tenant, ids in sorted((released or {}).items()):
        if ids := sorted(ids):
            cmds.append(("ZREM", keys.inflight(tenant), *ids))
    expiry = int(now * 1000) + ttl_ms(keys.LEASE_TTL_S)
    for tenant, ids in sorted((leases or {}).items()):
        if ids := sorted(ids):
            k = keys.inflight(tenant)
            cmds += [("ZADD", k, "XX", *(x for i in ids for x in (expiry, i))),
                     ("PEXPIRE", k, ttl_ms(keys.LEASE_TTL_S))]  # fmt: skip
    minute = int(now // keys.RATELIMIT_WINDOW_S)  # the tokens/min window of the minute requests finished in
    window_tokens: dict[tuple[str, int], int] = {}
    for r in refunds:
        if r.minute >= minute - 1 and r.tokens:
            window_tokens[r.tenant, r.minute] = window_tokens.get((r.tenant, r.minute), 0) - int(r.tokens)
    for tenant, models in _usage_totals(usage).items():
        k = keys.usage(tenant)
        tenant_total = [0] * len(USAGE_COUNTERS)
        for model, counts in models.items():
            prefix = keys.check_name(model, "model")
            for i, (name, n) in enumerate(zip(USAGE_COUNTERS, counts)):
                tenant_total[i] += n
                cmds.append(("HINCRBY", k, f"{prefix}|{name}", n))
        cmds += [("HINCRBY", k, name, n) for name, n in zip(USAGE_COUNTERS, tenant_total)]
        charged = tenant_total[1] + tenant_total[2]  # prompt + completion
        window_tokens[tenant, minute] = window_tokens.get((tenant, minute), 0) + charged
    for (tenant, m), n in window_tokens.items():
        w = keys.ratelimit(tenant, m)
        cmds += [("HINCRBY", w, "tokens", n), ("EXPIRE", w, keys.RATELIMIT_TTL_S)]
    yield Batch(cmds, transaction=True)


def _usage_totals(usage: Sequence[UsageRecord]) -> dict[str, dict[str, list[int]]]:
    """tenant -> model -> summed ``USAGE_COUNTERS``: a report carries one increment per counter, however
    many requests finished since the last one (at 100 streams that is tens of requests per report)."""
    totals: dict[str, dict[str, list[int]]] = {}
    for u in usage:
        counts = totals.setdefault(u.tenant, {}).setdefault(u.model, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += int(u.prompt_tokens)
        counts[2] += int(u.completion_tokens)
        counts[3] += int(u.cached_tokens)
    return totals


def op_remove_gateway(gateway_id: str) -> Op:
    yield Batch(
        [("DEL", keys.gateway_load(gateway_id)), ("ZREM", keys.gateways(), gateway_id)], transaction=True
    )


def op_tenant_usage(names: Sequence[str], now: float | None) -> Op:
    """Per tenant: cumulative counters (``{"total": {...}, "models": {model: {...}}}``) and the current
    minute's ``{"requests", "tokens"}``."""
    now = time.time() if now is None else float(now)
    names = list(names)
    if not names:
        return {}
    minute = int(now // keys.RATELIMIT_WINDOW_S)
    cmds: list[tuple[Any, ...]] = []
    for n in names:
        cmds += [("HGETALL", keys.usage(n)), ("HGETALL", keys.ratelimit(n, minute))]
    replies = yield Batch(cmds)
    out: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(names):
        total = dict.fromkeys(USAGE_COUNTERS, 0)
        per_model: dict[str, dict[str, int]] = {}
        for field_, value in replies[2 * i].items():
            name = as_text(field_)
            model, sep, counter = name.rpartition("|")
            if sep:
                per_model.setdefault(model, dict.fromkeys(USAGE_COUNTERS, 0))[counter] = int(value)
            else:
                total[name] = int(value)
        window = {as_text(k): max(0, int(v)) for k, v in replies[2 * i + 1].items()}
        out[n] = {"total": total, "models": per_model,
                  "this_minute": {"requests": window.get("requests", 0), "tokens": window.get("tokens", 0)}}  # fmt: skip
    return out


def op_record_usage(tenant_name: str, requests: int, tokens: int, now: float | None) -> Op:
    minute = int((time.time() if now is None else now) // keys.RATELIMIT_WINDOW_S)
    key = keys.ratelimit(tenant_name, minute)
    req, tok, _ = yield Batch(
        [("HINCRBY", key, "requests", int(requests)), ("HINCRBY", key, "tokens", int(tokens)),
         ("EXPIRE", key, keys.RATELIMIT_TTL_S)],
        transaction=True,
    )  # fmt: skip
    return int(req), int(tok)
