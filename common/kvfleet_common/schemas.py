"""Records kvfleet keeps in Redis (see ``redis_keys``), as msgspec Structs.

- ``Heartbeat``: what a replica publishes every ~1 s (a Redis hash, one field per struct field).
- ``TenantRecord`` / ``ModelPolicy``: JSON documents written by the operator.
- ``ReplicaStats``: the live numbers the engine hands its presence publisher.

Block hashes are ``bytes`` (16) in Python, raw bytes inside Redis sets and hex in JSON.
Decoding validates: a malformed record raises ``msgspec.ValidationError``, never half-loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from kvfleet_common import redis_keys

ReplicaState = Literal["starting", "awake", "sleeping", "draining"]
REPLICA_STATES: tuple[str, ...] = ("starting", "awake", "sleeping", "draining")
RoutingPolicy = Literal["prefix-aware", "least-load", "round-robin"]
ROUTING_POLICIES: tuple[str, ...] = ("prefix-aware", "least-load", "round-robin")

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


@dataclass(slots=True)
class ReplicaStats:
    """Load numbers the engine core reports to its ``PresencePublisher`` on every heartbeat."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of usable KV blocks held by requests, 0..1
    num_kv_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    """A replica's presence record, stored as the hash ``kvf:replica:<replica_id>``.

    ``kv_seq_applied`` is not written by the heartbeat itself: the KV-event writer sets it atomically
    with the block set, to the sequence number of the last event the index reflects.
    ``kv_seq_emitted`` is the engine's latest event number when the heartbeat was sent, so
    ``kv_seq_emitted - kv_seq_applied`` is how far the index lags behind the engine.

    ``signature``: the engine's proof that it belongs to ``model`` (``kvfleet_common.replica_credentials``,
    over model, replica id, URL, state and ``updated_at`` as the issued-at time); "" = unsigned (an engine
    without a replica key, or a record written before signing existed).
    """

    replica_id: str  # "<name>#<boot epoch ms>"
    name: str
    model: str
    base_url: str
    state: ReplicaState
    running: NonNegInt = 0
    waiting: NonNegInt = 0
    kv_usage: Fraction = 0.0
    num_kv_blocks: NonNegInt = 0
    prefill_tokens_per_s: NonNegFloat = 0.0
    decode_tokens_per_s: NonNegFloat = 0.0
    block_size: PosInt
    max_model_len: PosInt
    tokenizer_revision: str = ""  # "" = none published
    started_at: float  # unix seconds
    updated_at: float  # unix seconds
    version: str = ""  # kvfleet version of the engine
    kv_seq_emitted: NonNegInt = 0
    kv_seq_applied: NonNegInt = 0
    signature: str = ""

    def __post_init__(self) -> None:
        name, _ = redis_keys.parse_replica_id(self.replica_id)
        if name != self.name:
            raise ValueError(f"replica id {self.replica_id!r} does not belong to name {self.name!r}")
        redis_keys.check_name(self.model, "model")

    def to_redis_fields(self) -> dict[str, str]:
        """Hash fields the heartbeat writes (everything except ``kv_seq_applied``)."""
        out = {}
        for field in self.__struct_fields__:
            if field == "kv_seq_applied":
                continue
            value = getattr(self, field)
            out[field] = repr(value) if isinstance(value, float) else str(value)
        return out

    @classmethod
    def from_redis_fields(cls, fields: dict[bytes, bytes] | dict[str, str]) -> Heartbeat:
        """Decode an HGETALL reply; ValidationError if a field is missing or malformed."""
        text = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
        known = {k: v for k, v in text.items() if k in cls.__struct_fields__}
        try:
            return msgspec.convert(known, cls, strict=False)
        except ValueError as e:  # __post_init__ checks surface as ValueError; keep one error type
            if isinstance(e, msgspec.ValidationError):
                raise
            raise msgspec.ValidationError(str(e)) from e


class TenantRecord(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A tenant: what it may call and how much. ``None`` limits mean unlimited.

    ``models`` are shell globs (``fnmatch``) over model names; ``cache_salt`` seeds the tenant's block
    hashes (``hashing.root_hash``) so tenants never share KV cache unless they share a salt ("" =
    the shared cache). Higher ``priority`` is served first when the platform is saturated.
    """

    name: str
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    requests_per_minute: PosInt | None = None
    tokens_per_minute: PosInt | None = None
    max_concurrent: PosInt | None = None
    priority: int = 0
    cache_salt: str = ""

    def __post_init__(self) -> None:
        redis_keys.check_name(self.name, "tenant")
        for glob in self.models:
            if not glob or any(c.isspace() for c in glob):
                raise ValueError(f"invalid model glob {glob!r} for tenant {self.name!r}")

    def allows_model(self, model: str) -> bool:
        from fnmatch import fnmatchcase

        return any(fnmatchcase(model, glob) for glob in self.models)


class ModelPolicy(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Per-model routing and sleep policy the operator writes from the InferenceModel spec (the key
    ``kvf:model:<model>:config``). Not the engine's ``kvfleet_engine.config.ModelConfig`` (a checkpoint's
    architecture).

    ``sleep_idle_seconds=None`` never sleeps the model for idleness; ``allowed_tenants=None`` lets
    every tenant whose own ``models`` globs match call it. ``scale_from_zero``: the model is autoscaled and
    may have no replica at all; a gateway then holds its requests (counted in its load hash, which the
    operator's autoscaler reads) until a replica is awake, instead of answering 503 ``no_replica``.

    Encoded without default values (``omit_defaults``): a policy that uses no newer field decodes on a gateway
    from before that field (which forbids unknown fields), so a rolling upgrade may update the operator first.
    """

    model: str
    routing_policy: RoutingPolicy = "prefix-aware"
    sleep_idle_seconds: PosInt | None = None
    sleep_level: Literal[1, 2] = 1
    allowed_tenants: list[str] | None = None
    scale_from_zero: bool = False

    def __post_init__(self) -> None:
        redis_keys.check_name(self.model, "model")
        for t in self.allowed_tenants or ():
            redis_keys.check_name(t, "tenant")

    def allows_tenant(self, tenant_name: str) -> bool:
        return self.allowed_tenants is None or tenant_name in self.allowed_tenants


def encode_json(record: TenantRecord | ModelPolicy) -> bytes:
    return msgspec.json.encode(record)


def decode_tenant(data: bytes) -> TenantRecord:
    return _decode_json(data, TenantRecord)


def decode_model_policy(data: bytes) -> ModelPolicy:
    return _decode_json(data, ModelPolicy)


def _decode_json(data: bytes, typ):
    try:
        return msgspec.json.decode(data, type=typ)
    except ValueError as e:
        if isinstance(e, msgspec.ValidationError | msgspec.DecodeError):
            raise
        raise msgspec.ValidationError(str(e)) from e
