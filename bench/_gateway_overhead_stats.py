"""The gateway overhead benchmark's statistics (``bench/gateway_overhead.py``): per side distributions of every
measure (``MEASURES``), the latency the gateway adds (pooled, paired, per round pair), the counters per
request, and the per-request table of the JSON. Latencies in milliseconds.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from bench import _serve_common as sc
from bench._gateway_overhead_load import Sample


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)


def dist(values: Sequence[float]) -> dict[str, Any]:
    return {"n": len(values), "mean": _ms(statistics.fmean(values)) if values else None,
            **{f"p{q}": _ms(sc.percentile(values, q)) for q in (50, 90, 99)},
            "max": _ms(max(values)) if values else None}  # fmt: skip


def _outside(total: float | None, inside: float | None) -> float | None:
    return None if total is None or inside is None else total - inside


# What each distribution reads from a sample. "outside": what the client saw minus the replica's own time
# for the same request (its handler's arrival -> first token / end), i.e. the time spent in the HTTP
# stack, the network and the gateway. The replica's step clock cancels out of it: a request that lands
# just after a decode step boundary waits a whole step, which is inside the replica's time.
MEASURES: dict[str, Callable[[Sample], float | None]] = {
    "ttft_ms": lambda s: s.ttft,
    "e2e_ms": lambda s: s.e2e,
    "ttft_outside_ms": lambda s: _outside(s.ttft, s.engine_ttft),
    "e2e_outside_ms": lambda s: _outside(s.e2e, s.engine_e2e),
}


def side_stats(samples: Sequence[Sample], sides: Sequence[str] = ("direct", "gateway")) -> dict[str, Any]:
    """Per side: the distribution of every measure in ``MEASURES``; added = gateway - direct for each
    percentile; paired differences (same round, client and index) summarised by their median and p99.
    With more routed sides than the gateway (a peer router), ``added_ms_by_side`` and ``paired_ms_by_side``
    hold the same for every side but direct (the gateway's included)."""
    out: dict[str, Any] = {}
    for side in sides:
        mine = [s for s in samples if s.side == side]
        ok = [s for s in mine if s.ok]
        errors = Counter((s.error or "?")[:120] for s in mine if not s.ok)
        out[side] = {"requests": len(mine), "ok": len(ok), "errors": dict(errors),
                     "with_engine_timing": sum(s.engine_ttft is not None for s in ok),
                     **{m: dist([v for s in ok if (v := f(s)) is not None]) for m, f in MEASURES.items()}}  # fmt: skip
    key = {(s.round, s.client, s.index): s for s in samples if s.side == "direct" and s.ok}
    by_side = {side: _added(out, samples, key, side) for side in sides if side != "direct"}
    out["added_ms"], out["paired_ms"] = by_side["gateway"]
    if len(by_side) > 1:
        out["added_ms_by_side"] = {side: a for side, (a, _) in by_side.items()}
        out["paired_ms_by_side"] = {side: p for side, (_, p) in by_side.items()}
    return out


def _added(
    out: dict[str, Any], samples: Sequence[Sample], direct: dict[tuple[int, int, int], Sample], side: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``side``'s percentiles minus direct's (pooled), and its paired differences with the direct request
    of the same round, client and index (median and p99)."""
    added: dict[str, Any] = {}
    for metric in MEASURES:
        d, g = out["direct"][metric], out[side][metric]
        added[metric] = {q: (None if d[q] is None or g[q] is None else round(g[q] - d[q], 3))
                         for q in ("mean", "p50", "p90", "p99")}  # fmt: skip
    pairs: dict[str, list[float]] = {m: [] for m in MEASURES}
    for s in samples:
        d = direct.get((s.round, s.client, s.index))
        if s.side == side and s.ok and d is not None:
            for m, f in MEASURES.items():
                a, b = f(s), f(d)
                if a is not None and b is not None:
                    pairs[m].append(a - b)
    paired = {m: {"n": len(v), "p50": _ms(sc.percentile(v, 50)), "p99": _ms(sc.percentile(v, 99))}
              for m, v in pairs.items()}  # fmt: skip
    return added, paired


def per_request(counters: dict[str, Any], n: int) -> dict[str, Any]:
    if not n:
        return {}
    return {
        "requests": n,
        "gateway_redis_round_trips": {
            "request_path": counters.get("request_trips", 0) / n,
            "background": counters.get("background_trips", 0) / n,
            "by_op": {k: v / n for k, v in counters.get("trips_by_op", {}).items()},
        },
        "redis_commands": {
            "total": counters.get("redis", {}).get("total", 0) / n,
            "by_command": {k: v / n for k, v in counters.get("redis", {}).get("calls", {}).items()},
        },
        "cpu_ms": {
            k.removeprefix("cpu_"): 1e3 * counters.get(k, 0) / n
            for k in ("cpu_gateway", "cpu_engine", "cpu_client", "cpu_peer")
            if k != "cpu_peer" or k in counters  # only with a peer router in the run
        },
    }


def request_path(samples: Sequence[Sample]) -> dict[str, Any]:
    """The gateway's request path (arrival -> upstream request sent, its per-request log) over ``samples``."""
    return dist([s.gateway_overhead for s in samples if s.gateway_overhead is not None])


def request_table(samples: Sequence[Sample]) -> dict[str, Any]:
    """Every measured request, one row each (for looking at the tails: when, which side, inside or outside
    the replica); times in ms, ``start``: into its round."""
    fields = ["side", "round", "client", "index", "start_ms", "ttft_ms", "e2e_ms", "engine_ttft_ms",
              "engine_e2e_ms", "gateway_overhead_ms", "gateway_ttft_ms", "error"]  # fmt: skip
    rows = [[s.side, s.round, s.client, s.index, _ms(s.start), _ms(s.ttft), _ms(s.e2e), _ms(s.engine_ttft),
             _ms(s.engine_e2e), _ms(s.gateway_overhead), _ms(s.gateway_ttft), s.error] for s in samples]  # fmt: skip
    return {"fields": fields, "rows": rows}


def add_round_percentiles(rounds: list[dict[str, Any]], samples: Sequence[Sample]) -> None:
    """p50 and p99 of every measure in each round's entry (``"ttft_ms": {"p50", "p99"}``, ...)."""
    for r in rounds:
        ok = [s for s in samples if s.ok and s.side == r["side"] and s.round == r["round"]]
        for m, f in MEASURES.items():
            values = [v for s in ok if (v := f(s)) is not None]
            r[m] = {f"p{q}": _ms(sc.percentile(values, q)) for q in (50, 99)}


def pair_differences(rounds: list[dict[str, Any]], side: str = "gateway") -> list[dict[str, Any]]:
    """``side`` minus direct p50 and p99 of every measure within each round pair (the rounds of a set run
    back to back): ``{"round": k, "ttft_ms": {"p50": .., "p99": ..}, ...}``; None where a side has no figure."""
    by = {(r["round"], r["side"]): r for r in rounds}
    out = []
    for k in sorted({r["round"] for r in rounds}):
        d, g = by.get((k, "direct")), by.get((k, side))
        if d and g:
            out.append({"round": k, **{m: {q: None if d[m][q] is None or g[m][q] is None
                                               else round(g[m][q] - d[m][q], 3) for q in ("p50", "p99")}
                                           for m in MEASURES if m in d and m in g}})  # fmt: skip
    return out
