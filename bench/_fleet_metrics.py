"""What the gateway benchmarks read off a running fleet: Prometheus samples scraped from ``/metrics``
(gateway and engines), Redis's own command counts between two ``BenchRedis.command_stats`` snapshots, and
the CPU seconds of the fleet's process trees (``/proc``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import _servers as servers


@dataclass(slots=True, frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(url: str) -> list[Sample]:
    text = httpx.get(f"{url.rstrip('/')}/metrics", timeout=30).text
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def metric_sum(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def metric_by(samples: Iterable[Sample], name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def command_stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Commands Redis processed between two ``command_stats`` snapshots (the ``INFO`` calls themselves
    excluded: each snapshot is one ``INFO stats`` + one ``INFO commandstats``)."""
    calls = {
        k: n - before["calls"].get(k, 0)
        for k, n in after["calls"].items()
        if n - before["calls"].get(k, 0) > 0
    }
    calls["info"] = calls.get("info", 0) - 2
    if calls["info"] <= 0:
        del calls["info"]
    total = after["total_commands_processed"] - before["total_commands_processed"] - 2
    return {"total": total, "calls": dict(sorted(calls.items(), key=lambda kv: -kv[1]))}


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes and all their descendants so far (``/proc``)."""
    total = 0.0
    tick = 100.0
    with contextlib.suppress(ValueError, OSError, AttributeError):
        import os

        tick = float(os.sysconf("SC_CLK_TCK"))
    for root in pids:
        for p in servers.process_tree(root):
            f = servers._stat_fields(p)  # [state, ppid, pgrp, ...]: utime, stime are fields 14, 15 of stat
            if f is not None:
                total += (int(f[11]) + int(f[12])) / tick
    return total
