"""Replica presence: heartbeats, name claims across boot epochs, deregistration, live replicas, models.

A replica's heartbeat hash, its block set and its name record expire together (one TTL, refreshed by
every heartbeat), so everything a replica writes vanishes if it dies. A name belongs to its newest boot
epoch: an older epoch's claims and heartbeats are refused (``SupersededError``).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Eval, Op, Script, SupersededError, as_text, ttl_ms
from kvfleet_common.schemas import Heartbeat

logger = logging.getLogger(__name__)

PUBLISH_HEARTBEAT = Script.load("publish_heartbeat")
CLAIM_NAME = Script.load("claim_name")
DEREGISTER_REPLICA = Script.load("deregister_replica")
LIVE_REPLICAS = Script.load("live_replicas")
LIST_MODELS = Script.load("list_models")


def op_publish_heartbeat(hb: Heartbeat, ttl: float) -> Op:
    _, epoch = keys.parse_replica_id(hb.replica_id)
    args: list[Any] = [ttl_ms(ttl), hb.replica_id, hb.model, epoch]
    for k, v in hb.to_redis_fields().items():
        args += [k, v]
    rid = hb.replica_id
    status = yield Eval(
        PUBLISH_HEARTBEAT,
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
        CLAIM_NAME,
        [keys.replica_name(name)],
        [replica_id, epoch, ttl_ms(ttl), *keys.replica_template().args(), *keys.replica_blocks_template().args(),
         *keys.replica_resync_template().args(), *keys.model_replicas_template().args()],
    )  # fmt: skip
    previous = as_text(previous)
    if status == -1:
        raise SupersededError(f"replica name {name!r} is held by newer epoch {previous}")
    return previous or None


def op_deregister(replica_id: str) -> Op:
    name, _ = keys.parse_replica_id(replica_id)
    rid = replica_id
    existed = yield Eval(
        DEREGISTER_REPLICA,
        [keys.replica(rid), keys.replica_blocks(rid), keys.replica_resync(rid), keys.replica_name(name)],
        [rid, *keys.model_replicas_template().args()],
    )
    return bool(existed)


def op_get_heartbeat(replica_id: str) -> Op:
    (fields,) = yield Batch([("HGETALL", keys.replica(replica_id))])
    return Heartbeat.from_redis_fields(fields) if fields else None


def op_live_replicas(model: str) -> Op:
    replies = yield Eval(LIVE_REPLICAS, [keys.model_replicas(model)], keys.replica_template().args())
    out = []
    for flat in replies:
        fields = dict(zip(flat[::2], flat[1::2]))
        try:
            out.append(Heartbeat.from_redis_fields(fields))
        except msgspec.ValidationError as e:  # one bad writer must not hide the model's other replicas
            logger.warning("ignoring malformed heartbeat %r: %s", fields.get(b"replica_id"), e)
    out.sort(key=lambda hb: hb.replica_id)
    return out


def op_list_models() -> Op:
    members = yield Eval(
        LIST_MODELS,
        [keys.models()],
        [*keys.model_policy_template().args(), *keys.model_replicas_template().args(),
         *keys.replica_template().args()],
    )  # fmt: skip
    return sorted(as_text(m) for m in members)
