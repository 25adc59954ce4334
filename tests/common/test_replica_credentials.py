"""The replica credentials contract: model keys, derived admin tokens, signed heartbeats."""

from __future__ import annotations

import msgspec
import pytest

from kvfleet_common import redis_keys
from kvfleet_common.replica_credentials import (
    MAX_CLOCK_SKEW_S,
    ReplicaKeyRing,
    configured_root,
    engine_admin_token,
    heartbeat_fault,
    model_key,
    new_root,
    parse_key,
    sign_heartbeat,
    verify_heartbeat,
)
from kvfleet_common.schemas import Heartbeat

ROOT = bytes.fromhex("11" * 32)
NOW = 1_700_000_000.0


def heartbeat(**changes) -> Heartbeat:
    base = dict(replica_id="llama-0#1700", name="llama-0", model="llama", base_url="http://10.0.0.5:8000",
                state="awake", block_size=16, max_model_len=2048, started_at=NOW - 60, updated_at=NOW)  # fmt: skip
    return Heartbeat(**(base | changes))


def signed(key: bytes, **changes) -> Heartbeat:
    hb = heartbeat(**changes)
    return msgspec.structs.replace(hb, signature=sign_heartbeat(key, hb))


def test_a_signed_heartbeat_verifies_and_survives_the_trip_through_redis_fields():
    key = model_key(ROOT, "llama")
    hb = signed(key, updated_at=NOW + 0.123456789)
    assert verify_heartbeat(key, hb, NOW)
    back = Heartbeat.from_redis_fields(hb.to_redis_fields())
    assert back.signature == hb.signature and verify_heartbeat(key, back, NOW)


@pytest.mark.parametrize(
    "change",
    [
        {"base_url": "http://10.0.0.66:8000"},  # redirected to another endpoint
        {"model": "other"},  # presented as a replica of another model
        {"replica_id": "llama-1#1700", "name": "llama-1"},
        {"replica_id": "llama-0#1701"},  # another boot epoch
        {"state": "sleeping"},
        {"updated_at": NOW + 1},  # a re-dated copy
    ],
)
def test_changing_a_signed_field_breaks_the_signature(change):
    key = model_key(ROOT, "llama")
    hb = msgspec.structs.replace(signed(key), **change)
    assert heartbeat_fault(model_key(ROOT, hb.model), hb, NOW) == "bad signature"


def test_load_numbers_are_not_signed():
    key = model_key(ROOT, "llama")
    assert verify_heartbeat(key, msgspec.structs.replace(signed(key), running=7, kv_usage=0.5), NOW)


def test_unsigned_wrong_key_and_other_models_key_fail():
    key = model_key(ROOT, "llama")
    assert heartbeat_fault(key, heartbeat(), NOW) == "unsigned"
    assert heartbeat_fault(key, signed(model_key(ROOT, "other")), NOW) == "bad signature"
    assert heartbeat_fault(key, signed(model_key(bytes(32), "llama")), NOW) == "bad signature"
    assert heartbeat_fault(key, msgspec.structs.replace(signed(key), signature="zz"), NOW) == "bad signature"


def test_a_captured_heartbeat_expires_with_the_ttl():
    key = model_key(ROOT, "llama")
    hb = signed(key)
    limit = redis_keys.HEARTBEAT_TTL_S + MAX_CLOCK_SKEW_S
    assert verify_heartbeat(key, hb, NOW + limit - 0.01)
    assert "stale or replayed" in heartbeat_fault(key, hb, NOW + limit + 0.01)
    assert verify_heartbeat(key, hb, NOW - MAX_CLOCK_SKEW_S + 0.01)  # the engine's clock a little ahead
    assert heartbeat_fault(key, hb, NOW - MAX_CLOCK_SKEW_S - 1) is not None  # issued in the future


def test_model_keys_and_admin_tokens_differ_per_model_and_from_the_platform_token():
    keys = {m: model_key(ROOT, m) for m in ("llama", "qwen", "llama2")}
    assert len(set(keys.values())) == 3 and all(len(k) == 32 for k in keys.values())
    tokens = {engine_admin_token(k) for k in keys.values()}
    assert len(tokens) == 3
    assert model_key(ROOT, "llama") == keys["llama"]  # deterministic: every gateway derives the same
    assert model_key(bytes.fromhex("22" * 32), "llama") != keys["llama"]
    platform_token = ROOT.hex()
    assert platform_token not in tokens and ROOT.hex() not in {k.hex() for k in keys.values()}
    with pytest.raises(ValueError):
        model_key(ROOT, "bad:name")


def test_key_ring_matches_the_functions():
    ring = ReplicaKeyRing(ROOT)
    assert ring.model_key("llama") == model_key(ROOT, "llama")
    assert ring.admin_token("llama") == engine_admin_token(model_key(ROOT, "llama"))
    assert ring.fault(signed(model_key(ROOT, "llama")), NOW) is None
    assert ring.fault(signed(model_key(ROOT, "qwen")), NOW) == "bad signature"


def test_roots_parse_as_hex_of_at_least_32_bytes_and_errors_never_echo_them():
    root = new_root()
    assert parse_key(root) == bytes.fromhex(root) and len(parse_key(root)) == 32
    assert parse_key(f" {root}\n") == bytes.fromhex(root)  # a Secret file's trailing newline
    for bad in ("zz" * 32, "ab" * 31, ""):
        with pytest.raises(ValueError) as e:
            parse_key(bad)
        assert bad not in str(e.value) or not bad


def test_a_configured_root_is_valid_or_refused_and_required_where_the_deployment_says_so():
    """Only an unset root with no source means "none" (local development); everything else that is not a
    valid root stops the component, naming the variable and the Secret key, never echoing the value."""
    root = "ab" * 32
    assert configured_root(None) is None
    assert configured_root(root) == configured_root(f" {root}\n", "Secret s, key k") == bytes.fromhex(root)
    source = "Secret platform, key replica-key-root, named by existingSecret"
    for given, complaint in [
        (None, "is not set: that Secret key must exist"),
        ("", "is empty"),
        ("  ", "is empty"),
        ("not-hex", "must be hex"),
        ("abcd1234", "must be at least 32 bytes"),
    ]:
        with pytest.raises(ValueError) as e:
            configured_root(given, source)
        message = str(e.value)
        assert complaint in message and source in message and "KVFLEET_REPLICA_KEY_ROOT" in message
        assert given is None or not given.strip() or given not in message
    with pytest.raises(ValueError, match="is empty"):
        configured_root("")  # no source: an empty variable is a mistake too, not "no root"
