"""The Redis contract's pure parts: key names, the key table, schemas and helpers (no Redis needed)."""

import re
from importlib import resources
from pathlib import Path

import msgspec
import pytest

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.kv_index import encode_kv_events, leading_matches
from kvfleet_common.fleet_store.tokenizers import tokenizer_revision
from kvfleet_common.schemas import Heartbeat, ModelPolicy, TenantRecord, decode_model_policy, decode_tenant

SHA = "ab" * 32
EXAMPLE_KEYS = {
    "kvf:replica:<replica_id>": keys.replica("pod-0#1700000000000"),
    "kvf:replica:<replica_id>:blocks": keys.replica_blocks("pod-0#1"),
    "kvf:replica:<replica_id>:resync": keys.replica_resync("pod-0#1"),
    "kvf:name:<replica_name>": keys.replica_name("pod-0"),
    "kvf:models": keys.models(),
    "kvf:model:<model>:replicas": keys.model_replicas("org/Model-1.5B"),
    "kvf:model:<model>:config": keys.model_policy("m"),
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


TEMPLATES = [  # (template, the key function it must agree with, a valid part)
    (keys.replica_template(), keys.replica, "pod-0#1"),
    (keys.replica_blocks_template(), keys.replica_blocks, "pod-0#1"),
    (keys.replica_resync_template(), keys.replica_resync, "pod-0#1"),
    (keys.replica_name_template(), keys.replica_name, "pod-0"),
    (keys.model_replicas_template(), keys.model_replicas, "org/m"),
    (keys.model_policy_template(), keys.model_policy, "org/m"),
    (keys.model_tokenizer_template("m"), lambda rev: keys.model_tokenizer("m", rev), SHA),
    (keys.tenant_template(), keys.tenant, "acme"),
    (keys.api_key_template(), keys.api_key, SHA),
    (keys.gateway_load_template(), keys.gateway_load, "gw-1"),
]


@pytest.mark.parametrize(("template", "key_of", "part"), TEMPLATES)
def test_key_templates_build_the_same_keys_as_the_key_functions(template, key_of, part):
    assert template.key(part) == key_of(part)
    assert keys.spec_for(template.key(part)) is not None
    assert template.args() == [template.head, template.tail]


def _lua_files() -> dict[str, str]:
    lua = resources.files("kvfleet_common.fleet_store").joinpath("lua")
    return {f.name: f.read_text() for f in lua.iterdir() if f.name.endswith(".lua")}


def _lua_string_literals(source: str) -> list[str]:
    code = re.sub(r"--[^\n]*", "", source)  # comments may name keys; only code must not
    return [m[1] if m[1] is not None else m[2] for m in re.finditer(r"'([^']*)'|\"([^\"]*)\"", code)]


def test_no_lua_script_spells_a_key():
    """Keys come from redis_keys only: a script gets them as KEYS or as KeyTemplates in ARGV, so no string
    in its code holds a key name, a key prefix or the key separator ':'."""
    scripts = _lua_files()
    assert len(scripts) >= 16  # one file per script, shipped as package data
    fragments = {part for spec in keys.KEY_SPECS for part in re.split(r"<[^>]+>", spec.pattern) if part}
    for name, source in scripts.items():
        code = re.sub(r"--[^\n]*", "", source)
        assert keys.PREFIX not in code, name
        for literal in _lua_string_literals(source):
            assert ":" not in literal, (name, literal)
            assert not any(f in literal for f in fragments), (name, literal)


def test_every_lua_script_is_loaded_by_an_operation():
    import kvfleet_common.fleet_store as package
    from kvfleet_common.fleet_store import store  # noqa: F401  (imports every concern module)
    from kvfleet_common.fleet_store.runner import Script

    loaded = {
        value.source
        for module in vars(package).values()
        if hasattr(module, "__dict__") and getattr(module, "__name__", "").startswith(package.__name__)
        for value in vars(module).values()
        if isinstance(value, Script)
    }
    assert set(_lua_files().values()) == loaded


def test_unknown_keys_have_no_spec():
    for key in ["kvf:replica:pod-0", "kvf:whatever", "other:models", "kvf:model:a:b:config", b"kvf:\xff"]:
        assert keys.spec_for(key) is None


@pytest.mark.parametrize("bad", ["", "a:b", "a#1", "-lead", "has space", "x" * 254, "ü", None])
def test_names_that_would_make_keys_ambiguous_are_rejected(bad):
    with pytest.raises(ValueError, match="invalid"):
        keys.check_name(bad)
    with pytest.raises(ValueError):
        keys.model_policy(bad)


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


def test_tenant_and_model_policy_json():
    t = TenantRecord(name="acme", models=["llama-*", "org/*"], requests_per_minute=60, cache_salt="s1")
    assert decode_tenant(msgspec.json.encode(t)) == t
    assert t.allows_model("llama-3") and t.allows_model("org/x") and not t.allows_model("qwen")
    assert TenantRecord(name="free").requests_per_minute is None  # None = unlimited
    for bad in [b'{"name": "a:b"}', b'{"name": "a", "requests_per_minute": 0}', b'{"name": "a", "extra": 1}']:
        with pytest.raises(msgspec.ValidationError):
            decode_tenant(bad)
    c = ModelPolicy(
        model="m",
        routing_policy="least-load",
        sleep_idle_seconds=300,
        sleep_level=2,
        allowed_tenants=["acme"],
    )
    assert decode_model_policy(msgspec.json.encode(c)) == c
    assert c.allows_tenant("acme") and not c.allows_tenant("other")
    with pytest.raises(msgspec.ValidationError):
        decode_model_policy(b'{"model": "m", "routing_policy": "random"}')


class _PolicyBeforeAutoscaling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """ModelPolicy as a gateway from before ``scale_from_zero`` knows it."""

    model: str
    routing_policy: str = "prefix-aware"
    sleep_idle_seconds: int | None = None
    sleep_level: int = 1
    allowed_tenants: list[str] | None = None


def test_an_older_gateway_reads_the_policy_of_a_model_that_is_not_autoscaled():
    """Rolling upgrades: the operator may be updated first; only autoscaled models need the new gateways."""
    fixed = ModelPolicy(model="m", sleep_idle_seconds=60, sleep_level=2)
    old = msgspec.json.decode(msgspec.json.encode(fixed), type=_PolicyBeforeAutoscaling)
    assert (old.model, old.sleep_idle_seconds, old.sleep_level) == ("m", 60, 2)
    with pytest.raises(msgspec.ValidationError):  # an autoscaled one names a field the old gateway lacks
        msgspec.json.decode(msgspec.json.encode(ModelPolicy(model="m", scale_from_zero=True)),
                            type=_PolicyBeforeAutoscaling)  # fmt: skip


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
