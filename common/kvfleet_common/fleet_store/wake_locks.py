"""One wake in progress per model: a lock with a TTL, released only by its holder."""

from __future__ import annotations

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Eval, Op, Script

RELEASE_WAKE_LOCK = Script.load("release_wake_lock")


def op_acquire_wake_lock(model: str, holder: str, ttl_ms: int) -> Op:
    (ok,) = yield Batch([("SET", keys.model_wake_lock(model), holder, "NX", "PX", int(ttl_ms))])
    return bool(ok)


def op_release_wake_lock(model: str, holder: str) -> Op:
    n = yield Eval(RELEASE_WAKE_LOCK, [keys.model_wake_lock(model)], [holder])
    return bool(n)
