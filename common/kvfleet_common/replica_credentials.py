"""Per-model replica credentials, derived from the platform's replica key root: proof that a heartbeat in
Redis comes from an engine of its model, and the bearer token of that model's engine admin endpoints.

Threat model: whoever can write Redis can publish a heartbeat naming any model and any URL, and the gateway
sends tenants' requests, and its wake/sleep calls with an admin token, to heartbeats' URLs. Only the operator
and the gateways hold the root; the operator gives each model's engines only that model's key (and the admin
token derived from it), so a heartbeat verifies only when an engine of that model signed it, for that URL,
recently (replays expire with the heartbeat TTL). An engine can still vouch for other URLs of its own model,
never for another model's; its admin token opens only its own model's engines.

Pure functions, no I/O. Keys are bytes; what travels (Secrets, flags, Redis) is hex.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets

from kvfleet_common import redis_keys
from kvfleet_common.schemas import Heartbeat

ROOT_BYTES = 32
ROOT_ENV = "KVFLEET_REPLICA_KEY_ROOT"  # the gateway's and the operator's root (hex)
# Where a deployment takes the root from (the chart: "Secret S, key K, named by V"); set, it makes the root required.
ROOT_SOURCE_ENV = "KVFLEET_REPLICA_KEY_ROOT_SOURCE"
# How far the engine's clock may be from the verifier's: a heartbeat is fresh while
# -MAX_CLOCK_SKEW_S <= now - issued_at <= HEARTBEAT_TTL_S + MAX_CLOCK_SKEW_S.
MAX_CLOCK_SKEW_S = 10.0
_MODEL_KEY_LABEL = b"kvfleet/model-key\0"
_ADMIN_TOKEN_LABEL = b"kvfleet/engine-admin-token"
_HEARTBEAT_LABEL = "kvfleet/heartbeat/v1"


def new_root() -> str:
    """A fresh root, as the hex text flags and Secrets carry (``openssl rand -hex 32`` makes one too)."""
    return secrets.token_hex(ROOT_BYTES)


def parse_key(text: str, what: str = "replica key root") -> bytes:
    """Hex text (at least 32 bytes) -> the key; ValueError naming ``what`` otherwise. Never echoes the key."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"the {what} must be hex (e.g. from `openssl rand -hex 32`)") from None
    if len(key) < ROOT_BYTES:
        raise ValueError(f"the {what} must be at least {ROOT_BYTES} bytes ({2 * ROOT_BYTES} hex digits)")
    return key


def configured_root(given: str | None, source: str | None = None) -> bytes | None:
    """The root a gateway or operator was configured with; None when none was (local development, warned).

    ``given``: the ``--replica-key-root`` / ``KVFLEET_REPLICA_KEY_ROOT`` value, None when neither is set;
    ``source``: ``KVFLEET_REPLICA_KEY_ROOT_SOURCE``, where a deployment says the root comes from (the chart
    sets it: "Secret S, key K, named by existingSecret"); with a source the root is required.

    Invariant: a root that is set but empty, malformed or short, or required but missing, raises ValueError
    with one line naming the variable and, when known, the Secret key: a misconfigured Secret must stop the
    component at start, never silently turn the replica checks off."""
    what = f"replica key root ({ROOT_ENV} or --replica-key-root" + (f"; from {source})" if source else ")")
    how = f"64 hex digits, e.g. from `openssl rand -hex {ROOT_BYTES}`"
    if given is None:
        if not source:
            return None
        raise ValueError(f"the {what} is not set: that Secret key must exist and hold the root ({how})")
    if not given.strip():
        raise ValueError(f"the {what} is empty: it must hold the root ({how})")
    return parse_key(given, what)


def model_key(root: bytes, model: str) -> bytes:
    """The key of one model's engines (the served model name, as heartbeats carry it)."""
    redis_keys.check_name(model, "model")
    return hmac.new(root, _MODEL_KEY_LABEL + model.encode(), hashlib.sha256).digest()


def engine_admin_token(key: bytes) -> str:
    """The bearer token of the admin endpoints (/sleep, /wake_up) of the engines holding ``key``."""
    return hmac.new(key, _ADMIN_TOKEN_LABEL, hashlib.sha256).hexdigest()


def _signed_message(hb: Heartbeat) -> bytes:
    # JSON: unambiguous whatever the fields contain. issued_at in whole milliseconds: the float survives the
    # trip through Redis exactly, but an integer needs no such argument.
    issued_ms = round(hb.updated_at * 1000)
    return json.dumps([_HEARTBEAT_LABEL, hb.model, hb.replica_id, hb.base_url, hb.state, issued_ms],
                      separators=(",", ":")).encode()  # fmt: skip


def sign_heartbeat(key: bytes, hb: Heartbeat) -> str:
    """The signature (hex) over the heartbeat's model, replica id (name and boot epoch), URL, state and
    issued-at time (``updated_at``); the load numbers are not covered."""
    return hmac.new(key, _signed_message(hb), hashlib.sha256).hexdigest()


def heartbeat_fault(
    key: bytes, hb: Heartbeat, now: float, ttl: float = redis_keys.HEARTBEAT_TTL_S
) -> str | None:
    """Why ``hb`` does not verify with ``key`` at unix time ``now`` (None: it does)."""
    if not hb.signature:
        return "unsigned"
    if not hmac.compare_digest(hb.signature.encode(), sign_heartbeat(key, hb).encode()):
        return "bad signature"
    age = now - hb.updated_at
    if not -MAX_CLOCK_SKEW_S <= age <= ttl + MAX_CLOCK_SKEW_S:
        return f"issued {age:.0f} s ago (stale or replayed)"
    return None


def verify_heartbeat(key: bytes, hb: Heartbeat, now: float, ttl: float = redis_keys.HEARTBEAT_TTL_S) -> bool:
    return heartbeat_fault(key, hb, now, ttl) is None


class ReplicaKeyRing:
    """The root's derived keys, computed once per model (what the gateway and the operator hold)."""

    def __init__(self, root: bytes) -> None:
        self._root = root
        self._keys: dict[str, bytes] = {}

    def model_key(self, model: str) -> bytes:
        key = self._keys.get(model)
        if key is None:
            key = self._keys[model] = model_key(self._root, model)
        return key

    def admin_token(self, model: str) -> str:
        return engine_admin_token(self.model_key(model))

    def fault(self, hb: Heartbeat, now: float) -> str | None:
        """Why ``hb`` is not a verified replica of its model (None: it is)."""
        return heartbeat_fault(self.model_key(hb.model), hb, now)
