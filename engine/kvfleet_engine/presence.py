"""The engine's presence in Redis: heartbeats and the replica's KV block index, from a background thread.

The engine core's busy loop must never wait on Redis, so it only touches in-memory state here:
``push_kv_events`` appends to a bounded queue, ``resync_requested`` reads a flag and
``push_snapshot`` enqueues a full index. One thread with a sync client does all the I/O.

Consistency (see docs/REDIS.md): every KV event gets a sequence number; the Redis side applies a
batch only if it continues the index's ``kv_seq_applied``, so after any hiccup the index is either
exact or the publisher learns it is not (heartbeat gone because Redis restarted or the replica
expired, a sequence gap, a queue overflow) and asks the engine for a snapshot. Until the snapshot
arrives, new events are dropped: the snapshot subsumes them.

Redis unavailable: the engine keeps serving; the thread retries with capped exponential backoff
and logs once when the outage starts and once when it ends. Events queue up to
``max_queued_events``; beyond that the queue is dropped and a resync requested.

Redis refusing the credentials (a wrong or missing password in KVFLEET_REDIS_URL) is treated the same way
(the engine keeps serving, invisible to the gateways), but logged as an ERROR naming the Redis (password
masked) and what to check, and ``credentials_refused`` is set; the thread keeps retrying, so a
password fixed on the Redis side is picked up without a restart.

Every heartbeat is signed with the replica key (``kvfleet_common.replica_credentials``) when one is given:
gateways holding the platform's replica key root route only to replicas whose heartbeats verify.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvfleet_common import __version__
from kvfleet_common import redis_keys as keys
from kvfleet_common.fleet_store.kv_index import EVENT_BATCH, KVEvent
from kvfleet_common.fleet_store.runner import SupersededError
from kvfleet_common.fleet_store.store import FleetStore
from kvfleet_common.fleet_store.tokenizers import tokenizer_revision
from kvfleet_common.redis_url import credentials_message, is_credentials_error
from kvfleet_common.replica_credentials import sign_heartbeat
from kvfleet_common.schemas import REPLICA_STATES, Heartbeat, ReplicaStats

logger = logging.getLogger(__name__)

SNAPSHOT_SLICE = 50_000  # hashes staged per round trip: a huge snapshot never delays a heartbeat long

_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


@dataclass(slots=True)
class _Events:
    first_seq: int
    events: list[KVEvent] = field(default_factory=list)


@dataclass(slots=True)
class _Snapshot:
    seq: int  # the last event the snapshot reflects
    hashes: list[bytes]  # distinct
    uploaded: int = 0  # hashes already staged in Redis; uploads resume here between heartbeats


class PresencePublisher:
    """Publishes one replica's heartbeat and KV events to Redis from a daemon thread.

    Thread contract: ``push_kv_events``, ``resync_requested``, ``push_snapshot`` and ``set_state``
    are called from the engine's thread and never block on I/O; ``stats`` is called from the
    publisher's thread, once per heartbeat.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        name: str,
        model: str,
        base_url: str,
        block_size: int,
        max_model_len: int,
        stats: Callable[[], ReplicaStats],
        tokenizer_files: dict[str, bytes] | None = None,
        heartbeat_interval: float = 1.0,
        ttl: float = keys.HEARTBEAT_TTL_S,
        max_queued_events: int = 200_000,
        max_backoff: float = 2.0,
        epoch: int | None = None,
        replica_key: bytes | None = None,
    ) -> None:
        if not 0 < heartbeat_interval < ttl:
            raise ValueError(f"need 0 < heartbeat_interval < ttl, got {heartbeat_interval} and {ttl}")
        if max_queued_events < 1:
            raise ValueError(f"max_queued_events must be >= 1, got {max_queued_events}")
        keys.check_name(model, "model")
        self.replica_id = keys.make_replica_id(name, int(time.time() * 1000) if epoch is None else epoch)
        self.name, self.model, self.base_url = name, model, base_url
        self.block_size, self.max_model_len = block_size, max_model_len
        self.heartbeat_interval, self.ttl = heartbeat_interval, ttl
        self.max_queued_events = max_queued_events
        self.max_backoff = max_backoff
        self._stats = stats
        self._replica_key = replica_key  # None: heartbeats go out unsigned
        self._tokenizer_files = dict(tokenizer_files) if tokenizer_files else None
        self.tokenizer_revision = tokenizer_revision(self._tokenizer_files) if self._tokenizer_files else ""
        self.started_at = time.time()

        self._redis_url = redis_url  # only ever logged through credentials_message (masked)
        # Socket errors surface at once (no client-side retry loop): this thread owns retrying.
        self._store = FleetStore(
            redis.Redis.from_url(
                redis_url, socket_timeout=2.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
            )
        )

        # Everything below is shared with the engine's thread, guarded by _cond's lock.
        self._cond = threading.Condition()
        self._queue: deque[_Events | _Snapshot] = deque()
        self._queued_events = 0
        self._seq = 0  # number of the last event pushed
        self._generation = 0  # bumped whenever the queue is discarded; stale in-flight items are dropped
        self._resync = False  # a snapshot is wanted and not yet pushed
        self._state = "starting"
        self._beat_now = False
        self._stopping = False
        self._deregister = True
        self._thread: threading.Thread | None = None
        self._first_beat = True  # the first beat after claiming creates the heartbeat: no resync needed

        # Publisher-thread state (also read by tests).
        self.connected = False
        self.credentials_refused = False  # Redis refused the password: see the module docstring
        self.superseded = False
        self.resyncs_requested = 0
        self.events_dropped = 0

    # ---- engine side (never blocks on Redis) -----------------------------------------------------

    def start(self) -> None:
        """Start the thread: claim the name (clearing the previous epoch), publish the tokenizer, beat."""
        if self._thread is not None:
            raise RuntimeError("PresencePublisher already started")
        self._thread = threading.Thread(target=self._run, name=f"presence-{self.name}", daemon=True)
        self._thread.start()

    def set_state(self, state: str) -> None:
        """Change the advertised state; the heartbeat goes out at once (from the thread)."""
        if state not in REPLICA_STATES:
            raise ValueError(f"unknown replica state {state!r}; expected one of {REPLICA_STATES}")
        with self._cond:
            self._state = state
            self._beat_now = True
            self._cond.notify()

    @property
    def state(self) -> str:
        return self._state

    def push_kv_events(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's ordered events. O(len(events)); drops them (and asks for a resync) on overflow."""
        if not events:
            return
        with self._cond:
            first = self._seq + 1
            self._seq += len(events)
            if self._resync:
                self.events_dropped += len(events)  # the coming snapshot covers them
                return
            if self._queued_events + len(events) > self.max_queued_events:
                self.events_dropped += self._queued_events + len(events)
                logger.warning(
                    "presence: %d KV events queued (Redis slow or down); dropping them and asking for a resync",
                    self._queued_events,
                )
                self._request_resync_locked()
                return
            tail = self._queue[-1] if self._queue else None
            if isinstance(tail, _Events) and len(tail.events) + len(events) <= EVENT_BATCH:
                tail.events.extend(events)
            else:
                for i in range(0, len(events), EVENT_BATCH):
                    self._queue.append(_Events(first + i, list(events[i : i + EVENT_BATCH])))
            self._queued_events += len(events)
            self._cond.notify()

    def resync_requested(self) -> bool:
        """True when the index in Redis cannot be trusted: the engine should call ``push_snapshot``."""
        return self._resync

    def push_snapshot(self, hashes: Iterable[bytes]) -> None:
        """Every block hash the engine caches now (after all events pushed so far); replaces the index."""
        snapshot = list(dict.fromkeys(hashes))
        with self._cond:
            self._discard_queue_locked()
            self._queue.append(_Snapshot(self._seq, snapshot))
            self._resync = False
            self._cond.notify()

    def stop(self, deregister: bool = True, timeout: float = 2.0) -> None:
        """Stop the thread. ``deregister`` removes the replica from Redis now; otherwise pending events
        and a last heartbeat are flushed (best effort) and the records expire after the TTL."""
        with self._cond:
            self._stopping = True
            self._deregister = deregister
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._store.close()

    # ---- shared-state helpers (call with _cond held) --------------------------------------------------

    def _discard_queue_locked(self) -> None:
        self._queue.clear()
        self._queued_events = 0
        self._generation += 1

    def _request_resync_locked(self) -> None:
        self._discard_queue_locked()
        if not self._resync:
            self._resync = True
            self.resyncs_requested += 1

    def _request_resync(self, why: str, generation: int | None = None) -> None:
        """Ask for a snapshot, unless one is already coming: ``generation`` is the queue generation the
        evidence was observed in; if the queue was discarded since, a snapshot already supersedes it."""
        with self._cond:
            if self._resync or (generation is not None and generation != self._generation):
                return
            if any(isinstance(item, _Snapshot) for item in self._queue):
                return
            logger.info("presence: %s; asking the engine for a full KV index resync", why)
            self._request_resync_locked()

    # ---- publisher thread -------------------------------------------------------------------------

    def _run(self) -> None:
        claimed = False
        backoff = 0.05
        outage_since: float | None = None
        next_beat = 0.0
        while True:
            with self._cond:
                if self._stopping:
                    break
            try:
                if not claimed:
                    self._claim()
                    claimed = True
                now = time.monotonic()
                if now >= next_beat or self._beat_now:
                    self._beat()
                    next_beat = now + self.heartbeat_interval
                self._drain(until=next_beat)
                if outage_since is not None:
                    logger.warning("presence: Redis is back after %.1f s", time.monotonic() - outage_since)
                    outage_since = None
                self.connected = True
                self.credentials_refused = False
                backoff = 0.05
            except SupersededError as e:
                logger.error("presence: %s; stopping the publisher (another process took over this name)", e)
                self.superseded = True
                self.connected = False
                return
            except _REDIS_ERRORS as e:
                self.connected = False
                refused = is_credentials_error(e)
                if outage_since is None or refused != self.credentials_refused:
                    outage_since = outage_since or time.monotonic()
                    if refused:
                        message = credentials_message(self._redis_url, e)
                        logger.error("presence: %s; the engine keeps serving, unseen by gateways", message)
                    else:
                        logger.warning("presence: Redis unavailable (%s); the engine keeps serving, retrying", e)  # fmt: skip
                self.credentials_refused = refused
                self._sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            except Exception:  # a bug must not kill presence silently, nor spin
                logger.exception("presence: unexpected error; retrying")
                self._sleep(self.max_backoff)
                continue
            with self._cond:
                if not (self._stopping or self._beat_now or self._queue):
                    self._cond.wait(max(0.0, next_beat - time.monotonic()))
        self._shutdown()

    def _sleep(self, seconds: float) -> None:
        with self._cond:
            if not self._stopping:
                self._cond.wait(seconds)

    def _claim(self) -> None:
        previous = self._store.claim_name(self.name, self.replica_id, ttl=self.ttl)
        if previous:
            logger.info("presence: %s replaces previous epoch %s", self.replica_id, previous)
        self._publish_tokenizer()
        self._first_beat = True

    def _publish_tokenizer(self) -> None:
        if self._tokenizer_files:
            self._store.publish_tokenizer(self.model, self._tokenizer_files)

    def _beat(self) -> None:
        try:
            stats = self._stats()
        except Exception:
            logger.exception("presence: the stats callback failed; publishing zeros")
            stats = ReplicaStats()
        with self._cond:
            self._beat_now = False
            state, seq = self._state, self._seq
        now = time.time()
        hb = Heartbeat(
            replica_id=self.replica_id, name=self.name, model=self.model, base_url=self.base_url, state=state,
            running=stats.running, waiting=stats.waiting, kv_usage=min(1.0, max(0.0, stats.kv_usage)),
            num_kv_blocks=stats.num_kv_blocks, prefill_tokens_per_s=stats.prefill_tokens_per_s,
            decode_tokens_per_s=stats.decode_tokens_per_s, block_size=self.block_size,
            max_model_len=self.max_model_len, tokenizer_revision=self.tokenizer_revision,
            started_at=self.started_at, updated_at=now, version=__version__, kv_seq_emitted=seq,
        )  # fmt: skip
        if self._replica_key is not None:
            hb = msgspec.structs.replace(hb, signature=sign_heartbeat(self._replica_key, hb))
        existed = self._store.publish_heartbeat(hb, ttl=self.ttl)
        if not existed and not self._first_beat:
            # Redis restarted empty, or we were silent past the TTL: everything we wrote is gone.
            self._publish_tokenizer()
            self._request_resync("the heartbeat had vanished from Redis")
        self._first_beat = False

    def _drain(self, until: float | None = None) -> None:
        """Write queued items in order until the queue is empty, a round trip fails, or ``until``
        (monotonic) passes: a steady stream of events must not starve the heartbeat."""
        while until is None or time.monotonic() < until:
            with self._cond:
                if not self._queue:
                    return
                item = self._queue.popleft()
                generation = self._generation
                if isinstance(item, _Events):
                    self._queued_events -= len(item.events)
            try:
                if isinstance(item, _Events):
                    result = self._store.apply_kv_events(
                        self.replica_id, item.events, first_seq=item.first_seq
                    )
                else:
                    result = self._upload_snapshot_step(item)
            except _REDIS_ERRORS:
                if isinstance(item, _Snapshot):
                    item.uploaded = 0  # what was staged may be gone: upload again from the start
                self._requeue(item, generation)
                raise
            if result is None:  # a large snapshot, partly uploaded: continue after the next heartbeat
                self._requeue(item, generation)
                continue
            if result.resync_needed:
                self._request_resync(
                    f"the KV index refused a write ({result.reason}, index at {result.seq})", generation
                )

    def _upload_snapshot_step(self, snap: _Snapshot):
        """Stage the next slice of a snapshot; commit once all is staged. None while unfinished."""
        if snap.uploaded < len(snap.hashes) or not snap.hashes:
            part = snap.hashes[snap.uploaded : snap.uploaded + SNAPSHOT_SLICE]
            self._store.stage_blocks(self.replica_id, part, fresh=snap.uploaded == 0)
            snap.uploaded += len(part)
            if snap.uploaded < len(snap.hashes):
                return None
        return self._store.commit_staged_blocks(self.replica_id, len(snap.hashes), seq=snap.seq)

    def _requeue(self, item: _Events | _Snapshot, generation: int) -> None:
        with self._cond:  # put it back at the front, unless the queue was discarded meanwhile
            if generation == self._generation:
                self._queue.appendleft(item)
                if isinstance(item, _Events):
                    self._queued_events += len(item.events)

    def _shutdown(self) -> None:
        try:
            if self._deregister:
                self._store.deregister_replica(self.replica_id)
            elif not self.superseded:
                self._drain()
                self._beat()
        except _REDIS_ERRORS as e:
            logger.warning(
                "presence: could not %s on stop (%s)", "deregister" if self._deregister else "flush", e
            )
        except SupersededError:
            pass
