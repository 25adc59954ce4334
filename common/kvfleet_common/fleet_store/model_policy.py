"""Per-model records: the operator's policy (``schemas.ModelPolicy``), the last request's time (idle
sleep), and purging everything about a model when its resource is deleted."""

from __future__ import annotations

import time

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Eval, Op, Script
from kvfleet_common.schemas import ModelPolicy, decode_model_policy, encode_json

PURGE_MODEL = Script.load("purge_model")


def op_put_model_policy(policy: ModelPolicy) -> Op:
    yield Batch(
        [
            ("SET", keys.model_policy(policy.model), encode_json(policy)),
            ("SADD", keys.models(), policy.model),
        ],
        transaction=True,
    )


def op_get_model_policy(model: str) -> Op:
    (data,) = yield Batch([("GET", keys.model_policy(model))])
    return decode_model_policy(data) if data is not None else None


def op_delete_model_policy(model: str) -> Op:
    (n,) = yield Batch([("DEL", keys.model_policy(model))])
    return bool(n)


def op_touch_activity(model: str, now: float | None) -> Op:
    yield Batch([("SET", keys.model_activity(model), repr(time.time() if now is None else float(now)))])


def op_last_activity(model: str) -> Op:
    (v,) = yield Batch([("GET", keys.model_activity(model))])
    return float(v) if v is not None else None


def op_purge_model(model: str) -> Op:
    """Delete the model's replicas (heartbeats, block indexes, staging sets, name records), policy,
    activity, wake lock and tokenizers, and drop it from ``kvf:models``."""
    yield Eval(
        PURGE_MODEL,
        [keys.model_replicas(model), keys.models(), keys.model_policy(model), keys.model_activity(model),
         keys.model_wake_lock(model), keys.model_tokenizers(model)],
        [model, *keys.replica_template().args(), *keys.replica_blocks_template().args(),
         *keys.replica_resync_template().args(), *keys.replica_name_template().args(),
         *keys.model_tokenizer_template(model).args()],
    )  # fmt: skip
