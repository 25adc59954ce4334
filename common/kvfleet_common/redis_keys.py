"""Every Redis key kvfleet writes: one function per key, and a table (``KEY_SPECS``) describing each.

All keys start with ``kvf:``. Names embedded in keys (models, replica names, tenants) are checked by
:func:`check_name` and never contain ``:``, so every key parses back to exactly one spec
(:func:`spec_for`); a test scans Redis after a full scenario and fails on any key no spec describes.

Invariant: this module is the only place that spells a key, Lua included. The fleet store's scripts
(``kvfleet_common/fleet_store/lua/*.lua``) receive every key they touch as ``KEYS``, or, for keys of
ids they read inside Redis (every replica of a model, the owner of an API key), a
:class:`KeyTemplate` built here and passed in ``ARGV``; no ``.lua`` file holds a key name or a key
prefix (``tests/common/test_redis_keys.py`` checks it). The same holds for the field prefixes of a
gateway's load hash (``LOAD_FIELD_*``).

=====================================  ======  =================  ==========  =========================================
key                                    type    TTL                writer      content
=====================================  ======  =================  ==========  =========================================
kvf:replica:<replica_id>               hash    heartbeat (~5 s)   engine      heartbeat record (schemas.Heartbeat)
kvf:replica:<replica_id>:blocks        set     = heartbeat's      engine      16-byte hashes of its cached KV blocks
kvf:replica:<replica_id>:resync        set     60 s               engine      staging set while a full resync uploads
kvf:name:<replica_name>                string  heartbeat (~5 s)   engine      current replica id (name#epoch)
kvf:models                             set     none (pruned)      engine/op   model names known to the platform
kvf:model:<model>:replicas             set     none (pruned)      engine      replica ids that heartbeat for the model
kvf:model:<model>:config               string  none               operator    JSON schemas.ModelPolicy
kvf:model:<model>:activity             string  none               gateway     last request time, unix seconds (float)
kvf:model:<model>:wake_lock            string  PX (~30 s)         gateway     holder token of the one pending wake
kvf:model:<model>:tokenizers           set     none               engine      published tokenizer revisions
kvf:model:<model>:tokenizer:<rev>      hash    none               engine      tokenizer file name -> file bytes
kvf:tenants                            set     none               operator    tenant names
kvf:tenant:<tenant>                    string  none               operator    JSON schemas.TenantRecord
kvf:tenant:<tenant>:keys               hash    none               operator    key id -> SHA-256 hex of the API key
kvf:apikey:<sha256_hex>                string  none               operator    tenant name owning the key
kvf:ratelimit:<tenant>:<minute>        hash    120 s              gateway     {requests, tokens} reserved/used that minute
kvf:usage:<tenant>                     hash    none               gateway     cumulative requests and tokens
kvf:inflight:<tenant>                  zset    lease TTL (~10 s)  gateway     concurrency leases -> lease expiry (unix ms)
kvf:gateways                           zset    none (pruned)      gateway     gateway id -> time of its last load report
kvf:gateway:<gateway_id>:load          hash    10 s (refreshed)   gateway     that gateway's in-flight load per replica/tenant/model
=====================================  ======  =================  ==========  =========================================

A replica's heartbeat, its block set and its name record share one lifetime: every heartbeat
refreshes all three, so a replica that dies without deregistering disappears from Redis by itself
after one TTL, and its id is pruned from ``kvf:model:<model>:replicas`` the next time it is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "kvf:"

HEARTBEAT_TTL_S = 5.0
"""Default heartbeat TTL; engines refresh every ~1 s, so a replica is dead after ~5 missed beats."""
RESYNC_STAGING_TTL_S = 60.0
WAKE_LOCK_TTL_MS = 30_000
RATELIMIT_WINDOW_S = 60
RATELIMIT_TTL_S = 120  # the current and the previous window stay readable
GATEWAY_LOAD_TTL_S = 10.0
"""A gateway reports its in-flight load at least every ~1 s; a gateway silent this long is gone, and
so is what it held (no counter leaks when a gateway dies with requests in flight)."""
LEASE_TTL_S = 10.0
"""A concurrency lease (``inflight``) lives this long unless its gateway renews it (every ~1 s while the
request runs): a gateway that dies with requests in flight holds their slots at most this long."""

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@+=-]{0,252}")
_REPLICA_ID_RE = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._/@+=-]{0,252})#(?P<epoch>[0-9]{1,20})")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*")


def check_name(name: str, what: str = "name") -> str:
    """Return ``name`` if it is a valid model / replica / tenant name, else raise ValueError.

    Allowed: letters, digits and ``. _ / @ + = -`` (so Hugging Face ids like ``org/model`` work), not
    starting with punctuation, at most 253 characters. ``:`` and ``#`` are excluded: they separate
    key parts and the replica epoch.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid {what} {name!r}: use 1-253 letters, digits or ._/@+=- characters, starting with a letter or digit"
        )
    return name


def check_tenant_name(name: str) -> str:
    """Return ``name`` if a *new* tenant may take it, else raise ValueError.

    The Tenant custom resource's rule (Kubernetes object names, RFC 1123 subdomains): dot-separated
    labels of lowercase letters, digits and ``-``, each starting and ending with a letter or digit,
    at most 63 characters per label and 253 in all. Such a name is one URL path segment of the admin
    API and one key part. (``check_name`` stays the looser rule names already stored are read with.)
    """
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN_RE.fullmatch(name):
        raise ValueError(
            f"invalid tenant name {name!r}: use 1-253 lowercase letters, digits, '-' or '.' (like a "
            "Kubernetes object name), starting and ending with a letter or digit"
        )
    return name


def make_replica_id(name: str, epoch: int) -> str:
    """``<name>#<epoch>``: the epoch (boot time in ms) tells boots of the same replica name apart."""
    check_name(name, "replica name")
    if not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"replica epoch must be a non-negative int, got {epoch!r}")
    return f"{name}#{epoch}"


def parse_replica_id(replica_id: str) -> tuple[str, int]:
    """Split ``<name>#<epoch>``; ValueError if malformed."""
    m = _REPLICA_ID_RE.fullmatch(replica_id) if isinstance(replica_id, str) else None
    if m is None:
        raise ValueError(f"invalid replica id {replica_id!r}: expected '<name>#<epoch>'")
    return m["name"], int(m["epoch"])


def check_sha256_hex(value: str) -> str:
    if not isinstance(value, str) or not _HEX64_RE.fullmatch(value):
        raise ValueError(f"expected a lowercase SHA-256 hex digest (64 chars), got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class KeyTemplate:
    """The keys of one kind, for a Lua script that learns the varying part inside Redis.

    ``head + part + tail`` is the key of ``part`` (a replica id, a model, a tenant, ...); the key
    functions below are built from these templates, so a script given ``args()`` in ``ARGV`` builds
    exactly the keys Python does (``ARGV[i] .. part .. ARGV[i + 1]``) without spelling any of them."""

    head: str
    tail: str = ""

    def key(self, part: str) -> str:
        return f"{self.head}{part}{self.tail}"

    def args(self) -> list[str]:
        """``[head, tail]``: a template's two ARGV entries."""
        return [self.head, self.tail]


# ---- replicas (engine) -------------------------------------------------------------------------

_REPLICA = KeyTemplate(f"{PREFIX}replica:")
_REPLICA_BLOCKS = KeyTemplate(f"{PREFIX}replica:", ":blocks")
_REPLICA_RESYNC = KeyTemplate(f"{PREFIX}replica:", ":resync")
_REPLICA_NAME = KeyTemplate(f"{PREFIX}name:")


def replica(replica_id: str) -> str:
    """HASH, TTL = heartbeat TTL: the replica's heartbeat record plus ``kv_seq_applied``."""
    parse_replica_id(replica_id)
    return _REPLICA.key(replica_id)


def replica_template() -> KeyTemplate:
    """``replica`` of an id a script reads (e.g. a model's replica set)."""
    return _REPLICA


def replica_blocks(replica_id: str) -> str:
    """SET of 16-byte block hashes the replica caches; expires together with its heartbeat."""
    parse_replica_id(replica_id)
    return _REPLICA_BLOCKS.key(replica_id)


def replica_blocks_template() -> KeyTemplate:
    return _REPLICA_BLOCKS


def replica_resync(replica_id: str) -> str:
    """SET, TTL 60 s: a full resync is uploaded here in chunks, then renamed onto ``replica_blocks``."""
    parse_replica_id(replica_id)
    return _REPLICA_RESYNC.key(replica_id)


def replica_resync_template() -> KeyTemplate:
    return _REPLICA_RESYNC


def replica_name(name: str) -> str:
    """STRING, TTL = heartbeat TTL: replica name -> its current replica id (the latest boot epoch)."""
    return _REPLICA_NAME.key(check_name(name, "replica name"))


def replica_name_template() -> KeyTemplate:
    return _REPLICA_NAME


# ---- models ----------------------------------------------------------------------------------------

_MODEL_REPLICAS = KeyTemplate(f"{PREFIX}model:", ":replicas")
_MODEL_POLICY = KeyTemplate(f"{PREFIX}model:", ":config")  # ":config": the wire name, older than ModelPolicy


def models() -> str:
    """SET of model names (added by a replica's heartbeat or a model policy; removed by purge_model)."""
    return f"{PREFIX}models"


def model_replicas(model: str) -> str:
    """SET of replica ids serving ``model``; ids whose heartbeat expired are pruned when read."""
    return _MODEL_REPLICAS.key(check_name(model, "model"))


def model_replicas_template() -> KeyTemplate:
    return _MODEL_REPLICAS


def model_policy(model: str) -> str:
    """STRING: JSON ``schemas.ModelPolicy`` written by the operator (the key ends in ``:config``)."""
    return _MODEL_POLICY.key(check_name(model, "model"))


def model_policy_template() -> KeyTemplate:
    return _MODEL_POLICY


def model_activity(model: str) -> str:
    """STRING: unix time (float seconds) of the model's last request; drives idle sleep."""
    return f"{PREFIX}model:{check_name(model, 'model')}:activity"


def model_wake_lock(model: str) -> str:
    """STRING with PX TTL: held while one wake of the model is in progress (de-duplicates wakes)."""
    return f"{PREFIX}model:{check_name(model, 'model')}:wake_lock"


def model_tokenizers(model: str) -> str:
    """SET of tokenizer revisions published for ``model`` (so purge_model finds them all)."""
    return f"{PREFIX}model:{check_name(model, 'model')}:tokenizers"


def model_tokenizer(model: str, revision: str) -> str:
    """HASH: file name -> file bytes of one tokenizer revision (revision = SHA-256 of the files)."""
    return model_tokenizer_template(model).key(check_sha256_hex(revision))


def model_tokenizer_template(model: str) -> KeyTemplate:
    """``model_tokenizer`` of ``model`` for a revision a script reads (its ``model_tokenizers`` set)."""
    return KeyTemplate(f"{PREFIX}model:{check_name(model, 'model')}:tokenizer:")


# ---- tenants ---------------------------------------------------------------------------------------

_TENANT = KeyTemplate(f"{PREFIX}tenant:")
_API_KEY = KeyTemplate(f"{PREFIX}apikey:")


def tenants() -> str:
    """SET of tenant names."""
    return f"{PREFIX}tenants"


def tenant(name: str) -> str:
    """STRING: JSON ``TenantRecord``."""
    return _TENANT.key(check_name(name, "tenant"))


def tenant_template() -> KeyTemplate:
    return _TENANT


def tenant_keys(name: str) -> str:
    """HASH: API key id -> SHA-256 hex of the key (the key itself is never stored)."""
    return f"{PREFIX}tenant:{check_name(name, 'tenant')}:keys"


def api_key(sha256_hex: str) -> str:
    """STRING: SHA-256 hex of an API key -> tenant name."""
    return _API_KEY.key(check_sha256_hex(sha256_hex))


def api_key_template() -> KeyTemplate:
    return _API_KEY


def ratelimit(tenant_name: str, minute: int) -> str:
    """HASH {requests, tokens}, TTL 120 s: the tenant's usage in window ``minute`` (= unix time // 60)."""
    if not isinstance(minute, int) or minute < 0:
        raise ValueError(f"minute must be a non-negative int, got {minute!r}")
    return f"{PREFIX}ratelimit:{check_name(tenant_name, 'tenant')}:{minute}"


def usage(tenant_name: str) -> str:
    """HASH of cumulative counters (``requests``, ``prompt_tokens``, ``completion_tokens``,
    ``cached_tokens``, and the same per model as ``<model>|<counter>``); deleted with the tenant."""
    return f"{PREFIX}usage:{check_name(tenant_name, 'tenant')}"


def inflight(tenant_name: str) -> str:
    """ZSET lease id -> expiry (unix ms): the tenant's admitted requests in flight on every gateway.
    Taken by ``admit`` in its round trip, renewed by the owning gateway's load reports, removed when the
    request ends; an expired lease (its gateway died) is pruned by the next admission."""
    return f"{PREFIX}inflight:{check_name(tenant_name, 'tenant')}"


# ---- gateways ----------------------------------------------------------------------------------------

_GATEWAY_LOAD = KeyTemplate(f"{PREFIX}gateway:", ":load")

LOAD_FIELD_REPLICA_REQUESTS = "ri:"
"""``gateway_load`` field prefix: + replica id -> requests in flight to that replica."""
LOAD_FIELD_REPLICA_PROMPT_TOKENS = "rp:"
"""``gateway_load`` field prefix: + replica id -> prompt tokens routed there, not prefilled yet."""
LOAD_FIELD_TENANT_REQUESTS = "t:"
"""``gateway_load`` field prefix: + tenant -> the tenant's requests in flight on that gateway."""
LOAD_FIELD_MODEL_REQUESTS = "mi:"
"""``gateway_load`` field prefix: + model -> requests that gateway has in flight to the model's replicas."""
LOAD_FIELD_MODEL_HELD = "mh:"
"""``gateway_load`` field prefix: + model -> requests that gateway holds for the model because no replica of
it is awake yet (a cold start from zero replicas, or a wake of sleeping ones): demand the autoscaler sees
before any replica does."""


def gateways() -> str:
    """ZSET gateway id -> unix time of its last load report; members older than the load TTL are dead."""
    return f"{PREFIX}gateways"


def gateway_load(gateway_id: str) -> str:
    """HASH, TTL ~10 s refreshed by its gateway: what that gateway has in flight right now.

    Fields: ``ri:<replica_id>`` requests in flight to a replica, ``rp:<replica_id>`` prompt tokens
    routed there that have not produced a first token yet (queued prefill), ``t:<tenant>`` the
    tenant's requests in flight, ``mi:<model>`` requests in flight to the model's replicas,
    ``mh:<model>`` requests held for the model (no awake replica yet) (prefixes ``LOAD_FIELD_*``); a
    count of zero is left out. Each gateway writes only its own hash
    (absolute values, never increments), so a gateway that dies takes its counts with it when the
    hash expires."""
    return _GATEWAY_LOAD.key(check_name(gateway_id, "gateway id"))


def gateway_load_template() -> KeyTemplate:
    """``gateway_load`` of the gateways a script finds in ``gateways()``."""
    return _GATEWAY_LOAD


# ---- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeySpec:
    pattern: str  # as in the docs, placeholders in <>
    type: str  # Redis type as TYPE reports it
    ttl: str
    writer: str
    readers: str
    content: str

    def regex(self) -> re.Pattern[str]:
        name = r"[A-Za-z0-9][A-Za-z0-9._/@+=-]{0,252}"
        parts = {
            "<replica_id>": rf"{name}#[0-9]{{1,20}}",
            "<replica_name>": name,
            "<model>": name,
            "<tenant>": name,
            "<rev>": r"[0-9a-f]{64}",
            "<sha256_hex>": r"[0-9a-f]{64}",
            "<minute>": r"[0-9]+",
            "<gateway_id>": name,
        }
        out = re.escape(self.pattern)
        for placeholder, rx in parts.items():
            out = out.replace(re.escape(placeholder), rx)
        return re.compile(out)


KEY_SPECS: tuple[KeySpec, ...] = (
    KeySpec("kvf:replica:<replica_id>", "hash", "heartbeat TTL (~5 s), refreshed every ~1 s", "engine",
            "gateway, operator", "heartbeat record (schemas.Heartbeat) + kv_seq_applied"),
    KeySpec("kvf:replica:<replica_id>:blocks", "set", "same as the replica's heartbeat", "engine",
            "gateway (prefix_match)", "16-byte hashes of the KV blocks the replica caches"),
    KeySpec("kvf:replica:<replica_id>:resync", "set", f"{RESYNC_STAGING_TTL_S:g} s", "engine", "engine",
            "staging set of a full resync, renamed onto :blocks when complete"),
    KeySpec("kvf:name:<replica_name>", "string", "heartbeat TTL, refreshed with it", "engine", "engine",
            "current replica id (name#epoch) of a replica name"),
    KeySpec("kvf:models", "set", "none; pruned by list_models", "engine, operator", "gateway, operator",
            "model names (list_models drops those with no policy and no live replica)"),
    KeySpec("kvf:model:<model>:replicas", "set", "none; dead ids pruned on read", "engine",
            "gateway, operator", "replica ids of the model"),
    KeySpec("kvf:model:<model>:config", "string", "none", "operator", "gateway, operator",
            "JSON schemas.ModelPolicy (routing policy, idle sleep, allowed tenants)"),
    KeySpec("kvf:model:<model>:activity", "string", "none", "gateway", "operator",
            "unix time (float s) of the model's last request"),
    KeySpec("kvf:model:<model>:wake_lock", "string", f"PX {WAKE_LOCK_TTL_MS} ms", "gateway", "gateway",
            "token of the holder of the one wake in progress"),
    KeySpec("kvf:model:<model>:tokenizers", "set", "none", "engine", "operator (purge)",
            "tokenizer revisions published for the model"),
    KeySpec("kvf:model:<model>:tokenizer:<rev>", "hash", "none", "engine", "gateway",
            "tokenizer file name -> bytes; rev = SHA-256 of the files"),
    KeySpec("kvf:tenants", "set", "none", "operator", "gateway, operator", "tenant names"),
    KeySpec("kvf:tenant:<tenant>", "string", "none", "operator", "gateway", "JSON schemas.TenantRecord"),
    KeySpec("kvf:tenant:<tenant>:keys", "hash", "none", "operator", "operator",
            "API key id -> SHA-256 hex of the key"),
    KeySpec("kvf:apikey:<sha256_hex>", "string", "none", "operator", "gateway",
            "tenant name owning the API key with this SHA-256"),
    KeySpec("kvf:ratelimit:<tenant>:<minute>", "hash", f"{RATELIMIT_TTL_S} s", "gateway", "gateway",
            "{requests, tokens} the tenant used in that minute (tokens reserved at admission, then settled)"),
    KeySpec("kvf:usage:<tenant>", "hash", "none; deleted with the tenant", "gateway", "gateway (admin usage)",
            "cumulative requests / prompt, completion and cached tokens, also per model (<model>|<counter>)"),
    KeySpec("kvf:inflight:<tenant>", "zset", f"{LEASE_TTL_S:g} s, refreshed by the gateways' reports", "gateway",
            "gateway", "concurrency leases of the tenant's requests in flight -> lease expiry (unix ms)"),
    KeySpec("kvf:gateways", "zset", "none; members older than the load TTL pruned", "gateway", "gateway",
            "gateway id -> unix time of its last load report"),
    KeySpec("kvf:gateway:<gateway_id>:load", "hash", f"{GATEWAY_LOAD_TTL_S:g} s, refreshed every ~1 s", "gateway",
            "gateway, operator", "its in flight load: ri:<replica> requests, rp:<replica> queued prompt tokens, "
            "t:<tenant>, mi:<model> requests, mh:<model> requests held for a replica to wake or start"),
)  # fmt: skip

_SPEC_REGEXES = [(spec, spec.regex()) for spec in KEY_SPECS]


def spec_for(key: str | bytes) -> KeySpec | None:
    """The spec describing ``key``, or None if kvfleet never writes such a key."""
    if isinstance(key, bytes):
        try:
            key = key.decode()
        except UnicodeDecodeError:
            return None
    for spec, rx in _SPEC_REGEXES:
        if rx.fullmatch(key):
            return spec
    return None


def markdown_table() -> str:
    """The key table as Markdown (docs/REDIS.md embeds it; a test keeps the two in sync)."""
    lines = ["| key | type | TTL | writer | readers | content |", "|---|---|---|---|---|---|"]
    for s in KEY_SPECS:
        lines.append(f"| `{s.pattern}` | {s.type} | {s.ttl} | {s.writer} | {s.readers} | {s.content} |")
    return "\n".join(lines)
