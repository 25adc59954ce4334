"""The gateway-under-abuse run's bookkeeping (``bench/adversarial.py``): the fleet's settings, ``Run`` (the
statuses every attack saw and its checks, a tenant of its own per attack and round, the leases in Redis),
OpenAI error-shape predicates and the request bodies the attacks send.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench import _common as common
from bench import _fleet as fleet_mod
from bench import _servers as servers
from kvfleet_common import redis_keys

MODEL = "sim"
MAX_MODEL_LEN = 512
PROMPT = [100, 101, 102]  # token ids: the gateway's estimate of the prompt is exact
GATEWAY_GRACE_S = 2.0
REPLICA_GRACE_S = 2.0
ERROR_KEYS = {"message", "type", "param", "code"}


def openai_error(body: Any, kind: str) -> bool:
    """``body`` is OpenAI's error object of type ``kind``."""
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and set(err) == ERROR_KEYS and err["type"] == kind


def rate_limited(body: Any, headers: Any) -> bool:
    """OpenAI's 429: a ``rate_limit_error`` and a ``Retry-After`` of at least a second."""
    retry = headers.get("retry-after", "") if headers is not None else ""
    return openai_error(body, "rate_limit_error") and retry.isdigit() and int(retry) >= 1


def json_or_none(r: httpx.Response | bytes) -> Any:
    try:
        return json.loads(r) if isinstance(r, bytes) else r.json()
    except ValueError:
        return None


def count(values: Sequence[Any]) -> dict[str, int]:
    return {str(k): n for k, n in sorted(Counter(str(v) for v in values).items())}


@dataclass
class Run:
    fl: fleet_mod.Fleet
    args: argparse.Namespace
    http: httpx.AsyncClient
    statuses: dict[str, Counter] = field(default_factory=dict)
    checks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    round: int = 0
    replicas: dict[str, servers.ServerProcess] = field(default_factory=dict)  # by replica name (sim-<i>)
    free_blocks_at_start: dict[str, float] = field(default_factory=dict)
    victim_pids: list[int] = field(default_factory=list)
    five_xx: dict[str, int] = field(default_factory=dict)  # the last leak check's counts

    @property
    def url(self) -> str:
        return self.fl.gateway_url

    def replica(self, replica_id: str | None) -> servers.ServerProcess | None:
        """The live replica behind an ``x-kvfleet-replica`` header (``<name>#<epoch>``)."""
        return self.replicas.get((replica_id or "").split("#")[0])

    def seen(self, attack: str, *statuses: int | str) -> None:
        self.statuses.setdefault(attack, Counter()).update(str(s) for s in statuses)

    def check(self, attack: str, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.setdefault(attack, []).append({"name": name, "ok": bool(ok), "detail": str(detail)})
        if not ok:
            common.log(f"FAIL [{attack}] {name}: {detail}")
        return bool(ok)

    async def tenant(self, name: str, **limits: int) -> str:
        r = await self.http.post("/admin/tenants", json={"name": f"{name}-r{self.round}", **limits},
                                 headers=admin_auth())  # fmt: skip
        if r.status_code != 201:
            raise RuntimeError(f"creating tenant {name!r}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()["api_key"]

    def leases(self, tenant: str | None = None) -> int:
        redis = self.fl.redis.client()  # type: ignore[union-attr]
        if tenant is not None:
            return redis.zcard(redis_keys.inflight(f"{tenant}-r{self.round}"))
        return sum(redis.zcard(k) for k in redis.scan_iter(match="kvf:inflight:*"))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin_auth() -> dict[str, str]:
    return auth(fleet_mod.ADMIN_TOKEN)


def completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


async def wait_for(
    predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05
) -> tuple[bool, float]:
    """Poll ``predicate`` (sync) until true or ``timeout_s``; returns (became true, seconds waited)."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return False, time.monotonic() - t0
        await asyncio.sleep(interval_s)
