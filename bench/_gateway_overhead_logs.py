"""The servers' own timing of each request of the gateway overhead benchmark (``bench/gateway_overhead.py``),
read from their per-request INFO log lines by the request's ``X-Request-Id``: the replica's (arrival at its
handler -> first token / last chunk) and the gateway's (arrival -> upstream request sent / first event
relayed).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench._gateway_overhead_load import Sample

# the replica's per-request INFO line (kvfleet_engine.server.serving)
ENGINE_LOG_LINE = re.compile(
    r" (?:chat|completions) (gwo-\S+) model=\S+ status=200 .*? ttft=([\d.]+)ms e2e=([\d.]+)ms"
)
# the gateway's per-request INFO line (kvfleet_gateway.proxy): overhead = arrival -> upstream request sent
GATEWAY_LOG_LINE = re.compile(
    r"(gwo-\S+) tenant=\S+ model=\S+ \S+ status=200 .*? overhead=([\d.]+)ms ttft=([\d.]+)ms"
)


def engine_timings(log_path: Path) -> dict[str, tuple[float, float]]:
    """Request id -> the replica's own (TTFT, E2E) in seconds, from its log."""
    return _log_timings(log_path, ENGINE_LOG_LINE)


def gateway_timings(log_path: Path) -> dict[str, tuple[float, float]]:
    """Request id -> the gateway's own (arrival -> upstream request sent, arrival -> first event relayed)."""
    return _log_timings(log_path, GATEWAY_LOG_LINE)


def _log_timings(log_path: Path, line: re.Pattern[str]) -> dict[str, tuple[float, float]]:
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {m[1]: (float(m[2]) / 1e3, float(m[3]) / 1e3) for m in line.finditer(text)}


def attach_engine_timings(samples: Sequence[Sample], log_path: Path, wait_s: float = 10.0) -> int:
    """Fill ``engine_ttft`` / ``engine_e2e`` of every successful sample the replica logged. Returns how many
    are missing."""
    wanted = [s for s in samples if s.ok]
    timings = _await_lines(wanted, log_path, engine_timings, wait_s)
    for s in samples:
        if (t := timings.get(s.request_id)) is not None:
            s.engine_ttft, s.engine_e2e = t
    return sum(s.request_id not in timings for s in wanted)


def attach_gateway_timings(samples: Sequence[Sample], log_path: Path, wait_s: float = 10.0) -> int:
    """Fill ``gateway_overhead`` / ``gateway_ttft`` of the gateway side's successful samples. Returns how
    many are missing."""
    wanted = [s for s in samples if s.ok and s.side == "gateway"]
    timings = _await_lines(wanted, log_path, gateway_timings, wait_s)
    for s in wanted:
        if (t := timings.get(s.request_id)) is not None:
            s.gateway_overhead, s.gateway_ttft = t
    return sum(s.request_id not in timings for s in wanted)


def _await_lines(
    wanted: Sequence[Sample],
    log_path: Path,
    read: Callable[[Path], dict[str, tuple[float, float]]],
    wait_s: float,
) -> dict[str, tuple[float, float]]:
    """``read(log_path)`` once every wanted request has its line, or after ``wait_s``: a server logs a
    request just after its last chunk, so the last lines may trail the clients a little."""
    deadline = time.monotonic() + wait_s
    while True:
        timings = read(log_path)
        if all(s.request_id in timings for s in wanted) or time.monotonic() > deadline:
            return timings
        time.sleep(0.2)
