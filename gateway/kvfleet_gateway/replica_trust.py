"""Which replicas the gateway trusts with traffic and admin calls, and the admin token each model's get.

With the platform's replica key root (``--replica-key-root``), a replica counts only while its heartbeat
verifies (``kvfleet_common.replica_credentials``): signed by an engine holding its model's key, for the URL it
names, recently. Every other heartbeat is left out of the fleet snapshot and the admin API's targets, so it gets
no request and no credential; it is counted (``kvfleet_gateway_unverified_replicas``) and logged, at most once
a minute per replica. Wake and sleep calls carry the model's derived admin token, never the platform token.

Without a root (local development only) every heartbeat is trusted and engines get the platform admin token:
the behaviour before replica credentials existed, announced by a warning at start.
"""

from __future__ import annotations

import logging
import time

from kvfleet_common.replica_credentials import ReplicaKeyRing
from kvfleet_common.schemas import Heartbeat

logger = logging.getLogger(__name__)

WARN_INTERVAL_S = 60.0


class ReplicaTrust:
    def __init__(
        self, root: bytes | None, platform_admin_token: str | None, warn_interval: float = WARN_INTERVAL_S
    ):
        self._keys = ReplicaKeyRing(root) if root is not None else None
        self._platform_admin_token = platform_admin_token
        self._warn_interval = warn_interval
        self._warned_at: dict[str, float] = {}  # replica id -> monotonic time of its last warning

    @property
    def verifying(self) -> bool:
        return self._keys is not None

    def split(
        self, replicas: list[Heartbeat], now: float | None = None
    ) -> tuple[list[Heartbeat], list[Heartbeat]]:
        """(verified, unverified) replicas; each unverified one is logged (rate-limited)."""
        if self._keys is None:
            return list(replicas), []
        now = time.time() if now is None else now
        verified, unverified = [], []
        for hb in replicas:
            fault = self._keys.fault(hb, now)
            if fault is None:
                verified.append(hb)
            else:
                unverified.append(hb)
                self._warn(hb, fault)
        return verified, unverified

    def verified(self, replicas: list[Heartbeat]) -> list[Heartbeat]:
        return self.split(replicas)[0]

    def admin_token(self, model: str) -> str | None:
        """The bearer token of ``model``'s engine admin endpoints (None: this gateway has none)."""
        if self._keys is None:
            return self._platform_admin_token
        return self._keys.admin_token(model)

    def _warn(self, hb: Heartbeat, fault: str) -> None:
        mono = time.monotonic()
        last = self._warned_at.get(hb.replica_id)
        if last is not None and mono - last < self._warn_interval:
            return
        if len(self._warned_at) > 10_000:  # many forged ids: forget the old ones rather than grow
            self._warned_at = {r: t for r, t in self._warned_at.items() if mono - t < self._warn_interval}
        self._warned_at[hb.replica_id] = mono
        logger.warning("ignoring replica %r of model %r at %r: its heartbeat does not verify (%s); it gets no "
                       "traffic and no credentials", hb.replica_id, hb.model, hb.base_url, fault)  # fmt: skip
