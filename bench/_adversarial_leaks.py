"""The gateway-under-abuse run's leak checks and shutdown (``bench/adversarial.py``): no 5xx anywhere, no
lease left in Redis, every replica idle with its KV blocks back, the gateway's in-flight gauge at 0; then
SIGTERM under streams, and no process of the fleet left.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from bench import _fleet_metrics as fleet_metrics
from bench import _servers as servers
from bench._adversarial_http import sse_stream
from bench._adversarial_run import GATEWAY_GRACE_S, REPLICA_GRACE_S, Run, completion, wait_for
from kvfleet_common import redis_keys

EXIT_MARGIN_S = 2.0  # a SIGTERMed process must be gone within its grace + this
SETTLE_S = redis_keys.LEASE_TTL_S + 2.0  # bounded wait for the leases and gauges to come back


def five_xx(statuses: dict[str, float] | Counter) -> int:
    return int(sum(n for s, n in statuses.items() if str(s).startswith("5")))


async def leak_checks(run: Run, when: str, expected_gateway_5xx: int) -> None:
    c = f"leaks {when}"
    client = sum(five_xx(s) for s in run.statuses.values())
    run.check(c, "no 5xx answered to a client", client == 0, f"{client} 5xx")
    by_status = fleet_metrics.metric_by(
        fleet_metrics.scrape(run.url), "kvfleet_gateway_requests_total", "status"
    )
    gw = run.five_xx["gateway"] = five_xx(by_status)
    run.check(c, "gateway: no 5xx but the streams the kill cut", gw == expected_gateway_5xx,
              f"{gw} 5xx, {expected_gateway_5xx} expected; by status {count_floats(by_status)}")  # fmt: skip
    ok, took = await wait_for(lambda: run.leases() == 0, SETTLE_S, 0.1)
    run.check(c, "Redis: no kvf:inflight:* lease", ok, f"{run.leases()} left after {took:.1f} s")

    def gauge() -> float:
        return fleet_metrics.metric_sum(fleet_metrics.scrape(run.url), "kvfleet_gateway_inflight_requests")

    ok, took = await wait_for(lambda: gauge() == 0, SETTLE_S, 0.1)
    run.check(c, "gateway in-flight gauge 0", ok, f"{gauge():g} after {took:.1f} s")
    replica_5xx = 0
    for name, e in run.replicas.items():
        url = e.command.base_url

        def idle(url: str = url) -> tuple[float, float, float, float]:
            s = fleet_metrics.scrape(url)
            return (fleet_metrics.metric_sum(s, "kvfleet_engine_num_requests_running"),
                    fleet_metrics.metric_sum(s, "kvfleet_engine_num_requests_waiting"),
                    fleet_metrics.metric_sum(s, "kvfleet_engine_kv_cache_free_blocks"),
                    five_xx(fleet_metrics.metric_by(s, "kvfleet_engine_requests_total", "status")))  # fmt: skip

        start = run.free_blocks_at_start[name]
        ok, took = await wait_for(lambda f=idle, b=start: f()[:3] == (0, 0, b), SETTLE_S, 0.1)
        running, waiting, free, errors = idle()
        run.check(c, f"{name}: 0 running, 0 waiting", running == waiting == 0,
                  f"{running:g} running, {waiting:g} waiting after {took:.1f} s")  # fmt: skip
        run.check(c, f"{name}: free KV blocks back to {start:g}", free == start, f"{free:g} free")
        run.check(c, f"{name}: no 5xx", errors == 0, f"{errors} 5xx")
        replica_5xx += errors
    run.five_xx.update(client=client, replicas=replica_5xx, gateway_expected=expected_gateway_5xx)


def count_floats(d: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(d.items())}


def alive(pid: int) -> bool:
    return servers._state(pid) not in (None, "Z")


def sigterm_and_wait(p: servers.ServerProcess, bound_s: float) -> tuple[float | None, int | None]:
    """SIGTERM ``p``'s process group; seconds until every process of it exited (None: not within
    ``bound_s`` + 10 s, then it is SIGKILLed) and the leader's exit code."""
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    gone = None
    while time.monotonic() - t0 < bound_s + 10:
        if p.proc is not None and p.proc.poll() is not None and not servers._group_alive(p.pid):
            gone = time.monotonic() - t0
            break
        time.sleep(0.05)
    return gone, p.stop(grace_s=0.5, linger_s=0.5)


async def shutdown(run: Run) -> None:
    """SIGTERM the gateway under 3 streams longer than its grace, then the replicas; nothing may be left."""
    c = "shutdown"
    fl = run.fl
    assert fl.gateway is not None
    pids = [*servers.process_tree(fl.gateway.pid), *run.victim_pids]
    for e in run.replicas.values():
        pids += servers.process_tree(e.pid)
    key = await run.tenant("drain")
    starts = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(sse_stream(run.url, key, completion(400), started=s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    bound = GATEWAY_GRACE_S + EXIT_MARGIN_S
    gone, code = await asyncio.to_thread(sigterm_and_wait, fl.gateway, bound)
    fl.gateway = None
    run.check(c, f"gateway exits within {bound:g} s", gone is not None and gone < bound,
              f"{gone if gone is None else round(gone, 2)} s, exit code {code}")  # fmt: skip
    run.check(c, "gateway exit code 0 (or -SIGTERM)", code in (0, -signal.SIGTERM), code)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    run.seen(c, *(o.status for o in outs))
    bad = [o for o in outs if not (o.done and o.error and o.error.get("code") == "gateway_shutdown")]
    run.check(c, "its 3 streams: gateway_shutdown event + [DONE]", not bad, bad[:2])
    run.check(c, "Redis: no lease left by the gateway", run.leases() == 0, f"{run.leases()} leases")
    bound = REPLICA_GRACE_S + EXIT_MARGIN_S
    engines = list(run.replicas.values())
    with ThreadPoolExecutor(max(1, len(engines))) as pool:
        results = list(pool.map(lambda e: sigterm_and_wait(e, bound), engines))
    fl.engines = []
    for name, (gone, code) in zip(run.replicas, results):
        run.check(c, f"{name} exits within {bound:g} s", gone is not None and gone < bound,
                  f"{gone if gone is None else round(gone, 2)} s, exit code {code}")  # fmt: skip
    left = [p for p in pids if alive(p)]
    run.check(c, "no process of the fleet left", not left, f"{len(pids)} processes; left: {left}")
