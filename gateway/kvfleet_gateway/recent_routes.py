"""What this gateway routed recently: block hash -> the replicas it sent that prefix to.

The KV index in Redis is exact but late. An engine publishes a block only after the step that computed
it, so while the first request of a new prompt group is still queued or prefilling, the index shows no
replica holding the group's prefix. In a burst (a new system prompt, a fleet just started), every
request of the group arrives in that window, looks uncached everywhere and lands on whichever replica is
least loaded: the group scatters over the fleet and each replica computes the same prefix.

The gateway knows better the moment it routes: the prefix *will* be on that replica. ``RecentRoutes``
remembers that for ``ttl`` seconds (long enough for a queued prefill to happen and the index to catch
up, short enough that an evicted prefix is not believed for long), and the proxy takes, per candidate,
the larger of the index's match and this one. Only this gateway's routes are known here; the other
gateways' show up in the index a step later, which is the lag this closes for a burst arriving through
one gateway (with several, each gateway's share of a group stays together).

Pure data structure: the caller passes the time. Memory is bounded by ``max_hashes`` (least recently
routed forgotten first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_TTL_S = 30.0
DEFAULT_MAX_HASHES = 200_000


class RecentRoutes:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_hashes: int = DEFAULT_MAX_HASHES) -> None:
        if not ttl_s >= 0 or max_hashes < 1:
            raise ValueError("ttl_s must be >= 0 (0: remember nothing) and max_hashes at least 1")
        self.ttl_s = ttl_s
        self.max_hashes = max_hashes
        # block hash -> {replica id: when the memory of routing it there expires}; oldest-routed first
        self._where: OrderedDict[bytes, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def record(self, replica_id: str, hashes: Sequence[bytes], now: float) -> None:
        """``hashes`` (a prompt's leading full blocks) were just sent to ``replica_id``."""
        if self.ttl_s == 0:
            return
        until = now + self.ttl_s
        where = self._where
        while where and max(next(iter(where.values())).values()) <= now:  # the least recently routed expired
            where.popitem(last=False)
        for h in hashes:
            replicas = where.get(h)
            if replicas is None:
                where[h] = {replica_id: until}
            else:
                replicas[replica_id] = until
                where.move_to_end(h)
        while len(where) > self.max_hashes:
            where.popitem(last=False)

    def matched_blocks(self, replica_id: str, hashes: Sequence[bytes], now: float) -> int:
        """How many leading ``hashes`` were routed to ``replica_id`` within the last ``ttl`` seconds."""
        n = 0
        for h in hashes:
            replicas = self._where.get(h)
            until = replicas.get(replica_id) if replicas else None
            if until is None or until <= now:
                break
            n += 1
        return n

    def forget(self, replica_id: str, hashes: Sequence[bytes] | None = None) -> None:
        """Drop what was routed to ``replica_id`` (a request that never reached it; a replica that died or
        went to sleep and lost its cache): of ``hashes`` only, or everything."""
        keys = self._where.keys() if hashes is None else hashes
        for h in list(keys):
            replicas = self._where.get(h)
            if replicas and replicas.pop(replica_id, None) is not None and not replicas:
                del self._where[h]
