"""Gateway under abuse: the hostile inputs of the gateway-under-abuse issue, sent end to end to a live fleet
for a bounded time, then the leak checks.

Fleet (``_fleet.Fleet``): a real Redis, ``--replicas`` (2) simulated engine replicas (``kvfleet engine serve
--simulate``: a decode step costs ``--step-ms``, 20 ms, so a 300-token stream lasts ~6 s) and one ``kvfleet
gateway``, all real processes spoken to over real HTTP. Every attack's tenant is its own (a new one per
round), so one attack's limits never answer for another's.

Attacks, in rounds until ``--duration`` is spent (at least one round):

1. 30 parallel streamed completions for a tenant with ``max_concurrent: 5``: exactly 5 admitted (their
   leases in Redis), 25 refused with OpenAI's 429 shape and a ``Retry-After``; the admitted clients then
   leave mid-stream and every lease goes.
2. 30 parallel completions for a tenant with ``tokens_per_minute: 100`` (3 prompt token ids + 5 tokens
   each: an estimate of 8): the tokens admitted overrun the budget by less than one estimate. (Sent in a
   minute's first 52 s, waiting up to 8 s for one: the sliding window fades the previous minute out.)
3. 10 MiB prompts (a completion and a chat in turn, for a second and at least twice each): each a 400
   within ``HUGE_FAST_S``, while the bystander tenant's requests keep being answered (all 200s, none slower
   than ``BYSTANDER_MAX_DURING_HUGE_S``).
4. A non-streamed completion of 400 tokens whose client leaves after ~1 s: the replica aborts it (its
   request log line says 499), the tenant's only slot is free again.
5. ``--junk-names`` (10,000; quick 2,000) requests naming models nobody serves, one name in 400 (at most
   20) 1 MiB long, pipelined on 4 connections: all 404 with clipped names, ``/metrics`` stays under 1 MiB
   and names none of them.
6-7. Inputs that once gave 500s, and the type confusions: prompt token ids ``[2147483648]`` and
   ``[-8466490113]``, ``max_tokens: 2**64``, ``priority: 2**70``, a lone surrogate (the JSON escape
   ``"\\ud800"`` in raw bytes) in message content, 100,000 nested ``[``, ``stream: "yes"``, ``stream: 1``,
   a prompt of booleans, ``max_tokens`` above the context: all OpenAI 400s.
8. Admin: a tenant named ``org/team`` is a 400; ten concurrent creates of one name make one 201, nine 409.
9. Two ``Authorization`` headers (400/401), ``/%61dmin/tenants`` (not served by the admin API), a tenant's
   ``x-kvfleet-debug: 1`` (no ``x-kvfleet-route`` header).

Meanwhile, for the whole run: a bystander tenant (a thread of its own: small completions, model lists,
health checks; all 200s, p99 under ``BYSTANDER_P99_S``), streams whose clients read slowly (a 4 KiB receive
buffer read at 4 KiB/s: the gateway must wait for them; each ends with ``[DONE]``) and streams whose
clients vanish after a few events (closed or reset).

10. Then a replica is SIGKILLed under 8 streams: each stream it served ends with an SSE error event and
    ``[DONE]``, the others finish, the next requests are served by the survivor.

Leak checks, after the attacks and again after the kill: no 5xx anywhere (the clients' statuses, the
gateway's ``kvfleet_gateway_requests_total`` by status, where the streams the kill cut are the only 5xx
allowed, and each replica's ``kvfleet_engine_requests_total``), no ``kvf:inflight:*`` lease in Redis (after a
bounded wait: the lease TTL), every replica at 0 running and 0 waiting requests with as many free KV
blocks as at the start, the gateway's in-flight gauge at 0, the gateway's RSS (``/proc/<pid>/status``)
grown by less than ``--rss-bound-mib``. Last, SIGTERM under 3 streams: the gateway exits within its grace +
2 s (the streams end with its ``gateway_shutdown`` error event and ``[DONE]``, Redis keeps no lease of
them), the replicas within theirs + 2 s, and no process of the fleet is left.

Prints a table (attack, requests, statuses, result) and the leak checks, writes JSON
(``bench/results/adversarial.json``), exits 1 when any check failed; each failed check is also logged as it
happens (``FAIL [attack] check: detail``), and an attack that raises or hangs past 2 minutes fails its row
with the exception while the run goes on.

    .venv/bin/python -m bench.adversarial             # ~60 s of attacks, ~90 s in all on 2 vCPUs
    .venv/bin/python -m bench.adversarial --quick     # smoke: one round, ~35 s in all
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _fleet as fleet_mod
from bench import _fleet_client as fleet_client
from bench import _fleet_metrics as fleet_metrics
from bench import _servers as servers
from bench._adversarial_attacks import (
    attack_admin,
    attack_client_leaves,
    attack_concurrency,
    attack_headers,
    attack_hostile_bodies,
    attack_huge_prompts,
    attack_junk_names,
    attack_replica_kill,
    attack_tokens_per_minute,
)
from bench._adversarial_leaks import five_xx, leak_checks, shutdown
from bench._adversarial_load import Bystander, background_streams, check_background, check_bystander
from bench._adversarial_run import (
    GATEWAY_GRACE_S,
    MAX_MODEL_LEN,
    MODEL,
    REPLICA_GRACE_S,
    Run,
    auth,
    chat,
    completion,
)

NAME = "adversarial"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p, default_preset="tiny")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 12 s of attacks (one round), 2,000 junk names"
    )
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of attacks and background load (default 60; quick 12): rounds of the attack "
                        "list run while the next one fits, at least one")  # fmt: skip
    p.add_argument("--replicas", type=int, default=2, help="simulated replicas (>= 2: one is killed)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the simulated replicas' decode step")
    p.add_argument("--junk-names", type=int, default=None,
                   help="junk model names a round (default 10,000; quick 2,000)")  # fmt: skip
    p.add_argument("--rss-bound-mib", type=float, default=64.0,
                   help="the gateway's largest allowed RSS growth over the run (default 64 MiB)")  # fmt: skip
    p.add_argument(
        "--log-dir", default=None, help="process logs (default bench/results/logs/adversarial-<time>)"
    )
    p.add_argument("--out", default=None, help="JSON output (default bench/results/adversarial.json)")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = 12.0 if args.quick else 60.0
    if args.junk_names is None:
        args.junk_names = 2_000 if args.quick else 10_000
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one is killed, the survivors serve on)")
    if args.junk_names < 1 or args.duration <= 0 or args.step_ms <= 0:
        p.error("--junk-names, --duration and --step-ms must be positive")
    return args


Attack = Callable[[Run, str], Awaitable[Any]]


async def guarded(run: Run, name: str, step: Callable[[], Awaitable[Any]], timeout_s: float = 120) -> Any:
    """``step()``'s result; one that raises (a hang past ``timeout_s``, a refused connection) fails a check of
    ``name`` and gives None: the run goes on."""
    try:
        return await asyncio.wait_for(step(), timeout_s)
    except Exception as e:
        run.check(name, "ran to its end", False, f"{type(e).__name__}: {e}")
        return None


def rss(pid: int) -> int:
    return servers.tree_memory(pid)["rss_bytes"]


async def attack_all(fl: fleet_mod.Fleet, args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    info: dict[str, Any] = {}
    async with fleet_client.make_client(fl.gateway_url, None, timeout_s=120) as http:
        run = Run(fl, args, http)
        run.replicas = {f"sim-{i}": e for i, e in enumerate(fl.engines)}
        for name, e in run.replicas.items():
            run.free_blocks_at_start[name] = fleet_metrics.metric_sum(
                fleet_metrics.scrape(e.command.base_url), "kvfleet_engine_kv_cache_free_blocks"
            )
        bystander_key, streams_key = await run.tenant("bystander"), await run.tenant("streams")
        for path, body in (("/v1/completions", completion(2)), ("/v1/chat/completions", chat("warm up"))):
            r = await http.post(path, json=body, headers=auth(bystander_key))  # the tokenizer loaded
            r.raise_for_status()
        assert fl.gateway is not None
        gateway_pid = fl.gateway.pid
        info["rss_start_bytes"] = rss(gateway_pid)

        bystander = Bystander(fl.gateway_url, bystander_key)
        bystander.start()
        stop = asyncio.Event()
        background = asyncio.create_task(background_streams(run, streams_key, stop))

        async def huge_prompts(run: Run, a: str) -> None:
            await attack_huge_prompts(run, a, bystander)

        attacks: list[tuple[str, Attack]] = [
            ("1 max_concurrent 5: 30 at once", attack_concurrency),
            ("2 tokens/min 100: 30 at once", attack_tokens_per_minute),
            ("3 10 MiB prompts", huge_prompts),
            ("4 client leaves a non-stream", attack_client_leaves),
            (f"5 {args.junk_names:,} junk model names", attack_junk_names),
            ("6-7 hostile bodies", attack_hostile_bodies),
            ("8 admin: names, create race", attack_admin),
            ("9 headers, %-paths, debug", attack_headers),
        ]
        t0 = time.monotonic()
        deadline = t0 + args.duration
        info["round_s"], info["rss_after_round_mib"] = [], []
        while True:
            t = time.monotonic()
            for name, attack in attacks:
                await guarded(run, name, lambda name=name, attack=attack: attack(run, name))
            info["round_s"].append(round(time.monotonic() - t, 1))
            info["rss_after_round_mib"].append(round(rss(gateway_pid) / (1 << 20), 1))
            run.round += 1
            common.log(f"round {run.round} done in {info['round_s'][-1]} s")
            if time.monotonic() + info["round_s"][-1] > deadline:
                break
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the background load runs its course
        stop.set()
        bystander.stop.set()
        await asyncio.to_thread(bystander.join, 60)
        info["attack_s"] = round(time.monotonic() - t0, 1)
        streams = "10 slow / vanishing streams"
        outcomes = await guarded(run, streams, lambda: asyncio.wait_for(background, 60)) or []
        check_background(run, streams, outcomes)
        check_bystander(run, "bystander tenant, all along", bystander)

        await guarded(run, "leaks after the attacks", lambda: leak_checks(run, "after the attacks", 0))
        info["rss_after_attacks_bytes"] = rss(gateway_pid)
        kill = "10 replica SIGKILL, 8 streams"
        cut = info["streams_cut_by_the_kill"] = (
            await guarded(run, kill, lambda: attack_replica_kill(run, kill)) or 0
        )
        await guarded(run, "leaks after the kill", lambda: leak_checks(run, "after the kill", cut))
        info["rss_end_bytes"] = rss(gateway_pid)
        start_mib, end_mib = info["rss_start_bytes"] / (1 << 20), info["rss_end_bytes"] / (1 << 20)
        run.check("leaks after the kill", f"gateway RSS grew < {args.rss_bound_mib:g} MiB",
                  end_mib - start_mib < args.rss_bound_mib,
                  f"{start_mib:.0f} -> {end_mib:.0f} MiB ({end_mib - start_mib:+.1f})")  # fmt: skip
        await guarded(run, "shutdown", lambda: shutdown(run))
    return run, info


def render(result: dict[str, Any]) -> None:
    rows = []
    for name, att in result["attacks"].items():
        failed = [c["name"] for c in att["checks"] if not c["ok"]]
        statuses = " ".join(f"{s}:{n:,}" for s, n in att["statuses"].items())
        rows.append([name, att["requests"], statuses, "pass" if att["ok"] else "FAIL",
                     "; ".join(failed) if failed else f"{len(att['checks'])} checks"])  # fmt: skip
    x = {k: result["five_xx"].get(k, "?") for k in ("client", "gateway", "gateway_expected", "replicas")}
    common.print_table(
        f"Gateway under abuse: {result['rounds']} round(s), {result['attack_s']} s of attacks",
        ["attack", "requests", "statuses", "result", "checks"], rows,
        [f"5xx: {x['client']} answered to clients, {x['replicas']} by the surviving replicas; the gateway "
         f"counted {x['gateway']} ({x['gateway_expected']} expected: the streams the replica kill cut, each "
         "an SSE error event after its 200)"],
    )  # fmt: skip
    rows = [[c["when"].removeprefix("leaks "), c["name"], "pass" if c["ok"] else "FAIL", c["detail"][:64]]
            for c in result["leak_checks"]]  # fmt: skip
    common.print_table("Leak and shutdown checks", ["when", "check", "result", "detail"], rows)
    print(f"RESULT: {'PASS' if result['ok'] else 'FAIL'} in {result['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    # the replicas' request log lines reach their files at once
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    model_dir = common.resolve_model(args)
    log_dir = (Path(args.log_dir) if args.log_dir
               else common.RESULTS_DIR / "logs" / f"{NAME}-{time.strftime('%Y%m%d-%H%M%S')}")  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": NAME, "command": common.command_line("bench.adversarial", argv),
        "config": vars(args) | {"gateway_grace_s": GATEWAY_GRACE_S, "replica_grace_s": REPLICA_GRACE_S,
                                "max_model_len": MAX_MODEL_LEN},
        "env": {"platform": platform.platform(), "python": platform.python_version(),
                "cpu": common._cpu_model(), "cpu_count": os.cpu_count(), "git_commit": common._git_commit(),
                "loadavg": common.loadavg()},
    }  # fmt: skip
    cost = fleet_mod.SimCost(0.0, args.step_ms, 0.0, 0.0)
    with fleet_mod.Fleet(model_dir, MODEL, log_dir, args.replicas, cost, 2048, MAX_MODEL_LEN,
                         replica_args=["--log-level", "info", "--shutdown-timeout", f"{REPLICA_GRACE_S:g}"],
                         gateway_args=["--shutdown-grace", f"{GATEWAY_GRACE_S:g}"]) as fl:  # fmt: skip
        result["boot_s"] = fl.boot("prefix-aware")
        run, info = asyncio.run(attack_all(fl, args))
    result.update(info)
    result["rounds"] = run.round
    result["attacks"], result["leak_checks"] = {}, []
    for name, checks in run.checks.items():
        if name.startswith(("leaks", "shutdown")):
            result["leak_checks"] += [{"when": name, **c} for c in checks]
        else:
            statuses = run.statuses.get(name, Counter())
            result["attacks"][name] = {
                "requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
                "checks": checks, "ok": all(c["ok"] for c in checks),
            }  # fmt: skip
    result["five_xx"] = {**run.five_xx, "client": sum(five_xx(s) for s in run.statuses.values())}
    checks = [*(c for a in result["attacks"].values() for c in a["checks"]), *result["leak_checks"]]
    result["ok"] = all(c["ok"] for c in checks)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["log_dir"] = str(log_dir)
    render(result)
    common.write_json(args.out or common.default_out(NAME), result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
