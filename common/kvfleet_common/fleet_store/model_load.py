"""One model's demand as the gateways see it: requests in flight to its replicas, requests held for it (no
awake replica yet) and prompt tokens queued at its replicas, summed over the live gateways.

The operator's autoscaler reads it every tick; it is the only demand signal of a model scaled to zero (no
engine runs to report any). The counts come from the gateways' own load hashes
(``redis_keys.gateway_load``: ``mi:<model>``, ``mh:<model>``, ``rp:<replica>``), which each gateway replaces
with absolute values every ~50 ms while anything changes. A gateway counts while its last report is newer
than ``GATEWAY_LOAD_TTL_S`` (as in admission): one that died leaves no demand behind once that time passes,
even if its hash has not expired yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Op, as_text


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """A model's demand summed over the live gateways (``gateways``: how many were live, idle ones too)."""

    in_flight: int = 0  # requests the gateways are proxying to the model's replicas
    held: int = 0  # requests the gateways hold until a replica of the model is awake
    queued_prompt_tokens: int = 0  # prompt tokens routed to the model's replicas, not prefilled yet
    gateways: int = 0


def _count(value: Any) -> int:
    return max(0, int(value)) if value is not None else 0


def op_model_load(model: str, now: float | None) -> Op:
    """Two round trips: the live gateways and the model's replica ids, then one ``HMGET`` per live gateway
    of its ``mi:``/``mh:`` fields for the model and its ``rp:`` fields for the model's replicas (fields of
    other models are never read)."""
    keys.check_name(model, "model")
    now = time.time() if now is None else float(now)
    live, replica_ids = yield Batch(
        [
            ("ZRANGEBYSCORE", keys.gateways(), repr(now - keys.GATEWAY_LOAD_TTL_S), "+inf"),
            ("SMEMBERS", keys.model_replicas(model)),
        ]
    )
    gateways = sorted(as_text(g) for g in live)
    if not gateways:
        return ModelLoad()
    fields = [keys.LOAD_FIELD_MODEL_REQUESTS + model, keys.LOAD_FIELD_MODEL_HELD + model]
    fields += sorted(keys.LOAD_FIELD_REPLICA_PROMPT_TOKENS + as_text(r) for r in replica_ids)
    replies = yield Batch([("HMGET", keys.gateway_load(g), *fields) for g in gateways])
    in_flight = held = queued = 0
    for values in replies:
        in_flight += _count(values[0])
        held += _count(values[1])
        queued += sum(_count(v) for v in values[2:])
    return ModelLoad(in_flight, held, queued, len(gateways))
