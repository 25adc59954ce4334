"""Process-level metrics every server exports next to its own: CPU, memory, garbage collection, loop lag.

Each server keeps a private Prometheus registry (several servers share one test process), so the
collectors prometheus_client puts on its default registry (``process_*``, ``python_gc_*``,
``python_info``) are added explicitly.

Event-loop lag is the time a ready callback waits before the loop runs it: every request on the loop
waits that long too, at each step. It is what showed a gateway spending 40-130 ms in full garbage
collections and what grows first when a process runs out of CPU, so it gets its own histogram.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, GCCollector, Histogram, PlatformCollector, ProcessCollector

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_INTERVAL_S = 0.1


def add_process_collectors(registry: CollectorRegistry) -> None:
    """``process_*`` (CPU seconds, resident memory, open fds), ``python_gc_*``, ``python_info``."""
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def loop_lag_histogram(prefix: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(
        f"{prefix}_event_loop_lag_seconds",
        f"How late the event loop ran a timer due every {LAG_INTERVAL_S:g} s (time every request on it waits)",
        buckets=LAG_BUCKETS, registry=registry,
    )  # fmt: skip


async def watch_loop_lag(histogram: Histogram, interval_s: float = LAG_INTERVAL_S) -> None:
    """Sleep ``interval_s`` again and again; observe how much later than due each wake-up came. Runs until
    cancelled (one timer per interval: nothing measurable)."""
    while True:
        due = time.perf_counter() + interval_s
        await asyncio.sleep(interval_s)
        histogram.observe(max(0.0, time.perf_counter() - due))
