"""Gateway overhead benchmark: the same streamed requests sent straight to an engine replica and through the
gateway, in alternating rounds, against a simulated replica that costs no compute.

Fleet: a real Redis, one ``kvfleet engine serve --simulate`` replica with no prefill or per-sequence cost
(latency is what the HTTP/SSE stack and the router add), and one ``kvfleet gateway`` (default policy
prefix-aware) with a tenant that has no limits.

Two loads (``--load``), each with short unique chat messages (~20 tokens through the chat template) streamed
with ``stream_options.include_usage``; rounds alternate direct -> gateway -> direct -> ... (``--rounds``
pairs), so slow drifts of the shared machine hit both sides alike, and both rounds of a pair send the same
prompts (at the same times):

- ``paced`` (default): 100 streams in flight, as on a GPU replica serving 100 users. The replica's decode step
  takes ``--step-ms`` (50 ms: a sleep, no CPU) and each request streams ``--output-len`` (64) tokens;
  requests arrive open-loop (Poisson) at the rate that keeps ``--concurrency`` (100) streams in flight
  (Little's law; the measured mean and peak are reported). Open-loop arrivals, because closed-loop clients
  lock onto the replica's step boundaries and the wait for the next step would hide what the gateway adds
  on the way in. The machine has CPU to spare here, so the difference is the gateway's own latency.
- ``closed``: a zero-time replica (every ``--sim-*`` cost 0) and ``--concurrency`` (100) clients each sending
  ``--requests-per-client`` (5) requests of ``--output-len`` (16) tokens back to back. This saturates the
  machine: the rounds run as fast as the CPUs allow, so on a machine where the clients, the replica and the
  gateway share the CPUs the added latency is the gateway's CPU per request times the queue it joins
  (~100 x CPU / cores), a capacity figure rather than a latency one. Client ``i``'s ``j``-th request carries
  the same prompt in both rounds of a pair; a sequential reference (below) runs first.

Reported: TTFT (first chunk with text) and end-to-end latency percentiles per side, pooled over rounds;
added latency = gateway percentile - direct percentile (p50, p99), plus the median of per-request paired
differences and per-round p50s (noise). Each figure also *outside the replica*: the client's figure minus the
replica's own for the same request (arrival at its handler -> first token / last chunk, from its per-request
log line; every request carries an ``X-Request-Id`` the gateway forwards). That is the time spent in the
HTTP stacks, the kernel and the gateway, without the replica's step clock in each request's figure (at the
paced load a request that lands just after a step waits a whole one, inside the replica). The end-to-end
figures shift by as much in distribution where the gateway's delay does not depend on when in a step a
request arrives; it does somewhat (the gateway is busiest just after a step, relaying its burst, when a new
request has the longest wait for the next step anyway), so the outside figure is the stricter: it also
counts delays that wait absorbs. The added-latency verdict reads the outside figures; the end-to-end one is
printed too. ``--a-a`` sends the second side straight to the replica as well: how far two identical sides
differ on each measure (the noise floor). A sequential reference (concurrency 1, alternating per request:
the gateway's own cost without queueing; ``closed`` only); the gateway's request path per request (arrival ->
upstream request sent, from its per-request log line, which the bench runs at INFO); CPU seconds per request
of the gateway, the engine and the client (``/proc``); Redis round trips per gateway request from
``kvfleet_gateway_redis_round_trips_total`` (``path="request"`` and ``path="background"``, deltas over the
gateway rounds) and Redis's own ``total_commands_processed`` / ``INFO commandstats`` deltas per request, over
the gateway rounds and, for comparison, over the direct rounds (what the replica's heartbeats and KV events
cost on their own).

The load generator's client (``--client``) is ``_fleet_client.SseClient`` by default: each event is parsed
and timed in its connection's callback, at ~2 ms of CPU per 64-token stream; httpx (``--client httpx``) took
~8 ms, from the CPUs the replica and the gateway share with it, and its own time inflated the direct baseline.

``--cpu-layout isolated`` gives the gateway (and Redis) half of the CPUs and the clients and the replica the
other half, as in a deployment where the gateway has its own node. In the default shared layout the closed
loop keeps every CPU busy, so whatever CPU the gateway spends per request comes out of the clients' and the
replica's time, and the added latency grows with the concurrency (see docs/BENCHMARKS.md).

``--profile`` then samples the gateway with py-spy (when installed) during extra gateway rounds and reports
where its CPU time goes (self and inclusive time per function, and per library).

``--peer vllm-router`` (issue 27) adds a third side: vLLM's Rust router (PyPI ``vllm-router``,
``bench/_vllm_router.py``) in front of the same replica, in the same round sets (same prompts, same arrival
times; the order of the two routed sides rotates from one set to the next), with its ``round_robin`` policy
by default: the router's cheapest path, a pure proxy (``--peer-policy cache_aware`` first fetches each
request's token ids from the replica). kvfleet then runs with every feature on: API-key auth, a tenant
with quotas (requests and tokens per minute, concurrency: metered on every request, never reached;
``--no-quotas`` for the limitless tenant) and prefix-aware routing. Reported next to
kvfleet's: the router's added TTFT p50 with sequential streams (``closed`` load's reference) and its
requests/s at ``--concurrency`` streams (``closed``), with the ratios the issue's targets name (see
``_gateway_overhead_peer``) and each router's CPU per request.

Targets (issue): added latency p50 <= 2 ms and p99 <= 10 ms at 100 concurrent streams (the ``paced`` load);
at most 2 Redis round trips per request. Against the peer (issue 27): added TTFT p50 (sequential) <= 1.0x
vllm-router's; requests/s at 64 streams >= 1.0x vllm-router's.

    .venv/bin/python -m bench.gateway_overhead                 # paced: 100 streams in flight, 3 round pairs
    .venv/bin/python -m bench.gateway_overhead --load closed   # saturated: 100 clients x 5 requests x 3 pairs
    .venv/bin/python -m bench.gateway_overhead --profile
    .venv/bin/python -m bench.gateway_overhead --quick         # smoke test
    .venv/bin/python -m bench.gateway_overhead --load closed --concurrency 64 --peer vllm-router
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench import _common as common
from bench import _compact_json as compact_json
from bench import _fleet as fleet_mod
from bench import _serve_common as sc
from bench import _servers as servers
from bench import _vllm_router as vllm_router
from bench._gateway_overhead_load import MODEL, PEER_SIDE, measure, paced_rate
from bench._gateway_overhead_logs import attach_engine_timings, attach_gateway_timings
from bench._gateway_overhead_peer import compare as peer_compare
from bench._gateway_overhead_peer import targets as peer_targets
from bench._gateway_overhead_profile import profile_gateway
from bench._gateway_overhead_report import TARGET_REDIS_ROUND_TRIPS, added_latency_verdict, render
from bench._gateway_overhead_stats import (
    add_round_percentiles,
    pair_differences,
    per_request,
    request_path,
    request_table,
    side_stats,
)

NAME = "gateway_overhead"
ZERO_COST = fleet_mod.SimCost(0.0, 0.0, 0.0, 0.0)
# the paced replica's decode step, ~100 sequences in the batch (a large model): 2,000 tokens/s to relay
PACED_STEP_MS = 50.0
# --quotas: limits the bench never reaches, so that every request is metered against them (admission checks
# the requests and tokens per minute and takes a shared concurrency slot) without a single 429
QUOTA_TENANT = "bench-quotas"
QUOTA_LIMITS = {
    "requests_per_minute": 10_000_000,
    "tokens_per_minute": 1_000_000_000,
    "max_concurrent": 100_000,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="tiny")
    p.add_argument("--quick", action="store_true", help="smoke test: 8 streams, 1 round pair")
    p.add_argument("--load", choices=("paced", "closed"), default="paced",
                   help="paced: open-loop arrivals holding --concurrency streams in flight on a replica whose\n"
                        "decode step takes --step-ms (default); closed: --concurrency clients back to back\n"
                        "on a zero-time replica (saturates the machine)")  # fmt: skip
    p.add_argument("--concurrency", type=int, default=None, help="streams in flight / clients (default 100)")
    p.add_argument("--step-ms", type=float, default=None,
                   help=f"paced: the replica's decode step (default {PACED_STEP_MS:g}; quick 5)")  # fmt: skip
    p.add_argument("--requests-per-round", type=int, default=None,
                   help="paced: requests per round and side (default 600; quick 16)")  # fmt: skip
    p.add_argument("--requests-per-client", type=int, default=None,
                   help="closed: per client per round (default 5)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=None, help="direct/gateway round pairs (default 3)")
    p.add_argument("--output-len", type=int, default=None, help="tokens per request (paced 64, closed 16)")
    p.add_argument("--prompt-words", type=int, default=12, help="words in each user message")
    p.add_argument("--reference-requests", type=int, default=None,
                   help="closed: sequential requests per side at concurrency 1 (default 50; quick 4)")  # fmt: skip
    p.add_argument(
        "--warmup-requests", type=int, default=None, help="per side, before measuring (default 100)"
    )
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the gateway process (repeatable), e.g. OTEL_SDK_DISABLED=true")  # fmt: skip
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument of `kvfleet gateway` (repeatable), e.g. --gateway-arg=--loop=uvloop")  # fmt: skip
    p.add_argument("--cpu-layout", choices=("shared", "isolated"), default="shared",
                   help="shared: every process on every CPU (default); isolated: the gateway and Redis on the\n"
                        "second half of the CPUs, the clients and the replica on the first half, as when the\n"
                        "gateway runs on its own node (its CPU is then not taken from the load generator)")  # fmt: skip
    p.add_argument("--a-a", action="store_true",
                   help="calibration: the second side goes straight to the replica as well (an A/A test: how\n"
                        "far two identical sides differ on each measure on this machine; no verdict)")  # fmt: skip
    p.add_argument("--client", choices=("lean", "httpx"), default="lean",
                   help="the load generator's HTTP client: lean (default; _fleet_client.SseClient, events parsed in the\n"
                        "connection callback) or httpx (~4x its CPU per stream, which the shared layout takes\n"
                        "from the replica and the gateway)")  # fmt: skip
    p.add_argument("--peer", choices=("none", "vllm-router"), default="none",
                   help="vllm-router: a third side through vLLM's Rust router in front of the same replica\n"
                        "(pip install vllm-router; see docs/BENCHMARKS.md)")  # fmt: skip
    p.add_argument("--peer-policy", choices=vllm_router.POLICIES, default="round_robin",
                   help="the peer router's --policy (default round_robin: with one replica there is nothing to\n"
                        "route, and it forwards each request alone; cache_aware first asks the replica for the\n"
                        "request's token ids, two more HTTP requests here: see bench/_vllm_router.py)")  # fmt: skip
    p.add_argument("--quotas", action=argparse.BooleanOptionalAction, default=None,
                   help="the tenant has quotas it never reaches, metered on every request (default: on with\n"
                        "--peer, off otherwise: the limitless tenant of the earlier runs)")  # fmt: skip
    p.add_argument("--profile", action="store_true", help="sample the gateway with py-spy in extra rounds")
    p.add_argument("--profile-rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log-dir", default=None, help="process logs (default bench/results/logs/gateway_overhead-<time>)"
    )
    p.add_argument("--out", default=None, help="JSON output (default bench/results/gateway_overhead.json)")
    args = p.parse_args(argv)
    paced = args.load == "paced"
    defaults = {"concurrency": (8, 100), "requests_per_client": (2, 5), "rounds": (1, 3),
                "requests_per_round": (16, 600), "step_ms": (5.0, PACED_STEP_MS),
                "output_len": ((8, 64) if paced else (16, 16)),
                "reference_requests": ((0, 0) if paced else (4, 50)), "warmup_requests": (8, 100)}  # fmt: skip
    for k, (q, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, q if args.quick else full)
    positive = ("concurrency", "requests_per_client", "requests_per_round", "rounds", "output_len", "prompt_words")  # fmt: skip
    for k in positive:
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if not args.step_ms > 0:
        p.error("--step-ms must be > 0")
    args.gateway_env = fleet_mod.parse_env(p, args.gateway_env, "--gateway-env")
    if args.quotas is None:
        args.quotas = args.peer != "none"
    if args.peer != "none" and vllm_router.version() is None:
        p.error(f"--peer {args.peer}: {vllm_router.DIST} is not installed (pip install {vllm_router.DIST})")
    return args


def command_line(argv: list[str] | None) -> str:
    return shlex.join(
        [".venv/bin/python", "-m", "bench.gateway_overhead", *(sys.argv[1:] if argv is None else argv)]
    )


def apply_cpu_layout(fl: fleet_mod.Fleet, layout: str, peer_pid: int | None = None) -> dict[str, Any]:
    """Pin every thread of each process and its children (threads started later inherit their creator's
    CPUs). The bench process itself (the clients) is pinned last: its children were placed already. A peer
    router goes where the gateway goes (like for like)."""
    cpus = sorted(os.sched_getaffinity(0))
    if layout == "shared":
        return {"layout": "shared", "cpus": cpus}
    if len(cpus) < 2:
        raise SystemExit("--cpu-layout isolated needs at least 2 CPUs")
    load, gateway = cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]
    assert fl.gateway is not None and fl.redis is not None and fl.redis.proc is not None
    placed = [(fl.gateway.pid, gateway), (fl.redis.proc.pid, gateway), (fl.engines[0].pid, load)]
    if peer_pid is not None:
        placed.append((peer_pid, gateway))
    for pid, where in placed:
        for p in servers.process_tree(pid):
            pin_threads(p, where)
    pin_threads(os.getpid(), load)  # not our children: they were placed above
    return {"layout": "isolated", "gateway_and_redis": gateway, "clients_and_replica": load,
            **({"peer_router": gateway} if peer_pid is not None else {})}  # fmt: skip


def pin_threads(pid: int, cpus: Sequence[int] | set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    common_part = {"load": args.load, "rounds": args.rounds, "output_len": args.output_len,
                   "prompt_words": args.prompt_words, "endpoint": "chat",
                   "tenant_limits": QUOTA_LIMITS if args.quotas else None}  # fmt: skip
    if args.load == "paced":
        return {**common_part, "concurrency": args.concurrency, "requests_per_round": args.requests_per_round,
                "arrival_rate_per_s": round(paced_rate(args), 3), "arrivals": "poisson (open loop)",
                "replica": f"kvfleet engine serve --simulate, decode step {args.step_ms:g} ms (a sleep), "
                           "no prefill or per-sequence cost"}  # fmt: skip
    return {**common_part, "concurrency": args.concurrency, "requests_per_client": args.requests_per_client,
            "arrivals": "closed loop, no think time",
            "replica": "kvfleet engine serve --simulate, every --sim-* cost 0"}  # fmt: skip


def create_quota_tenant(fl: fleet_mod.Fleet) -> str:
    """A tenant with ``QUOTA_LIMITS``; returns its API key."""
    r = httpx.post(f"{fl.gateway_url}/admin/tenants", json={"name": QUOTA_TENANT, **QUOTA_LIMITS},
                   headers={"Authorization": f"Bearer {fleet_mod.ADMIN_TOKEN}"}, timeout=30)  # fmt: skip
    if r.status_code != 201:
        raise RuntimeError(f"creating tenant {QUOTA_TENANT!r} failed: HTTP {r.status_code} {r.text}")
    return r.json()["api_key"]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    log_dir = (Path(args.log_dir) if args.log_dir
               else common.RESULTS_DIR / "logs" / f"{NAME}-{time.strftime('%Y%m%d-%H%M%S')}")  # fmt: skip
    tokenizer = sc.load_tokenizer(model_dir)
    words = sc.word_pool(tokenizer)
    result: dict[str, Any] = {
        "benchmark": NAME, "command": command_line(argv),
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "workload": workload(args),
        "env": common.env_info(), "notes": [busy] if busy else [],
    }  # fmt: skip
    cost = fleet_mod.SimCost(0.0, args.step_ms, 0.0, 0.0) if args.load == "paced" else ZERO_COST
    # Both servers at INFO, as deployed: the replica's line per request gives its own TTFT and E2E, the
    # gateway's its request path (arrival -> upstream request sent).
    with fleet_mod.Fleet(model_dir, MODEL, log_dir, 1, cost, 4096, 1024, replica_args=["--log-level", "info"],
                         gateway_args=["--log-level", "info", *args.gateway_arg],
                         gateway_env=args.gateway_env) as fl, contextlib.ExitStack() as stack:  # fmt: skip
        result["boot_s"] = fl.boot("prefix-aware")
        if args.quotas:
            fl.api_key = create_quota_tenant(fl)
        peer = None
        if args.peer != "none":
            peer = stack.enter_context(
                vllm_router.VllmRouter(fl.engine_urls, args.peer_policy, log_dir / "vllm-router.log")
            )
            result["peer"] = {"name": args.peer, "version": vllm_router.version(), "policy": args.peer_policy,
                              "ready_s": peer.ready_s, "command": shlex.join(peer.process.command.argv),
                              "kvfleet_features": "API-key auth, "
                              + ("a tenant with quotas, " if args.quotas else "a tenant without limits, ")
                              + "prefix-aware routing"}  # fmt: skip
        measure_fleet(fl, args, tokenizer, words, result, peer)
        if peer is not None:
            peer.check_alive()
            result["peer"]["router_counters"] = peer.counters()
        if args.profile:
            try:
                result["profile"] = profile_gateway(fl, args, tokenizer, words, log_dir)
            except Exception as e:
                traceback.print_exc()
                result["profile"] = {"error": f"{type(e).__name__}: {e}"}
    added = result["stats"]["added_ms"]
    trips = result["per_gateway_request"].get("gateway_redis_round_trips", {}).get("request_path")
    pairs = result["round_pair_added_ms"] = pair_differences(result["rounds"])
    # The verdict reads the latency added outside the replica: no replica step clock in each request's
    # figure, and no credit for gateway delays that a request's wait for the next step absorbs (see the
    # module docstring; --a-a shows how far two identical sides differ on each measure).
    result["targets"] = {} if args.a_a else {
        "added_latency": {
            **added_latency_verdict(added, pairs, "ttft_outside_ms", "e2e_outside_ms"),
            "measure": "outside the replica",
        },
        "added_latency_end_to_end": {
            **added_latency_verdict(added, pairs, "ttft_ms", "e2e_ms"), "informational": True,
            "measure": "informational: end to end at the client, each figure with its wait for the replica's next step",
        },
        "redis_round_trips": {
            "met": trips is not None and trips <= TARGET_REDIS_ROUND_TRIPS,
            "detail": f"{common.fmt(trips, 3)} per request on the request path (limit {TARGET_REDIS_ROUND_TRIPS:g})",
        },
    }  # fmt: skip
    if "peer" in result:
        result["peer"]["round_pair_added_ms"] = pair_differences(result["rounds"], PEER_SIDE)
        result["peer"]["comparison"] = peer_compare(result)
        result["peer"]["targets"] = {} if args.a_a else peer_targets(result)
    result["log_dir"] = str(log_dir)
    render(result)
    compact_json.write_json(args.out or common.default_out(NAME), result)
    return result


def measure_fleet(
    fl: fleet_mod.Fleet,
    args: argparse.Namespace,
    tokenizer: Any,
    words: list[str],
    result: dict[str, Any],
    peer: vllm_router.VllmRouter | None,
) -> None:
    """The measured rounds (``measure``) on the booted fleet, and their statistics into ``result``."""
    own_cpus = os.sched_getaffinity(0)
    peer_url, peer_pid = (peer.url, peer.pid) if peer is not None else (None, None)
    result["cpu_layout"] = apply_cpu_layout(fl, args.cpu_layout, peer_pid)
    result["contention_before"] = common.contention()
    try:
        m = asyncio.run(measure(fl, args, tokenizer, words, peer_url, peer_pid))
    finally:
        pin_threads(os.getpid(), own_cpus)  # main() may run inside another program (the tests)
    result["contention_after"] = common.contention()
    result["engine_timings_missing"] = attach_engine_timings(
        m["samples"] + m["reference"], fl.engines[0].log_path
    )
    assert fl.gateway is not None
    result["gateway_timings_missing"] = (
        0 if args.a_a else attach_gateway_timings(m["samples"] + m["reference"], fl.gateway.log_path)
    )
    sides = list(m["counters"])
    add_round_percentiles(m["rounds"], m["samples"])
    result["rounds"] = m["rounds"]
    result["stats"] = side_stats(m["samples"], sides)
    result["reference"] = side_stats(m["reference"], sides)
    per_side = {side: per_request(m["counters"][side], sum(1 for s in m["samples"] if s.side == side))
                for side in sides}  # fmt: skip
    result["per_gateway_request"] = per_side["gateway"]
    result["per_direct_request"] = per_side["direct"]
    result["per_side_request"] = per_side
    result["gateway_request_path_ms"] = request_path(m["samples"])
    result["reference_request_path_ms"] = request_path(m["reference"])
    result["reference_per_gateway_request"] = per_request(m["reference_counters"], args.reference_requests)
    result["counters"] = m["counters"]
    result["requests"] = request_table(m["samples"])


if __name__ == "__main__":
    main()
