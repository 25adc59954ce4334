"""The KV-block index: per replica, the set of block hashes it caches, and prefix matching against it.

A replica's set changes only through scripts that check its heartbeat exists and that the events
continue the sequence the index reflects (``kv_seq_applied``); otherwise the writer is told to resync,
so the index is either exact or known to be behind. A full resync is uploaded in chunks to a staging
set and swapped in only when complete.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.runner import Batch, Eval, Op, Script, as_text, ttl_ms

HASH_BYTES = 16
EVENT_BATCH = 1000  # events per apply call: bounds the time one script holds Redis
UPLOAD_CHUNK = 1000  # members per SADD while uploading a resync
MATCH_CHUNK = (
    256  # most hashes per SMISMEMBER in a prefix match (chunks grow from 16; stop at the first miss)
)

KVEvent = tuple[str, bytes | None]  # ("stored", h) | ("removed", h) | ("cleared", None)

APPLY_KV_EVENTS = Script.load("apply_kv_events")
COMMIT_STAGED_BLOCKS = Script.load("commit_staged_blocks")
PREFIX_MATCH = Script.load("prefix_match")


def encode_kv_events(events: Iterable[KVEvent]) -> list[bytes]:
    """Flatten events to the apply script's argument pairs (op letter, hash); ValueError if malformed."""
    out: list[bytes] = []
    for event in events:
        kind, h = event
        if kind == "cleared":
            out += [b"c", b""]
            continue
        if kind not in ("stored", "removed"):
            raise ValueError(f"unknown KV event kind {kind!r}")
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"KV event {kind!r} needs a {HASH_BYTES}-byte block hash, got {h!r}")
        out += [b"s" if kind == "stored" else b"r", h]
    return out


def leading_matches(flags: Sequence[int]) -> int:
    """How many leading entries are truthy: the prefix a replica holds (a gap ends the match)."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def check_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    """The hashes as a list; ValueError unless each is a ``HASH_BYTES``-byte ``bytes``."""
    out = list(hashes)
    for h in out:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes, got {h!r}")
    return out


@dataclass(frozen=True, slots=True)
class KVApplyResult:
    """Outcome of writing KV events or a snapshot. ``resync_needed`` tells the replica to send a full
    snapshot: its heartbeat was missing (Redis lost data, or the replica expired) or the index's
    sequence number does not continue where these events start (events were lost)."""

    ok: bool
    seq: int  # the index's kv_seq_applied after the call (0 when unknown)
    reason: Literal["applied", "duplicate", "no-heartbeat", "gap", "incomplete"]

    @property
    def resync_needed(self) -> bool:
        return not self.ok


_APPLY_REASONS = {1: "applied", 0: "duplicate", -1: "no-heartbeat", -2: "gap", -3: "incomplete"}


def op_apply_kv_events(replica_id: str, events: Sequence[KVEvent], first_seq: int | None) -> Op:
    flat = encode_kv_events(events)
    if first_seq is not None and first_seq < 1:
        raise ValueError(f"sequence numbers start at 1, got first_seq={first_seq}")
    if not events:
        return KVApplyResult(True, 0, "duplicate")
    rid = replica_id
    status, seq = yield Eval(
        APPLY_KV_EVENTS,
        [keys.replica(rid), keys.replica_blocks(rid)],
        [-1 if first_seq is None else first_seq, len(events), *flat],
    )
    return KVApplyResult(status >= 0, int(seq), _APPLY_REASONS[status])  # type: ignore[arg-type]


def op_stage_blocks(replica_id: str, hashes: Sequence[bytes], fresh: bool) -> Op:
    """Upload part of a resync to the staging set (``fresh`` starts a new one), one pipeline."""
    hashes = check_hashes(hashes)
    staging = keys.replica_resync(replica_id)
    upload: list[tuple[Any, ...]] = [("UNLINK", staging)] if fresh else []
    for i in range(0, len(hashes), UPLOAD_CHUNK):
        upload.append(("SADD", staging, *hashes[i : i + UPLOAD_CHUNK]))
    upload.append(("PEXPIRE", staging, ttl_ms(keys.RESYNC_STAGING_TTL_S)))
    yield Batch(upload)


def op_commit_staged(replica_id: str, num_hashes: int, seq: int | None) -> Op:
    """Swap the staging set onto the block index if it holds exactly ``num_hashes`` distinct hashes."""
    rid = replica_id
    status, value = yield Eval(
        COMMIT_STAGED_BLOCKS,
        [keys.replica(rid), keys.replica_blocks(rid), keys.replica_resync(rid)],
        ["" if seq is None else seq, num_hashes],
    )
    if status < 0:
        return KVApplyResult(False, int(value), _APPLY_REASONS[status])  # type: ignore[arg-type]
    return KVApplyResult(True, int(value), "applied")


def op_replace_blocks(replica_id: str, hashes: Iterable[bytes], seq: int | None) -> Op:
    unique = list(dict.fromkeys(check_hashes(hashes)))
    yield from op_stage_blocks(replica_id, unique, fresh=True)
    return (yield from op_commit_staged(replica_id, len(unique), seq))


def op_prefix_match(model: str, block_hashes: Sequence[bytes], replica_ids: Sequence[str] | None) -> Op:
    hashes = check_hashes(block_hashes)
    blocks = keys.replica_blocks_template().args()
    if replica_ids is not None:
        replica_ids = list(replica_ids)
        if not replica_ids:
            return {}
        if not hashes:
            return dict.fromkeys(replica_ids, 0)
        ids, counts = yield Eval(
            PREFIX_MATCH,
            [keys.replica_blocks(r) for r in replica_ids],
            ["ids", *blocks, MATCH_CHUNK, *hashes],
        )
        return dict(zip(replica_ids, map(int, counts)))
    ids, counts = yield Eval(
        PREFIX_MATCH, [keys.model_replicas(model)], ["model", *blocks, MATCH_CHUNK, *hashes]
    )
    return {as_text(r): int(n) for r, n in zip(ids, counts)}
