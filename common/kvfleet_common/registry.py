"""Operations over the Redis contract (``redis_keys``), for engine, gateway and operator.

``Registry`` wraps a sync ``redis.Redis`` (the engine's presence thread, scripts, tests) and
``AsyncRegistry`` a ``redis.asyncio.Redis`` (gateway, operator); both offer the same methods, the
async ones returning awaitables. Each operation is written once, as a generator that yields
*round trips* (one pipeline or one Lua script call) and receives their replies, so the two classes
only differ in how they run a round trip. Pure logic (hashing revisions, counting leading matches,
encoding events) lives in plain functions tested without Redis.

Invariants kept here:
- a replica's heartbeat hash, its block set and its name record expire together (one TTL,
  refreshed by every heartbeat); everything a replica writes vanishes if it dies;
- the block set changes only through scripts that first check the heartbeat exists and that the
  events continue the sequence the index already reflects (``kv_seq_applied``); otherwise the
  writer is told to resync, so the index is either exact or known to be behind;
- admission checks and takes in one script (request counted, tokens reserved, concurrency lease taken),
  so no burst gets past a limit; a lease expires unless its gateway renews it, so a dead gateway leaks
  no slot;
- work proportional to a large set never runs as one blocking command: sets are deleted with
  ``UNLINK`` (freed in the background) and uploaded in chunks.

Scripts build some key names from set members, so this targets standalone Redis (or Sentinel),
not Redis Cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.exceptions
import redis.retry
from redis.backoff import ExponentialBackoff

from kvfleet_common import redis_keys as keys
from kvfleet_common.schemas import (
    Heartbeat,
    ModelConfig,
    TenantRecord,
    decode_model_config,
    decode_tenant,
    encode_json,
)

logger = logging.getLogger(__name__)

HASH_BYTES = 16
EVENT_BATCH = 1000  # events per apply call: bounds the time one script holds Redis
UPLOAD_CHUNK = 1000  # members per SADD while uploading a resync
MATCH_CHUNK = 256  # most hashes per SMISMEMBER in prefix_match (chunks grow from 16; stop at the first miss)

KVEvent = tuple[str, bytes | None]  # ("stored", h) | ("removed", h) | ("cleared", None)


class RegistryError(Exception):
    """An operation was refused by the contract (e.g. unknown tenant, key owned by another tenant)."""


class SupersededError(RegistryError):
    """A newer boot epoch of the same replica name holds the name; this replica must stop publishing."""


# ---- pure helpers -------------------------------------------------------------------------------


def tokenizer_revision(files: Mapping[str, bytes]) -> str:
    """SHA-256 over the files, sorted by name, each name and body length-prefixed (unambiguous)."""
    if not files:
        raise ValueError("a tokenizer needs at least one file")
    h = hashlib.sha256()
    for name in sorted(files):
        body = files[name]
        if not isinstance(body, bytes | bytearray):
            raise TypeError(f"tokenizer file {name!r} must be bytes, got {type(body).__name__}")
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"invalid tokenizer file name {name!r}")
        raw = name.encode()
        h.update(len(raw).to_bytes(8, "little") + raw + len(body).to_bytes(8, "little"))
        h.update(body)
    return h.hexdigest()


def encode_kv_events(events: Iterable[KVEvent]) -> list[bytes]:
    """Flatten events to the apply script's argument pairs (op letter, hash); ValueError if malformed."""
    out: list[bytes] = []
    for event in events:
        kind, h = event
        if kind == "cleared":
            out += [b"c", b""]
            continue
        if kind not in ("stored", "removed"):
            raise ValueError(f"unknown KV event kind {kind!r}")
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"KV event {kind!r} needs a {HASH_BYTES}-byte block hash, got {h!r}")
        out += [b"s" if kind == "stored" else b"r", h]
    return out


def leading_matches(flags: Sequence[int]) -> int:
    """How many leading entries are truthy: the prefix a replica holds (a gap ends the match)."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def api_key_id(sha256_hex: str) -> str:
    """Stable id of an API key: re-adding the same key is idempotent, and the id reveals nothing new."""
    return "k" + keys.check_sha256_hex(sha256_hex)[:16]


def _check_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    out = list(hashes)
    for h in out:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes, got {h!r}")
    return out


def _text(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


# ---- Lua ----------------------------------------------------------------------------------------

_EPOCH = "local function epoch(id) return tonumber(string.match(id, '#(%d+)$')) end\n"

# KEYS: heartbeat, blocks, name, model replicas, models. ARGV: ttl_ms, replica id, model, epoch, field/value...
# -> 1 heartbeat refreshed, 0 heartbeat (re)created (the index may be gone: resync), -1 superseded.
_HEARTBEAT = (
    _EPOCH
    + """
local cur = redis.call('GET', KEYS[3])
if cur and cur ~= ARGV[2] and (epoch(cur) or 0) > tonumber(ARGV[4]) then return -1 end
local existed = redis.call('EXISTS', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[1])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[3])
return existed
"""
)

# KEYS: name. ARGV: new replica id, its epoch, ttl_ms, key prefix.
# -> {0, previous id or ''} claimed; {-1, holder} a newer epoch holds the name.
_CLAIM = (
    _EPOCH
    + """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then
  if (epoch(cur) or 0) > tonumber(ARGV[2]) then return {-1, cur} end
  local hb = ARGV[4] .. 'replica:' .. cur
  local model = redis.call('HGET', hb, 'model')
  if model then redis.call('SREM', ARGV[4] .. 'model:' .. model .. ':replicas', cur) end
  redis.call('UNLINK', hb, hb .. ':blocks', hb .. ':resync')
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
if cur == ARGV[1] then return {0, ''} end
return {0, cur or ''}
"""
)

# KEYS: heartbeat, blocks, resync, name. ARGV: replica id, key prefix. -> 1 if it was registered.
_DEREGISTER = """
local model = redis.call('HGET', KEYS[1], 'model')
if model then redis.call('SREM', ARGV[2] .. 'model:' .. model .. ':replicas', ARGV[1]) end
local n = redis.call('UNLINK', KEYS[1], KEYS[2], KEYS[3])
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
if model then return 1 end
return 0
"""

# KEYS: heartbeat, blocks. ARGV: first seq (or -1 = unchecked), event count, (op, hash)...
# -> {1, seq} applied; {0, seq} already applied (a retried batch); {-1, 0} no heartbeat; {-2, seq} gap.
_APPLY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local applied = tonumber(redis.call('HGET', KEYS[1], 'kv_seq_applied') or '0')
local first = tonumber(ARGV[1])
local count = tonumber(ARGV[2])
if first < 0 then first = applied + 1 end
local last = first + count - 1
if applied >= last then return {0, applied} end
if applied ~= first - 1 then return {-2, applied} end
for i = 3, #ARGV, 2 do
  local op = ARGV[i]
  if op == 's' then redis.call('SADD', KEYS[2], ARGV[i + 1])
  elseif op == 'r' then redis.call('SREM', KEYS[2], ARGV[i + 1])
  else redis.call('UNLINK', KEYS[2]) end
end
local pttl = redis.call('PTTL', KEYS[1])
if pttl > 0 then redis.call('PEXPIRE', KEYS[2], pttl) end
redis.call('HSET', KEYS[1], 'kv_seq_applied', last)
return {1, last}
"""

# KEYS: heartbeat, blocks, resync. ARGV: seq ('' = keep), number of hashes staged.
# -> {1, seq} replaced; {-1, 0} no heartbeat; {-3, found} the staging set is incomplete (expired or lost).
_REPLACE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('UNLINK', KEYS[3])
  return {-1, 0}
end
local found = redis.call('SCARD', KEYS[3])
if found ~= tonumber(ARGV[2]) then
  redis.call('UNLINK', KEYS[3])
  return {-3, found}
end
redis.call('UNLINK', KEYS[2])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('RENAME', KEYS[3], KEYS[2])
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl > 0 then redis.call('PEXPIRE', KEYS[2], pttl) end
end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'kv_seq_applied', ARGV[1]) end
return {1, tonumber(redis.call('HGET', KEYS[1], 'kv_seq_applied') or '0')}
"""

# KEYS: model replicas. ARGV: key prefix. -> list of HGETALL replies of live replicas; prunes dead ids.
_LIVE = """
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hb = redis.call('HGETALL', ARGV[1] .. 'replica:' .. id)
  if #hb == 0 then redis.call('SREM', KEYS[1], id) else out[#out + 1] = hb end
end
return out
"""

# KEYS: the replicas' block sets, or (ARGV[1] == 'model') the model's replica set.
# ARGV: mode, key prefix, chunk, hash... -> {ids or {}, counts}: leading hashes each replica holds.
_PREFIX_MATCH = """
local ids, sets = {}, {}
if ARGV[1] == 'model' then
  ids = redis.call('SMEMBERS', KEYS[1])
  for i, id in ipairs(ids) do sets[i] = ARGV[2] .. 'replica:' .. id .. ':blocks' end
else
  sets = KEYS
end
local max_chunk = tonumber(ARGV[3])
local counts = {}
for i, set in ipairs(sets) do
  local n, pos, done, chunk = 0, 4, false, 16
  while pos <= #ARGV and not done do
    local last = math.min(pos + chunk - 1, #ARGV)
    chunk = math.min(chunk * 2, max_chunk)
    local flags = redis.call('SMISMEMBER', set, unpack(ARGV, pos, last))
    for _, f in ipairs(flags) do
      if f == 1 then n = n + 1 else done = true; break end
    end
    pos = last + 1
  end
  counts[i] = n
end
return {ids, counts}
"""

# KEYS: models. ARGV: key prefix. -> models with a config or a live replica; prunes the rest (and dead ids).
_LIST_MODELS = """
local out = {}
for _, m in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local base = ARGV[1] .. 'model:' .. m
  local keep = redis.call('EXISTS', base .. ':config') == 1
  local set = base .. ':replicas'
  for _, id in ipairs(redis.call('SMEMBERS', set)) do
    if redis.call('EXISTS', ARGV[1] .. 'replica:' .. id) == 1 then keep = true
    else redis.call('SREM', set, id) end
  end
  if keep then out[#out + 1] = m else redis.call('SREM', KEYS[1], m) end
end
return out
"""

# KEYS: tenant, tenant keys, api key. ARGV: tenant, sha256, key id. -> 0 ok; -1 no tenant; -2 other owner.
_ADD_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local owner = redis.call('GET', KEYS[3])
if owner and owner ~= ARGV[1] then return -2 end
redis.call('SET', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[2])
return 0
"""

# KEYS: tenant keys. ARGV: tenant, key id, key prefix. -> 1 removed, 0 unknown id.
_REMOVE_KEY = """
local h = redis.call('HGET', KEYS[1], ARGV[2])
if not h then return 0 end
local k = ARGV[3] .. 'apikey:' .. h
if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end
redis.call('HDEL', KEYS[1], ARGV[2])
return 1
"""

# KEYS: api key. ARGV: key prefix. -> tenant JSON or nil.
_TENANT_FOR_KEY = """
local name = redis.call('GET', KEYS[1])
if not name then return false end
return redis.call('GET', ARGV[1] .. 'tenant:' .. name)
"""

# KEYS: tenant, tenants. ARGV: record JSON, tenant, mode ('create' | 'update' | 'upsert').
# -> 1 created, 2 replaced, 0 refused (create: the name exists; update: it does not).
_PUT_TENANT = """
local exists = redis.call('EXISTS', KEYS[1]) == 1
if (ARGV[3] == 'create' and exists) or (ARGV[3] == 'update' and not exists) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[2])
if exists then return 2 end
return 1
"""

# KEYS: tenant, tenant keys, tenants, usage, concurrency leases. ARGV: tenant, key prefix.
# -> 1 if the tenant existed.
_DELETE_TENANT = """
for _, h in ipairs(redis.call('HVALS', KEYS[2])) do
  local k = ARGV[2] .. 'apikey:' .. h
  if redis.call('GET', k) == ARGV[1] then redis.call('DEL', k) end
end
local existed = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5])
redis.call('SREM', KEYS[3], ARGV[1])
return existed
"""

# KEYS: model replicas, models, config, activity, wake lock, tokenizers. ARGV: model, key prefix.
_PURGE_MODEL = """
local p = ARGV[2]
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local hb = p .. 'replica:' .. id
  redis.call('UNLINK', hb, hb .. ':blocks', hb .. ':resync')
  local name = string.match(id, '^(.*)#%d+$')
  if name and redis.call('GET', p .. 'name:' .. name) == id then redis.call('DEL', p .. 'name:' .. name) end
end
for _, rev in ipairs(redis.call('SMEMBERS', KEYS[6])) do
  redis.call('UNLINK', p .. 'model:' .. ARGV[1] .. ':tokenizer:' .. rev)
end
redis.call('UNLINK', KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('SREM', KEYS[2], ARGV[1])
return 1
"""

# The gateway's one round trip per request: admission (tenant limits) + routing facts (prefix match and
# the other gateways' in-flight load per candidate replica).
# KEYS: gateways zset, the tenant's rate-limit window of this minute, model activity, the previous minute's,
#       the tenant's concurrency leases (zset lease id -> expiry, unix ms).
# ARGV: 1 key prefix, 2 own gateway id, 3 now (s), 4 load ttl s, 5 now (ms), 6 requests/min (0 = none),
#       7 tokens/min, 8 max concurrent, 9 lease id to take ('' = none), 10 window ttl,
#       11 weight of the previous minute (the part of it still inside the sliding minute),
#       12 number of candidates, 13 max match chunk, 14 tokens to reserve, 15 lease TTL (ms),
#       16 number of released leases, then the released lease ids (this gateway's finished requests whose
#       leases are still in Redis), then candidate replica ids, then block hashes.
# -> {'ok', matched, inflight, pending} per candidate (other gateways' load only), or
#    {reason, used, this minute's count, previous minute's count} when refused ('concurrency' | 'requests' |
#    'tokens'); nothing is counted, reserved or leased for a refused request. Admitted: the request counted,
#    its tokens reserved in this minute's window and its lease taken, all in this one atomic call.
_ADMIT = """
local p = ARGV[1]
local nrel, nc, max_chunk = tonumber(ARGV[16]), tonumber(ARGV[12]), tonumber(ARGV[13])
local first_cand = 17 + nrel
local first_hash = first_cand + nc
local loads = {}
for _, g in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], tonumber(ARGV[3]) - tonumber(ARGV[4]), '+inf')) do
  if g ~= ARGV[2] then loads[#loads + 1] = p .. 'gateway:' .. g .. ':load' end
end
if nrel > 0 then redis.call('ZREM', KEYS[5], unpack(ARGV, 17, first_cand - 1)) end
local max_conc = tonumber(ARGV[8])
if max_conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[5])
  local n = redis.call('ZCARD', KEYS[5])
  if n >= max_conc then return {'concurrency', n, 0, 0} end
end
local used = redis.call('HMGET', KEYS[2], 'requests', 'tokens')
local before = redis.call('HMGET', KEYS[4], 'requests', 'tokens')
local reqs, toks = tonumber(used[1] or '0'), math.max(0, tonumber(used[2] or '0'))
local prev_reqs, prev_toks = tonumber(before[1] or '0'), math.max(0, tonumber(before[2] or '0'))
local w = tonumber(ARGV[11])
local est_reqs, est_toks = reqs + prev_reqs * w, toks + prev_toks * w
if tonumber(ARGV[6]) > 0 and est_reqs + 1 > tonumber(ARGV[6]) then
  return {'requests', math.floor(est_reqs), reqs, prev_reqs}
end
if tonumber(ARGV[7]) > 0 and est_toks >= tonumber(ARGV[7]) then
  return {'tokens', math.floor(est_toks), toks, prev_toks}
end
redis.call('HINCRBY', KEYS[2], 'requests', 1)
if tonumber(ARGV[14]) > 0 then redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[14]) end
redis.call('EXPIRE', KEYS[2], ARGV[10])
if ARGV[9] ~= '' then
  redis.call('ZADD', KEYS[5], tonumber(ARGV[5]) + tonumber(ARGV[15]), ARGV[9])
  redis.call('PEXPIRE', KEYS[5], ARGV[15])
end
redis.call('SET', KEYS[3], ARGV[3])
local matched, inflight, pending, fields = {}, {}, {}, {}
for i = 1, nc do
  local id = ARGV[first_cand + i - 1]
  local set = p .. 'replica:' .. id .. ':blocks'
  local n, pos, done, chunk = 0, first_hash, false, 16
  while pos <= #ARGV and not done do
    local last = math.min(pos + chunk - 1, #ARGV)
    chunk = math.min(chunk * 2, max_chunk)
    for _, f in ipairs(redis.call('SMISMEMBER', set, unpack(ARGV, pos, last))) do
      if f == 1 then n = n + 1 else done = true; break end
    end
    pos = last + 1
  end
  matched[i], inflight[i], pending[i] = n, 0, 0
  fields[2 * i - 1], fields[2 * i] = 'ri:' .. id, 'rp:' .. id
end
if nc > 0 then
  for _, k in ipairs(loads) do
    local v = redis.call('HMGET', k, unpack(fields))
    for i = 1, nc do
      inflight[i] = inflight[i] + tonumber(v[2 * i - 1] or '0')
      pending[i] = pending[i] + tonumber(v[2 * i] or '0')
    end
  end
end
return {'ok', matched, inflight, pending}
"""

# KEYS: lock. ARGV: holder. -> 1 released, 0 not held by holder.
_RELEASE_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Script:
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


HEARTBEAT, CLAIM, DEREGISTER, APPLY, REPLACE = map(
    Script, (_HEARTBEAT, _CLAIM, _DEREGISTER, _APPLY, _REPLACE)
)
LIVE, PREFIX_MATCH, ADD_KEY, REMOVE_KEY = map(Script, (_LIVE, _PREFIX_MATCH, _ADD_KEY, _REMOVE_KEY))
LIST_MODELS, ADMIT = Script(_LIST_MODELS), Script(_ADMIT)
TENANT_FOR_KEY, DELETE_TENANT, PURGE_MODEL, RELEASE_LOCK = map(
    Script, (_TENANT_FOR_KEY, _DELETE_TENANT, _PURGE_MODEL, _RELEASE_LOCK)
)
PUT_TENANT = Script(_PUT_TENANT)


# ---- round trips ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Eval:
    """One round trip: a Lua script (EVALSHA, falling back to EVAL once if Redis lacks it)."""

    script: Script
    keys: list[str]
    args: list[Any]


@dataclass(slots=True)
class Batch:
    """One round trip: commands sent as one pipeline (MULTI/EXEC when ``transaction``)."""

    commands: list[tuple[Any, ...]]
    transaction: bool = False


Round = Eval | Batch
Op = Generator[Round, Any, Any]  # yields round trips, receives each reply, returns the result


def _run_sync(client: redis.Redis, op: Op) -> Any:
    reply: Any = None
    try:
        while True:
            step = op.send(reply)
            if isinstance(step, Eval):
                try:
                    reply = client.evalsha(step.script.sha, len(step.keys), *step.keys, *step.args)
                except redis.exceptions.NoScriptError:
                    reply = client.eval(step.script.source, len(step.keys), *step.keys, *step.args)
            elif len(step.commands) == 1 and not step.transaction:
                reply = [client.execute_command(*step.commands[0])]
            else:
                pipe = client.pipeline(transaction=step.transaction)
                for cmd in step.commands:
                    pipe.execute_command(*cmd)
                reply = pipe.execute()
    except StopIteration as stop:
        return stop.value


async def _run_async(client: redis.asyncio.Redis, op: Op) -> Any:
    reply: Any = None
    try:
        while True:
            step = op.send(reply)
            if isinstance(step, Eval):
                try:
                    reply = await client.evalsha(step.script.sha, len(step.keys), *step.keys, *step.args)
                except redis.exceptions.NoScriptError:
                    reply = await client.eval(step.script.source, len(step.keys), *step.keys, *step.args)
            elif len(step.commands) == 1 and not step.transaction:
                reply = [await client.execute_command(*step.commands[0])]
            else:
                pipe = client.pipeline(transaction=step.transaction)
                for cmd in step.commands:
                    pipe.execute_command(*cmd)
                reply = await pipe.execute()
    except StopIteration as stop:
        return stop.value


# ---- operations (generators; see the module docstring) --------------------------------------------


@dataclass(frozen=True, slots=True)
class KVApplyResult:
    """Outcome of writing KV events or a snapshot. ``resync_needed`` tells the replica to send a full
    snapshot: its heartbeat was missing (Redis lost data, or the replica expired) or the index's
    sequence number does not continue where these events start (events were lost)."""

    ok: bool
    seq: int  # the index's kv_seq_applied after the call (0 when unknown)
    reason: Literal["applied", "duplicate", "no-heartbeat", "gap", "incomplete"]

    @property
    def resync_needed(self) -> bool:
        return not self.ok


_APPLY_REASONS = {1: "applied", 0: "duplicate", -1: "no-heartbeat", -2: "gap", -3: "incomplete"}


def op_publish_heartbeat(hb: Heartbeat, ttl: float) -> Op:
    ttl_ms = _ttl_ms(ttl)
    _, epoch = keys.parse_replica_id(hb.replica_id)
    args: list[Any] = [ttl_ms, hb.replica_id, hb.model, epoch]
    for k, v in hb.to_redis_fields().items():
        args += [k, v]
    rid = hb.replica_id
    status = yield Eval(
        HEARTBEAT,
        [keys.replica(rid), keys.replica_blocks(rid), keys.replica_name(hb.name), keys.model_replicas(hb.model),
         keys.models()],
        args,
    )  # fmt: skip
    if status == -1:
        raise SupersededError(f"a newer epoch of replica name {hb.name!r} holds the name; {rid} must stop")
    return bool(status)


def op_claim_name(name: str, replica_id: str, ttl: float) -> Op:
    rid_name, epoch = keys.parse_replica_id(replica_id)
    if rid_name != name:
        raise ValueError(f"replica id {replica_id!r} does not belong to name {name!r}")
    status, previous = yield Eval(
        CLAIM, [keys.replica_name(name)], [replica_id, epoch, _ttl_ms(ttl), keys.PREFIX]
    )
    previous = _text(previous)
    if status == -1:
        raise SupersededError(f"replica name {name!r} is held by newer epoch {previous}")
    return previous or None


def op_deregister(replica_id: str) -> Op:
    name, _ = keys.parse_replica_id(replica_id)
    rid = replica_id
    existed = yield Eval(
        DEREGISTER,
        [keys.replica(rid), keys.replica_blocks(rid), keys.replica_resync(rid), keys.replica_name(name)],
        [rid, keys.PREFIX],
    )
    return bool(existed)


def op_apply_kv_events(replica_id: str, events: Sequence[KVEvent], first_seq: int | None) -> Op:
    flat = encode_kv_events(events)
    if first_seq is not None and first_seq < 1:
        raise ValueError(f"sequence numbers start at 1, got first_seq={first_seq}")
    if not events:
        return KVApplyResult(True, 0, "duplicate")
    rid = replica_id
    status, seq = yield Eval(
        APPLY,
        [keys.replica(rid), keys.replica_blocks(rid)],
        [-1 if first_seq is None else first_seq, len(events), *flat],
    )
    return KVApplyResult(status >= 0, int(seq), _APPLY_REASONS[status])  # type: ignore[arg-type]


def op_stage_blocks(replica_id: str, hashes: Sequence[bytes], fresh: bool) -> Op:
    """Upload part of a resync to the staging set (``fresh`` starts a new one), one pipeline."""
    hashes = _check_hashes(hashes)
    staging = keys.replica_resync(replica_id)
    upload: list[tuple[Any, ...]] = [("UNLINK", staging)] if fresh else []
    for i in range(0, len(hashes), UPLOAD_CHUNK):
        upload.append(("SADD", staging, *hashes[i : i + UPLOAD_CHUNK]))
    upload.append(("PEXPIRE", staging, _ttl_ms(keys.RESYNC_STAGING_TTL_S)))
    yield Batch(upload)


def op_commit_staged(replica_id: str, num_hashes: int, seq: int | None) -> Op:
    """Swap the staging set onto the block index if it holds exactly ``num_hashes`` distinct hashes."""
    rid = replica_id
    status, value = yield Eval(
        REPLACE,
        [keys.replica(rid), keys.replica_blocks(rid), keys.replica_resync(rid)],
        ["" if seq is None else seq, num_hashes],
    )
    if status < 0:
        return KVApplyResult(False, int(value), _APPLY_REASONS[status])  # type: ignore[arg-type]
    return KVApplyResult(True, int(value), "applied")


def op_replace_blocks(replica_id: str, hashes: Iterable[bytes], seq: int | None) -> Op:
    unique = list(dict.fromkeys(_check_hashes(hashes)))
    yield from op_stage_blocks(replica_id, unique, fresh=True)
    return (yield from op_commit_staged(replica_id, len(unique), seq))


def op_get_heartbeat(replica_id: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.replica(replica_id))])
    return Heartbeat.from_redis_fields(fields) if fields else None


def op_live_replicas(model: str) -> Op:
    replies = yield Eval(LIVE, [keys.model_replicas(model)], [keys.PREFIX])
    out = []
    for flat in replies:
        fields = dict(zip(flat[::2], flat[1::2]))
        try:
            out.append(Heartbeat.from_redis_fields(fields))
        except msgspec.ValidationError as e:  # one bad writer must not hide the model's other replicas
            logger.warning("ignoring malformed heartbeat %r: %s", fields.get(b"replica_id"), e)
    out.sort(key=lambda hb: hb.replica_id)
    return out


def op_prefix_match(model: str, block_hashes: Sequence[bytes], replica_ids: Sequence[str] | None) -> Op:
    hashes = _check_hashes(block_hashes)
    if replica_ids is not None:
        replica_ids = list(replica_ids)
        if not replica_ids:
            return {}
        if not hashes:
            return dict.fromkeys(replica_ids, 0)
        ids, counts = yield Eval(
            PREFIX_MATCH,
            [keys.replica_blocks(r) for r in replica_ids],
            ["ids", keys.PREFIX, MATCH_CHUNK, *hashes],
        )
        return dict(zip(replica_ids, map(int, counts)))
    ids, counts = yield Eval(
        PREFIX_MATCH, [keys.model_replicas(model)], ["model", keys.PREFIX, MATCH_CHUNK, *hashes]
    )
    return {_text(r): int(n) for r, n in zip(ids, counts)}


def op_list_models() -> Op:
    members = yield Eval(LIST_MODELS, [keys.models()], [keys.PREFIX])
    return sorted(_text(m) for m in members)


TenantWrite = Literal["create", "update", "upsert"]


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


def op_get_tenant(name: str) -> Op:
    (data,) = yield Batch([("GET", keys.tenant(name))])
    return decode_tenant(data) if data is not None else None


def op_list_tenants() -> Op:
    (names,) = yield Batch([("SMEMBERS", keys.tenants())])
    names = sorted(_text(n) for n in names)
    if not names:
        return []
    (datas,) = yield Batch([("MGET", *(keys.tenant(n) for n in names))])
    return [decode_tenant(d) for d in datas if d is not None]


def op_delete_tenant(name: str) -> Op:
    existed = yield Eval(
        DELETE_TENANT,
        [keys.tenant(name), keys.tenant_keys(name), keys.tenants(), keys.usage(name), keys.inflight(name)],
        [name, keys.PREFIX],
    )
    return bool(existed)


def op_add_api_key(tenant_name: str, sha256_hex: str) -> Op:
    key_id = api_key_id(sha256_hex)
    status = yield Eval(
        ADD_KEY,
        [keys.tenant(tenant_name), keys.tenant_keys(tenant_name), keys.api_key(sha256_hex)],
        [tenant_name, sha256_hex, key_id],
    )
    if status == -1:
        raise RegistryError(f"unknown tenant {tenant_name!r}: put_tenant first")
    if status == -2:
        raise RegistryError("this API key already belongs to another tenant")
    return key_id


def op_remove_api_key(tenant_name: str, key_id: str) -> Op:
    removed = yield Eval(REMOVE_KEY, [keys.tenant_keys(tenant_name)], [tenant_name, key_id, keys.PREFIX])
    return bool(removed)


def op_list_api_keys(tenant_name: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.tenant_keys(tenant_name))])
    return {_text(k): _text(v) for k, v in fields.items()}


def op_tenant_for_key_hash(sha256_hex: str) -> Op:
    data = yield Eval(TENANT_FOR_KEY, [keys.api_key(sha256_hex)], [keys.PREFIX])
    return decode_tenant(data) if data else None


def op_put_model_config(config: ModelConfig) -> Op:
    yield Batch(
        [
            ("SET", keys.model_config(config.model), encode_json(config)),
            ("SADD", keys.models(), config.model),
        ],
        transaction=True,
    )


def op_get_model_config(model: str) -> Op:
    (data,) = yield Batch([("GET", keys.model_config(model))])
    return decode_model_config(data) if data is not None else None


def op_delete_model_config(model: str) -> Op:
    (n,) = yield Batch([("DEL", keys.model_config(model))])
    return bool(n)


def op_touch_activity(model: str, now: float | None) -> Op:
    yield Batch([("SET", keys.model_activity(model), repr(time.time() if now is None else float(now)))])


def op_last_activity(model: str) -> Op:
    (v,) = yield Batch([("GET", keys.model_activity(model))])
    return float(v) if v is not None else None


def op_purge_model(model: str) -> Op:
    yield Eval(
        PURGE_MODEL,
        [keys.model_replicas(model), keys.models(), keys.model_config(model), keys.model_activity(model),
         keys.model_wake_lock(model), keys.model_tokenizers(model)],
        [model, keys.PREFIX],
    )  # fmt: skip


def op_publish_tokenizer(model: str, files: Mapping[str, bytes]) -> Op:
    revision = tokenizer_revision(files)
    mapping: list[Any] = []
    for name, body in sorted(files.items()):
        mapping += [name, bytes(body)]
    yield Batch(
        [
            ("HSET", keys.model_tokenizer(model, revision), *mapping),
            ("SADD", keys.model_tokenizers(model), revision),
        ],
        transaction=True,
    )
    return revision


def op_fetch_tokenizer(model: str, revision: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.model_tokenizer(model, revision))])
    if not fields:
        return None
    files = {_text(k): bytes(v) for k, v in fields.items()}
    if tokenizer_revision(files) != revision:
        raise RegistryError(f"tokenizer {model}@{revision[:12]} in Redis does not match its revision")
    return files


def op_acquire_wake_lock(model: str, holder: str, ttl_ms: int) -> Op:
    (ok,) = yield Batch([("SET", keys.model_wake_lock(model), holder, "NX", "PX", int(ttl_ms))])
    return bool(ok)


def op_release_wake_lock(model: str, holder: str) -> Op:
    n = yield Eval(RELEASE_LOCK, [keys.model_wake_lock(model)], [holder])
    return bool(n)


def op_record_usage(tenant_name: str, requests: int, tokens: int, now: float | None) -> Op:
    minute = int((time.time() if now is None else now) // keys.RATELIMIT_WINDOW_S)
    key = keys.ratelimit(tenant_name, minute)
    req, tok, _ = yield Batch(
        [("HINCRBY", key, "requests", int(requests)), ("HINCRBY", key, "tokens", int(tokens)),
         ("EXPIRE", key, keys.RATELIMIT_TTL_S)],
        transaction=True,
    )  # fmt: skip
    return int(req), int(tok)


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

    The estimate (as in ``ADMIT``) is ``this minute + previous minute × (1 − elapsed fraction)``: the
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
        [keys.PREFIX, a.gateway_id, repr(now), keys.GATEWAY_LOAD_TTL_S, int(now * 1000), t.requests_per_minute or 0,
         t.tokens_per_minute or 0, t.max_concurrent or 0, a.lease, keys.RATELIMIT_TTL_S,
         repr(1.0 - into / keys.RATELIMIT_WINDOW_S), len(candidates), MATCH_CHUNK, max(0, int(a.reserve_tokens)),
         _ttl_ms(keys.LEASE_TTL_S), len(released), *released, *candidates, *_check_hashes(a.block_hashes)],
    )  # fmt: skip
    status = _text(reply[0])
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
) -> Op:
    """One pipeline: replace this gateway's load hash (absolute values; TTL refreshed), mark it alive,
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
            fields += [f"ri:{rid}", int(inflight), f"rp:{rid}", int(pending)]
    for name, n in sorted(tenant_inflight.items()):
        if n:
            fields += [f"t:{keys.check_name(name, 'tenant')}", int(n)]
    cmds: list[tuple[Any, ...]] = [("DEL", load_key)]
    if fields:
        cmds += [("HSET", load_key, *fields), ("PEXPIRE", load_key, _ttl_ms(keys.GATEWAY_LOAD_TTL_S))]
    cmds += [
        ("ZADD", keys.gateways(), repr(now), gateway_id),
        ("ZREMRANGEBYSCORE", keys.gateways(), "-inf", repr(now - 6 * keys.GATEWAY_LOAD_TTL_S)),
    ]
    for tenant, ids in sorted((released or {}).items()):
        if ids := sorted(ids):
            cmds.append(("ZREM", keys.inflight(tenant), *ids))
    expiry = int(now * 1000) + _ttl_ms(keys.LEASE_TTL_S)
    for tenant, ids in sorted((leases or {}).items()):
        if ids := sorted(ids):
            k = keys.inflight(tenant)
            cmds += [("ZADD", k, "XX", *(x for i in ids for x in (expiry, i))),
                     ("PEXPIRE", k, _ttl_ms(keys.LEASE_TTL_S))]  # fmt: skip
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
            name = _text(field_)
            model, sep, counter = name.rpartition("|")
            if sep:
                per_model.setdefault(model, dict.fromkeys(USAGE_COUNTERS, 0))[counter] = int(value)
            else:
                total[name] = int(value)
        window = {_text(k): max(0, int(v)) for k, v in replies[2 * i + 1].items()}
        out[n] = {"total": total, "models": per_model,
                  "this_minute": {"requests": window.get("requests", 0), "tokens": window.get("tokens", 0)}}  # fmt: skip
    return out


def _status_is(op: Op, wanted: int | None) -> Op:
    """The operation's integer status compared with ``wanted`` (None: no result)."""
    status = yield from op
    return None if wanted is None else status == wanted


def _ttl_ms(ttl: float) -> int:
    if not ttl > 0:
        raise ValueError(f"TTL must be positive, got {ttl}")
    return max(1, round(ttl * 1000))


# ---- the two front ends --------------------------------------------------------------------------


class _Registry:
    """Shared method bodies. In ``AsyncRegistry`` every method returns an awaitable of the same result."""

    def _run(self, op: Op) -> Any:
        raise NotImplementedError

    # replica side
    def publish_heartbeat(self, hb: Heartbeat, ttl: float = keys.HEARTBEAT_TTL_S) -> bool:
        """Write the heartbeat and refresh the replica's TTLs. Returns False if the heartbeat key did not
        exist before (first beat, or Redis lost it: the replica should resync its block index).
        Raises SupersededError if a newer boot epoch of the same name is registered."""
        return self._run(op_publish_heartbeat(hb, ttl))

    def claim_name(self, name: str, new_replica_id: str, ttl: float = keys.HEARTBEAT_TTL_S) -> str | None:
        """Make ``new_replica_id`` the current epoch of ``name``, deleting what the previous epoch owned
        (heartbeat, block index, set membership). Returns the previous id, if any.
        Raises SupersededError if the name is held by a newer epoch."""
        return self._run(op_claim_name(name, new_replica_id, ttl))

    def deregister_replica(self, replica_id: str) -> bool:
        """Remove the replica's heartbeat, blocks and name record now. Returns whether it was registered."""
        return self._run(op_deregister(replica_id))

    def apply_kv_events(
        self, replica_id: str, events: Sequence[KVEvent], first_seq: int | None = None
    ) -> KVApplyResult:
        """Apply ordered events atomically. ``first_seq`` numbers the first event (the rest follow);
        with it the index refuses events that do not continue its ``kv_seq_applied`` (-> resync) and
        ignores a batch it already applied. Without it events are appended unchecked."""
        return self._run(op_apply_kv_events(replica_id, events, first_seq))

    def replace_replica_blocks(
        self, replica_id: str, hashes: Iterable[bytes], seq: int | None = None
    ) -> KVApplyResult:
        """Full resync: the block index becomes exactly ``hashes`` (uploaded in chunks, swapped in
        atomically) and ``kv_seq_applied`` becomes ``seq``."""
        return self._run(op_replace_blocks(replica_id, hashes, seq))

    def stage_blocks(self, replica_id: str, hashes: Sequence[bytes], fresh: bool = False) -> None:
        """Upload part of a resync (for snapshots too large for one call; ``replace_replica_blocks``
        is stage + commit). ``fresh=True`` discards a previous partial upload."""
        return self._run(op_stage_blocks(replica_id, hashes, fresh))

    def commit_staged_blocks(self, replica_id: str, num_hashes: int, seq: int | None = None) -> KVApplyResult:
        """Make the staged upload the block index, if it holds exactly ``num_hashes`` distinct hashes
        (else ``incomplete``: staging expired or Redis lost it; start again)."""
        return self._run(op_commit_staged(replica_id, num_hashes, seq))

    def get_heartbeat(self, replica_id: str) -> Heartbeat | None:
        return self._run(op_get_heartbeat(replica_id))

    # gateway side
    def live_replicas(self, model: str) -> list[Heartbeat]:
        """Heartbeats of the model's replicas within their TTL (sorted by id); prunes expired ids."""
        return self._run(op_live_replicas(model))

    def prefix_match(
        self, model: str, block_hashes: Sequence[bytes], replica_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """replica id -> number of leading ``block_hashes`` it caches, in one round trip.
        ``replica_ids=None`` checks every registered replica of ``model``."""
        return self._run(op_prefix_match(model, block_hashes, replica_ids))

    def list_models(self) -> list[str]:
        """Models with a config or at least one live replica (sleeping included), sorted; a model
        whose replicas all died and that has no config is dropped (its next heartbeat re-adds it)."""
        return self._run(op_list_models())

    # tenants
    def create_tenant(self, record: TenantRecord) -> bool:
        """Create the tenant only if the name is free (atomically): False if it exists. The name must
        pass ``keys.check_tenant_name`` (ValueError)."""
        return self._run(_status_is(op_put_tenant(record, "create"), 1))

    def update_tenant(self, record: TenantRecord) -> bool:
        """Replace an existing tenant's record (atomically): False, and nothing written, if it is gone."""
        return self._run(_status_is(op_put_tenant(record, "update"), 2))

    def upsert_tenant(self, record: TenantRecord) -> bool:
        """Create or replace (the operator's sync: the Tenant resource is the source of truth). Returns
        whether it was created. The name must pass ``keys.check_tenant_name`` (ValueError)."""
        return self._run(_status_is(op_put_tenant(record, "upsert"), 1))

    def put_tenant(self, record: TenantRecord) -> None:
        """``upsert_tenant``, ignoring whether it created the tenant."""
        return self._run(_status_is(op_put_tenant(record, "upsert"), None))

    def get_tenant(self, name: str) -> TenantRecord | None:
        return self._run(op_get_tenant(name))

    def list_tenants(self) -> list[TenantRecord]:
        return self._run(op_list_tenants())

    def delete_tenant(self, name: str) -> bool:
        """Delete the tenant and every API key lookup it owns. Returns whether it existed."""
        return self._run(op_delete_tenant(name))

    def add_api_key(self, tenant_name: str, sha256_hex: str) -> str:
        """Register the SHA-256 of an API key for the tenant; returns its key id (stable per key).
        RegistryError if the tenant is unknown or the key belongs to another tenant."""
        return self._run(op_add_api_key(tenant_name, sha256_hex))

    def remove_api_key(self, tenant_name: str, key_id: str) -> bool:
        return self._run(op_remove_api_key(tenant_name, key_id))

    def list_api_keys(self, tenant_name: str) -> dict[str, str]:
        """key id -> SHA-256 hex of the tenant's API keys."""
        return self._run(op_list_api_keys(tenant_name))

    def tenant_for_key_hash(self, sha256_hex: str) -> TenantRecord | None:
        """The tenant owning the API key with this SHA-256 (one round trip), or None."""
        return self._run(op_tenant_for_key_hash(sha256_hex))

    # models
    def put_model_config(self, config: ModelConfig) -> None:
        return self._run(op_put_model_config(config))

    def get_model_config(self, model: str) -> ModelConfig | None:
        return self._run(op_get_model_config(model))

    def delete_model_config(self, model: str) -> bool:
        return self._run(op_delete_model_config(model))

    def touch_activity(self, model: str, now: float | None = None) -> None:
        return self._run(op_touch_activity(model, now))

    def last_activity(self, model: str) -> float | None:
        return self._run(op_last_activity(model))

    def purge_model(self, model: str) -> None:
        """Delete everything about the model: replicas (heartbeats, block indexes, names, in-flight
        counters), config, activity, wake lock and tokenizers. Replicas still running re-register."""
        return self._run(op_purge_model(model))

    def publish_tokenizer(self, model: str, files: Mapping[str, bytes]) -> str:
        """Store tokenizer files; returns their revision (SHA-256 of the contents, see tokenizer_revision)."""
        return self._run(op_publish_tokenizer(model, files))

    def fetch_tokenizer(self, model: str, revision: str) -> dict[str, bytes] | None:
        return self._run(op_fetch_tokenizer(model, revision))

    def acquire_wake_lock(self, model: str, holder: str, ttl_ms: int = keys.WAKE_LOCK_TTL_MS) -> bool:
        """Take the model's wake lock if free (SET NX PX); True if ``holder`` now holds it."""
        return self._run(op_acquire_wake_lock(model, holder, ttl_ms))

    def release_wake_lock(self, model: str, holder: str) -> bool:
        """Release the lock only if ``holder`` still holds it (it may have expired and been retaken)."""
        return self._run(op_release_wake_lock(model, holder))

    def admit(self, admission: Admission, now: float | None = None) -> AdmitResult:
        """Admission + routing facts for one request in one round trip (the gateway's hot path)."""
        return self._run(op_admit(admission, now))

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
    ) -> None:
        """Publish a gateway's in-flight load (replica -> (requests, queued prompt tokens); tenant ->
        requests), renew / remove its concurrency leases and settle finished requests (usage charged,
        reservations refunded), in one round trip (see ``op_report_gateway``)."""
        return self._run(
            op_report_gateway(
                gateway_id, replica_load, tenant_inflight, usage, now, leases, released, refunds
            )
        )

    def remove_gateway(self, gateway_id: str) -> None:
        return self._run(op_remove_gateway(gateway_id))

    def tenant_usage(self, names: Sequence[str], now: float | None = None) -> dict[str, dict[str, Any]]:
        return self._run(op_tenant_usage(names, now))

    def record_usage(
        self, tenant_name: str, requests: int, tokens: int, now: float | None = None
    ) -> tuple[int, int]:
        """Add to the tenant's current-minute counters; returns the minute's (requests, tokens) totals."""
        return self._run(op_record_usage(tenant_name, requests, tokens, now))


def _check_binary(client: Any) -> None:
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError("the registry needs a Redis client with decode_responses=False (hashes are binary)")


def reconnect_policy(sync: bool) -> dict[str, Any]:
    """Client options: retry a command (pipelines and transactions included) twice, quickly, when its
    connection turns out to be dead.

    After Redis restarts, every pooled connection is stale; redis-py's default policy does not retry a
    MULTI/EXEC on one, so the first transaction per connection would fail. Only ConnectionError is retried:
    a dead connection means the command never reached a live server (a crash in the middle of one is the
    rare exception, accepted). Timeouts are not retried: the command may have run (HINCRBY twice)."""
    retry_cls = redis.retry.Retry if sync else redis.asyncio.retry.Retry
    return {"retry": retry_cls(ExponentialBackoff(cap=0.25, base=0.01), 2),
            "retry_on_error": [redis.exceptions.ConnectionError]}  # fmt: skip


class Registry(_Registry):
    """Sync registry over ``redis.Redis`` (decode_responses must be False)."""

    def __init__(self, client: redis.Redis) -> None:
        _check_binary(client)
        self.client = client

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Registry:
        """A client with ``reconnect_policy`` unless the caller gives its own ``retry``."""
        return cls(redis.Redis.from_url(url, **{**reconnect_policy(sync=True), **kwargs}))

    def _run(self, op: Op) -> Any:
        return _run_sync(self.client, op)

    def close(self) -> None:
        self.client.close()


class AsyncRegistry(_Registry):
    """Async registry over ``redis.asyncio.Redis``: the same methods, each returning an awaitable."""

    def __init__(self, client: redis.asyncio.Redis, max_concurrent_ops: int | None = None) -> None:
        """``max_concurrent_ops``: operations beyond this many wait, first come first served, for one to
        finish (each operation holds one connection at a time). Without a limit redis-py's pool opens
        up to 100 connections and then *fails* the command with "Too many connections": a gateway with
        100+ requests in flight took that for Redis being down and admitted requests without their
        quotas until the next success. (redis-py's BlockingConnectionPool waits instead, but a freed
        connection goes to whichever caller asks next, not to the longest waiter: under load some
        requests waited seconds.)"""
        _check_binary(client)
        self.client = client
        self._slots = asyncio.Semaphore(max_concurrent_ops) if max_concurrent_ops else None

    @classmethod
    def from_url(cls, url: str, *, max_concurrent_ops: int | None = None, **kwargs: Any) -> AsyncRegistry:
        """A client with ``reconnect_policy`` unless the caller gives its own ``retry``; its pool allows
        twice ``max_concurrent_ops`` connections (room for direct use of ``client``)."""
        options = {**reconnect_policy(sync=False), **kwargs}
        if max_concurrent_ops:
            options.setdefault("max_connections", max(100, 2 * max_concurrent_ops))
        return cls(redis.asyncio.Redis.from_url(url, **options), max_concurrent_ops)

    def _run(self, op: Op) -> Awaitable[Any]:
        if self._slots is None:
            return _run_async(self.client, op)
        return self._run_limited(op)

    async def _run_limited(self, op: Op) -> Any:
        assert self._slots is not None
        async with self._slots:
            return await _run_async(self.client, op)

    async def aclose(self) -> None:
        await self.client.aclose()
