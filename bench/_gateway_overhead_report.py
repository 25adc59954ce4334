"""The gateway overhead benchmark's verdicts and printed table (``bench/gateway_overhead.py``): the issue's
limits on the added latency and the Redis round trips, and the table of both sides with its notes.
"""

from __future__ import annotations

from typing import Any

from bench import _common as common
from bench._gateway_overhead_peer import notes as peer_notes
from bench._gateway_overhead_stats import MEASURES

TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0
TARGET_REDIS_ROUND_TRIPS = 2.0


def _f(x: Any, digits: int = 2, sign: str = "") -> str:
    return "-" if x is None else f"{x:{sign},.{digits}f}"


def _within(d: dict[str, float | None]) -> bool:
    return (d["p50"] is not None and d["p50"] <= TARGET_P50_MS and d["p99"] is not None
            and d["p99"] <= TARGET_P99_MS)  # fmt: skip


def added_latency_verdict(
    added: dict[str, Any], pairs: list[dict[str, Any]], ttft: str, e2e: str
) -> dict[str, Any]:
    """The limits on the pooled p50 and p99 added to TTFT and E2E, as measured by ``ttft`` and ``e2e`` (keys of
    ``MEASURES``). Met only if those are under the limits *and* every round pair agrees on TTFT: on a noisy
    machine the pooled figure can land under the limit by chance while single pairs differ by tens of ms
    either way (then the run shows nothing: inconclusive)."""
    pooled_ok = _within(added[ttft]) and _within(added[e2e])
    every_pair_ok = all(_within(d[ttft]) for d in pairs)
    a = {m: added[m] for m in (ttft, e2e)}
    return {
        "met": pooled_ok and every_pair_ok, "inconclusive": pooled_ok and not every_pair_ok,
        "detail": f"TTFT p50 {_f(a[ttft]['p50'], 2, '+')} ms, p99 {_f(a[ttft]['p99'], 2, '+')} ms; "
                  f"E2E p50 {_f(a[e2e]['p50'], 2, '+')} ms, p99 {_f(a[e2e]['p99'], 2, '+')} ms "
                  f"(limits {TARGET_P50_MS:g} / {TARGET_P99_MS:g} ms); per round pair TTFT p50 / p99 "
                  + ", ".join(f"{_f(d[ttft]['p50'], 1, '+')} / {_f(d[ttft]['p99'], 1, '+')}" for d in pairs) + " ms",
    }  # fmt: skip


def render(result: dict[str, Any]) -> None:
    rows = []
    w = result["workload"]
    sections = [(f"{w['concurrency']} streams, {w['load']}", result["stats"])]
    if result["reference"]["direct"]["requests"]:
        sections.append(("sequential reference", result["reference"]))
    for label, stats in sections:
        added = stats.get("added_ms_by_side") or {"gateway": stats["added_ms"]}
        for side in ("direct", *added):
            s = stats[side]
            rows.append([label, side, f"{s['ok']}/{s['requests']}",
                         *(_f(s[m][q]) for m in MEASURES for q in ("p50", "p99"))])  # fmt: skip
        for side, a in added.items():
            rows.append(
                [
                    label,
                    f"added ({side} - direct)",
                    "",
                    *(_f(a[m][q]) for m in MEASURES for q in ("p50", "p99")),
                ]
            )
    notes = []
    pr, direct = result["per_gateway_request"], result["per_direct_request"]
    if pr:
        t = pr["gateway_redis_round_trips"]
        by_op = ", ".join(f"{k} {v:.3f}" for k, v in t["by_op"].items())
        notes.append(f"gateway Redis round trips per request: {t['request_path']:.3f} on the request path ({by_op}), "
                     f"{t['background']:.3f} background")  # fmt: skip
        notes.append(f"Redis commands per request: {pr['redis_commands']['total']:.2f} through the gateway, "
                     f"{direct.get('redis_commands', {}).get('total', 0):.2f} direct (the replica's own heartbeats and "
                     "KV events)")  # fmt: skip
        g, d = pr["cpu_ms"], direct["cpu_ms"]
        notes.append(f"CPU ms per request: gateway {g['gateway']:.2f}, engine {g['engine']:.2f}, client "
                     f"{g['client']:.2f} (through the gateway); engine {d['engine']:.2f}, client {d['client']:.2f} "
                     "(direct)")  # fmt: skip
    if w["load"] == "paced":
        flight = [r["streams_in_flight"] for r in result["rounds"] if r["streams_in_flight"]]
        notes.append(f"paced load: {w['arrival_rate_per_s']:.1f} requests/s (Poisson), streams in flight per round: "
                     + ", ".join(f"mean {f['mean']:.0f} / peak {f['peak']}" for f in flight)
                     + f"; {w['replica']}")  # fmt: skip
    ro, rr = result["gateway_request_path_ms"], result["reference_request_path_ms"]
    if ro["n"]:
        added = result["stats"]["added_ms"]["ttft_outside_ms"]["p50"]
        notes.append(f"gateway's request path (arrival -> upstream request sent, its per-request log): "
                     f"p50 {_f(ro['p50'])} ms, p99 {_f(ro['p99'])} ms in the rounds, of an added TTFT p50 of "
                     f"{_f(added)} ms outside the replica (the rest: the extra hops and the relay)"
                     + (f"; p50 {_f(rr['p50'])} ms sequential" if rr["n"] else ""))  # fmt: skip
    ref_cpu = result["reference_per_gateway_request"].get("cpu_ms")
    if ref_cpu:
        notes.append(f"sequential: gateway CPU {ref_cpu['gateway']:.2f} ms per request")
    p = result["stats"]["paired_ms"]
    notes.append(
        "paired differences (same prompt and slot or arrival time), p50 / p99: "
        + ", ".join(f"{m.removesuffix('_ms')} {_f(p[m]['p50'])} / {_f(p[m]['p99'])} ms" for m in MEASURES)
    )
    for name, t in result["targets"].items():
        verdict = "met" if t["met"] else "NOT met"
        if t.get("inconclusive"):
            verdict = "inconclusive (round pairs disagree)"
        if t.get("measure"):
            name += f" ({t['measure']})"
        notes.append(f"target {name}: {verdict} ({t['detail']})")
    if result["config"]["a_a"]:
        notes.append("A/A calibration (--a-a): both sides went straight to the replica; 'added' is the noise")
    lay = result.get("cpu_layout", {})
    if lay.get("layout") == "isolated":
        notes.append(f"CPU layout isolated: gateway + Redis on CPUs {lay['gateway_and_redis']}, clients + replica "
                     f"on {lay['clients_and_replica']}")  # fmt: skip
    else:
        notes.append("CPU layout shared: clients, replica, gateway and Redis on the same CPUs")
    notes.append(f"load generator's client: {result['config'].get('client', 'httpx')}")
    if "peer" in result:
        notes.extend(peer_notes(result))
    notes.extend(result["notes"])
    common.print_table(
        f"Gateway overhead: {result['command']}",
        ["load", "side", "ok", "TTFT p50", "TTFT p99", "E2E p50", "E2E p99",
         "outside: TTFT p50", "TTFT p99", "E2E p50", "E2E p99"],
        rows,
        ["ms; outside: the client's figure minus the replica's own for the same request (its log), the time"
         " outside the replica's handler and scheduler", *notes],
    )  # fmt: skip
