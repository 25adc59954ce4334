"""The Redis contract's pure parts: key names, the key table, schemas and helpers (no Redis needed)."""

from pathlib import Path

import msgspec
import pytest

from kvfleet_common import redis_keys as keys
from kvfleet_common.registry import encode_kv_events, leading_matches, tokenizer_revision
from kvfleet_common.schemas import Heartbeat, ModelConfig, TenantRecord, decode_model_config, decode_tenant

SHA = "ab" * 32
EXAMPLE_KEYS = {
    "kvf:replica:<replica_id>": keys.replica("pod-0#1700000000000"),
    "kvf:replica:<replica_id>:blocks": keys.replica_blocks("pod-0#1"),
    "kvf:replica:<replica_id>:resync": keys.replica_resync("pod-0#1"),
    "kvf:name:<replica_name>": keys.replica_name("pod-0"),
    "kvf:models": keys.models(),
    "kvf:model:<model>:replicas": keys.model_replicas("org/Model-1.5B"),
    "kvf:model:<model>:config": keys.model_config("m"),
    "kvf:model:<model>:activity": keys.model_activity("m"),
    "kvf:model:<model>:wake_lock": keys.model_wake_lock("m"),
    "kvf:model:<model>:tokenizers": keys.model_tokenizers("m"),
    "kvf:model:<model>:tokenizer:<rev>": keys.model_tokenizer("m", SHA),
    "kvf:tenants": keys.tenants(),
    "kvf:tenant:<tenant>": keys.tenant("acme"),
    "kvf:tenant:<tenant>:keys": keys.tenant_keys("acme"),
    "kvf:apikey:<sha256_hex>": keys.api_key(SHA),
    "kvf:ratelimit:<tenant>:<minute>": keys.ratelimit("acme", 28_333_333),
    "kvf:usage:<tenant>": keys.usage("acme"),
    "kvf:inflight:<tenant>": keys.inflight("acme"),
    "kvf:gateways": keys.gateways(),
    "kvf:gateway:<gateway_id>:load": keys.gateway_load("gw-host-1234"),
}


def test_every_key_function_maps_to_exactly_its_spec():
    assert set(EXAMPLE_KEYS) == {s.pattern for s in keys.KEY_SPECS}
    for pattern, key in EXAMPLE_KEYS.items():
        assert key.startswith("kvf:")
        matching = [s.pattern for s in keys.KEY_SPECS if s.regex().fullmatch(key)]
        assert matching == [pattern], key
        assert keys.spec_for(key.encode()).pattern == pattern


def test_unknown_keys_have_no_spec():
    for key in ["kvf:replica:pod-0", "kvf:whatever", "other:models", "kvf:model:a:b:config", b"kvf:\xff"]:
        assert keys.spec_for(key) is None


@pytest.mark.parametrize("bad", ["", "a:b", "a#1", "-lead", "has space", "x" * 254, "ü", None])
def test_names_that_would_make_keys_ambiguous_are_rejected(bad):
    with pytest.raises(ValueError, match="invalid"):
        keys.check_name(bad)
    with pytest.raises(ValueError):
        keys.model_config(bad)


def test_replica_ids_round_trip_and_reject_garbage():
    rid = keys.make_replica_id("org/pod-0", 1_700_000_000_123)
    assert rid == "org/pod-0#1700000000123"
    assert keys.parse_replica_id(rid) == ("org/pod-0", 1_700_000_000_123)
    for bad in ["pod-0", "pod-0#", "pod-0#x", "#1", "a#1#2"]:
        with pytest.raises(ValueError, match="replica id"):
            keys.parse_replica_id(bad)
    with pytest.raises(ValueError):
        keys.make_replica_id("pod", -1)
    with pytest.raises(ValueError, match="SHA-256"):
        keys.api_key("AB" * 32)


def test_docs_embed_the_key_table():
    doc = (Path(__file__).parents[2] / "docs" / "REDIS.md").read_text()
    assert keys.markdown_table() in doc


def _heartbeat(**kw) -> Heartbeat:
    base = dict(
        replica_id="pod-0#5", name="pod-0", model="org/m", base_url="http://10.0.0.1:8000", state="awake",
        running=3, waiting=1, kv_usage=0.25, num_kv_blocks=1000, prefill_tokens_per_s=1234.5,
        decode_tokens_per_s=0.1 + 0.2, block_size=16, max_model_len=4096, started_at=1.5, updated_at=1e9 + 0.125,
    )  # fmt: skip
    base.update(kw)
    return Heartbeat(**base)


def test_heartbeat_round_trips_through_hash_fields_exactly():
    hb = _heartbeat(kv_seq_emitted=7)
    fields = hb.to_redis_fields()
    assert "kv_seq_applied" not in fields  # owned by the KV-event writer
    raw = {k.encode(): v.encode() for k, v in fields.items()} | {b"kv_seq_applied": b"6", b"future": b"x"}
    back = Heartbeat.from_redis_fields(raw)
    assert back == msgspec.structs.replace(hb, kv_seq_applied=6)
    assert back.decode_tokens_per_s == 0.1 + 0.2  # floats are written losslessly


@pytest.mark.parametrize(
    "change",
    [{"state": "asleep"}, {"kv_usage": "1.5"}, {"running": "-1"}, {"block_size": "0"}, {"name": "pod-1"}],
)
def test_malformed_heartbeats_are_rejected(change):
    fields = _heartbeat().to_redis_fields() | change
    with pytest.raises(msgspec.ValidationError):
        Heartbeat.from_redis_fields(fields)
    fields = _heartbeat().to_redis_fields()
    del fields["model"]
    with pytest.raises(msgspec.ValidationError, match="model"):
        Heartbeat.from_redis_fields(fields)


def test_tenant_and_model_config_json():
    t = TenantRecord(name="acme", models=["llama-*", "org/*"], requests_per_minute=60, cache_salt="s1")
    assert decode_tenant(msgspec.json.encode(t)) == t
    assert t.allows_model("llama-3") and t.allows_model("org/x") and not t.allows_model("qwen")
    assert TenantRecord(name="free").requests_per_minute is None  # None = unlimited
    for bad in [b'{"name": "a:b"}', b'{"name": "a", "requests_per_minute": 0}', b'{"name": "a", "extra": 1}']:
        with pytest.raises(msgspec.ValidationError):
            decode_tenant(bad)
    c = ModelConfig(
        model="m",
        routing_policy="least-load",
        sleep_idle_seconds=300,
        sleep_level=2,
        allowed_tenants=["acme"],
    )
    assert decode_model_config(msgspec.json.encode(c)) == c
    assert c.allows_tenant("acme") and not c.allows_tenant("other")
    with pytest.raises(msgspec.ValidationError):
        decode_model_config(b'{"model": "m", "routing_policy": "random"}')


def test_tokenizer_revision_names_the_contents():
    files = {"tokenizer.json": b"{...}", "tokenizer_config.json": b"{}"}
    rev = tokenizer_revision(files)
    assert len(rev) == 64
    assert tokenizer_revision(dict(reversed(files.items()))) == rev  # order-free
    assert tokenizer_revision({"ab": b"c"}) != tokenizer_revision({"a": b"bc"})  # boundaries count
    assert tokenizer_revision(files | {"tokenizer.json": b"{..}"}) != rev
    with pytest.raises(ValueError):
        tokenizer_revision({})
    with pytest.raises(ValueError):
        tokenizer_revision({"../x": b""})


def test_event_encoding_and_leading_matches():
    h = bytes(range(16))
    assert encode_kv_events([("stored", h), ("removed", h), ("cleared", None)]) == [
        b"s",
        h,
        b"r",
        h,
        b"c",
        b"",
    ]
    for bad in [[("stored", b"short")], [("evicted", h)], [("stored", None)]]:
        with pytest.raises(ValueError):
            encode_kv_events(bad)
    assert leading_matches([1, 1, 0, 1]) == 2
    assert leading_matches([]) == 0 and leading_matches([0, 1]) == 0 and leading_matches([1, 1]) == 2
