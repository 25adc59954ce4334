"""The traffic that runs all along the gateway-under-abuse attacks (``bench/adversarial.py``) and its checks:
a bystander tenant's ordinary requests (a thread of its own), slow readers and clients that vanish
mid-stream.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from bench._adversarial_http import StreamOutcome, sse_stream
from bench._adversarial_run import Run, auth, completion, count

BYSTANDER_P99_S = 2.0


class Bystander(threading.Thread):
    """Another tenant's ordinary traffic on a thread of its own (its latencies are not the attacks' client
    time): a small completion, a model list, a health check, in turn.

    ``records``: (start, seconds, status) per request."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.records: list[tuple[float, float, int | str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=auth(self.key), timeout=30) as c:
            calls = (lambda: c.post("/v1/completions", json=completion(2)), lambda: c.get("/v1/models"),
                     lambda: c.get("/health"))  # fmt: skip
            i = 0
            while not self.stop.wait(0.03):
                t0 = time.monotonic()
                try:
                    status: int | str = calls[i % len(calls)]().status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.records.append((t0, time.monotonic() - t0, status))
                i += 1

    def between(self, t0: float, t1: float) -> list[tuple[float, float, int | str]]:
        """The requests that were in flight at some point of [t0, t1]."""
        return [r for r in self.records if r[0] <= t1 and r[0] + r[1] >= t0]


async def background_streams(run: Run, key: str, stop: asyncio.Event) -> list[tuple[str, StreamOutcome]]:
    """Slow readers and vanishing clients, each in a loop until ``stop``."""
    outcomes: list[tuple[str, StreamOutcome]] = []

    async def slow() -> None:
        while not stop.is_set():
            outcomes.append(("slow", await sse_stream(run.url, key, completion(80), read_rate=4096)))

    async def vanish(i: int) -> None:
        n = 0
        while not stop.is_set():
            out = await sse_stream(
                run.url, key, completion(300), leave_after=3 + n % 5, reset=(i + n) % 2 == 0
            )
            outcomes.append(("vanish", out))
            n += 1
            await asyncio.sleep(0.1)

    await asyncio.gather(*(slow() for _ in range(3)), *(vanish(i) for i in range(2)))
    return outcomes


def check_background(run: Run, a: str, outcomes: list[tuple[str, StreamOutcome]]) -> None:
    run.seen(a, *(o.status for _, o in outcomes))
    slow = [o for kind, o in outcomes if kind == "slow"]
    vanished = [o for kind, o in outcomes if kind == "vanish"]
    bad_slow = [o for o in slow if not (o.status == 200 and o.done and o.error is None and o.failure is None)]
    run.check(a, f"{len(slow)} slow readers: each to [DONE]", slow and not bad_slow, bad_slow[:2])
    bad_gone = [o for o in vanished if not (o.status == 200 and o.left and o.failure is None)]
    run.check(a, f"{len(vanished)} clients vanished mid-stream", vanished and not bad_gone, bad_gone[:2])


def check_bystander(run: Run, a: str, bystander: Bystander) -> None:
    statuses = [s for _, _, s in bystander.records]
    run.seen(a, *statuses)
    latencies = sorted(d for _, d, _ in bystander.records)
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    worst = latencies[-1] if latencies else float("nan")
    run.check(a, "all 200", statuses and all(s == 200 for s in statuses), count(statuses))
    run.check(a, f"p99 < {BYSTANDER_P99_S:g} s", p99 < BYSTANDER_P99_S, f"p99 {p99:.3f} s, max {worst:.3f} s")
