"""Routing benchmark: prefix-aware vs least-load vs round-robin (vs vLLM's router) on one fleet of simulated
replicas.

A real gateway (``kvfleet gateway``) in front of 4 real simulated replicas (``kvfleet engine serve --simulate``:
API server, scheduler, KV cache with prefix caching, Redis presence; the forward pass replaced by a timing
model, see docs/SERVER.md), a real Redis, and an open-loop load generator. Every policy runs the same
requests with the same Poisson arrival times (fixed seed) on a cold fleet: before each (scenario, policy) run
the replicas are restarted (empty KV caches, no measured rates), Redis is flushed and a new gateway starts
with ``--default-policy``. Requests are streamed chat completions from one tenant with no limits.

Scenarios (prompt text is vocabulary words of the demo model's tokenizer, one token each, so a 2,000-word
system prompt is 2,000 tokens; counts are measured with the tokenizer and the chat template, as the
gateway and engine compute them):

* ``shared-prefix`` (a): 16 groups x 8 users; each user asks one question: the group's 2,000-token system
  prompt + a 200-token question, 100 output tokens. Users arrive in a random order.
* ``multi-turn`` (b): 32 chats of 6 turns: a 500-token system prompt of its own, 100-token user messages,
  100-token answers; each turn quotes the whole chat so far and is sent 1 s (exponential think time)
  after the previous answer ended. Chats start as a Poisson process.
* ``hot-prefix`` (c): one 2,000-token system prompt shared by every request, 200-token questions.
* ``no-sharing`` (d): every request has its own 2,000-token system prompt and question (nothing to reuse).
* ``shared-prefix-no-pressure``: (a)'s requests and arrival times on replicas whose KV cache holds every
  group's whole request twice over (nothing evicted): what is left of the routers' difference without
  cache pressure.

The peer (issue 27): ``vllm-router:cache_aware`` and ``vllm-router:round_robin`` run vLLM's Rust router
(PyPI ``vllm-router``, ``bench/_vllm_router.py``) in front of the same cold replicas instead of the kvfleet
gateway (which is stopped for the run); they are among the default policies when it is installed. The
router names no replica in its responses, so its load per replica is each replica's own count of the
requests it completed; it reports no cached-token prediction.

Timing model (per replica, ``--sim-*`` flags): prefill 1.25 ms per uncached prompt token (800 tokens/s: a
2,000-token prompt takes 2.5 s), 30 ms per decode step + 0.1 ms per decoding sequence, 1 ms per step; KV cache
768 blocks of 16 tokens (12,288 tokens: about 5 of the 16 system prompts of (a) besides the running
requests). So a request is almost entirely simulated time (sleep): a cache miss of (a) takes ~2.8 s to its
first token and ~3 s more to stream 100 tokens.

Why these numbers: streaming costs real CPU. Measured here, one 100-token request costs ~120 ms of CPU over
the client, the gateway and the replicas' API servers (~0.5 ms per streamed token per hop), and this
machine has 2 shared cores. Capacity is prefill-bound (each replica prefills at most 800 tokens/s, decode
steps batch every running request), so a fleet's capacity in requests/s is::

    capacity = replicas x prefill tokens/s / uncached prompt tokens per request

For (a) at 800 tokens/s: 4 x 800 / ~480 (prefix-aware ideal: each group's system prompt computed once in
the fleet, every other request prefills only its question) = ~6.7 requests/s; with no reuse (every request
prefills ~2,230 tokens) 1.4 requests/s. At the 2-5k tokens/s of a small model on a GPU, 80 % of (a)'s
capacity would be 13-33 requests/s: 1.6-4 cores of HTTP/SSE work, and the run would measure CPU contention,
not routing. A slower simulated device keeps the same shape at a few requests/s.

Arrival rate: ``--utilisation`` (0.8) x the *prefix-aware* fleet's capacity for the scenario, computed from
the timing model with the ideal reuse (every prompt block computed once per fleet; found by hashing the
actual prompts with the engine's block hashes), capped at ``--max-rate`` (5 requests/s: the CPU budget).
Prefix-aware's capacity rather than round-robin's because the issue's throughput target can only show at a
load one policy sustains and the other does not: below round-robin's capacity both complete every request
as it arrives and throughput is the arrival rate for both. The no-reuse capacity is reported too; in (a) the
rate is above it, so round-robin and least-load queue up. In (d) nothing can be reused and the rate is 80 %
of the no-reuse capacity for every policy. ``--rate-basis no-cache`` picks 80 % of the no-reuse capacity in
every scenario instead (all policies keep up; TTFT differences only).

Reported per run: TTFT mean/p50/p99, end-to-end p50/p99, throughput (completed requests / makespan, the time
from the first send to the last completion; output tokens/s), requests per replica and max/mean load share,
cached prompt tokens (engines' ``usage.prompt_tokens_details.cached_tokens``) against the gateway's
prediction (``kvfleet_gateway_predicted_cached_tokens_total`` / ``..._actual_cached_tokens_total``, and per
request from the ``x-kvfleet-route`` debug header), preemptions, Redis round trips per request, and the CPU
the fleet and the client used (the machine is shared: the load average is recorded too).

Targets (issue): (a) prefix-aware mean TTFT >= 3x lower than round-robin and throughput >= 1.3x; (c) no
replica gets more than 1.5x the mean number of requests under prefix-aware; (d) prefix-aware within 5 % of
least-load (mean TTFT at most 5 % higher, throughput at most 5 % lower). Against the peer (issue 27): (a)
prefix-aware mean TTFT <= 0.5x vllm-router cache_aware's and throughput >= 1.2x; the no-pressure case and
(b), and the router's max/mean load in (c), are reported beside them.

    .venv/bin/python -m bench.routing                      # all scenarios and policies, ~20 min
    .venv/bin/python -m bench.routing --scenarios shared-prefix --policies prefix-aware,round-robin
    .venv/bin/python -m bench.routing --quick              # smoke test: 2 replicas, tiny workloads, ~1 min
    .venv/bin/python -m bench.routing --scenarios shared-prefix,shared-prefix-no-pressure,multi-turn,hot-prefix \
        --policies prefix-aware,round-robin,vllm-router:cache_aware,vllm-router:round_robin
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _compact_json as compact_json
from bench import _fleet as fleet_mod
from bench import _fleet_metrics as fleet_metrics
from bench import _serve_common as sc
from bench import _vllm_router as vllm_router
from bench._routing_requests import MODEL, request_table, run_sessions, warm_up
from bench._routing_stats import PEER_POLICIES, compare, summarize, targets
from bench._routing_workloads import BLOCK_SIZE, SCENARIOS, Workload, build_workload, calibrate, kv_blocks

NAME = "routing"
KVFLEET_POLICIES = ("prefix-aware", "least-load", "round-robin")
POLICIES = (*KVFLEET_POLICIES, *PEER_POLICIES)
PEER_PREFIX = "vllm-router:"


def default_policies() -> tuple[str, ...]:
    """kvfleet's policies, and the peer router's when ``vllm-router`` is installed."""
    return POLICIES if vllm_router.version() is not None else KVFLEET_POLICIES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="tiny")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 2 replicas, tiny workloads, replicas reset"
    )
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    p.add_argument("--policies", default=",".join(default_policies()),
                   help=f"comma-separated subset of {POLICIES} (default: those installed)")  # fmt: skip
    p.add_argument("--replicas", type=int, default=None, help="simulated replicas (default 4; quick 2)")
    p.add_argument("--between-runs", choices=("restart", "reset"), default=None,
                   help="restart: new replica processes + flushed Redis before every run (default); "
                        "reset: keep them, empty their prefix caches (default with --quick)")  # fmt: skip
    t = p.add_argument_group("timing model (per replica)")
    t.add_argument("--prefill-ms-per-1k", type=float, default=None, help="default 1250 (800 tokens/s)")
    t.add_argument("--decode-ms-per-step", type=float, default=None, help="default 30")
    t.add_argument("--decode-ms-per-seq", type=float, default=0.1)
    t.add_argument("--step-overhead-ms", type=float, default=1.0)
    t.add_argument("--num-kv-blocks", type=int, default=None, help="default 768 (of 16 tokens)")
    t.add_argument("--max-model-len", type=int, default=4096)
    w = p.add_argument_group("workloads")
    w.add_argument("--groups", type=int, default=None, help="(a) prompt groups (default 16)")
    w.add_argument("--users-per-group", type=int, default=None, help="(a) users per group (default 8)")
    w.add_argument(
        "--system-len", type=int, default=None, help="(a, c, d) system prompt tokens (default 2000)"
    )
    w.add_argument("--question-len", type=int, default=None, help="(a, c, d) question tokens (default 200)")
    w.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 100)")
    w.add_argument("--chats", type=int, default=None, help="(b) conversations (default 32)")
    w.add_argument("--turns", type=int, default=None, help="(b) turns per conversation (default 6)")
    w.add_argument("--chat-system-len", type=int, default=None, help="(b) system prompt tokens (default 500)")
    w.add_argument("--chat-message-len", type=int, default=None, help="(b) user message tokens (default 100)")
    w.add_argument(
        "--think-s", type=float, default=None, help="(b) mean think time between turns (default 1)"
    )
    w.add_argument("--hot-requests", type=int, default=None, help="(c) requests (default 128)")
    w.add_argument("--unique-requests", type=int, default=None, help="(d) requests (default 96)")
    r = p.add_argument_group("load")
    r.add_argument("--utilisation", type=float, default=0.8, help="arrival rate / capacity (default 0.8)")
    r.add_argument("--rate-basis", choices=("prefix-aware", "no-cache"), default="prefix-aware",
                   help="whose capacity the rate is a fraction of (see the docstring)")  # fmt: skip
    r.add_argument("--max-rate", type=float, default=None, help="cap on requests/s (CPU budget; default 5)")
    r.add_argument("--seed", type=int, default=0, help="prompt, order and arrival seed")
    p.add_argument("--gateway-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the gateway process (repeatable)")  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--log-dir", default=None, help="process logs (default bench/results/logs/routing-<time>)")
    o.add_argument("--out", default=None, help="JSON output (default bench/results/routing.json)")
    o.add_argument("--request-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    args.scenarios = _subset(p, args.scenarios, SCENARIOS, "--scenarios")
    args.policies = _subset(p, args.policies, POLICIES, "--policies")
    if any(x.startswith(PEER_PREFIX) for x in args.policies) and vllm_router.version() is None:
        p.error(f"--policies: {vllm_router.DIST} is not installed (pip install {vllm_router.DIST})")
    quick = args.quick
    defaults = {
        "replicas": (2, 4), "between_runs": ("reset", "restart"), "prefill_ms_per_1k": (1000.0, 1250.0),
        "decode_ms_per_step": (5.0, 30.0), "num_kv_blocks": (256, 768), "groups": (2, 16),
        "users_per_group": (3, 8), "system_len": (64, 2000), "question_len": (16, 200), "output_len": (8, 100),
        "chats": (3, 32), "turns": (2, 6), "chat_system_len": (32, 500), "chat_message_len": (16, 100),
        "think_s": (0.05, 1.0), "hot_requests": (6, 128), "unique_requests": (6, 96), "max_rate": (20.0, 5.0),
    }  # fmt: skip
    for k, (q, full) in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, q if quick else full)
    if quick and args.max_model_len == 4096:
        args.max_model_len = 1024
    for k in ("replicas", "groups", "users_per_group", "system_len", "question_len", "output_len", "chats", "turns",
              "chat_system_len", "chat_message_len", "hot_requests", "unique_requests", "num_kv_blocks"):  # fmt: skip
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1")
    if not 0 < args.utilisation <= 2 or args.max_rate <= 0:
        p.error("--utilisation must be in (0, 2] and --max-rate > 0")
    args.gateway_env = fleet_mod.parse_env(p, args.gateway_env, "--gateway-env")
    return args


def _subset(p: argparse.ArgumentParser, value: str, allowed: Sequence[str], flag: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"{flag}: expected a comma-separated subset of {', '.join(allowed)}")
    return [x for x in allowed if x in items]  # canonical order


def command_line(argv: list[str] | None) -> str:
    return shlex.join([".venv/bin/python", "-m", "bench.routing", *(sys.argv[1:] if argv is None else argv)])


# ---- one run ---------------------------------------------------------------------------------------


def _gateway_counters(samples: list[fleet_metrics.Sample]) -> dict[str, float]:
    m = fleet_metrics.metric_sum
    return {
        "predicted_cached_tokens": m(samples, "kvfleet_gateway_predicted_cached_tokens_total", model=MODEL),
        "actual_cached_tokens": m(samples, "kvfleet_gateway_actual_cached_tokens_total", model=MODEL),
        "redis_round_trips_request": m(samples, "kvfleet_gateway_redis_round_trips_total", path="request"),
        "redis_round_trips_background": m(
            samples, "kvfleet_gateway_redis_round_trips_total", path="background"
        ),
        "fallbacks": m(samples, "kvfleet_gateway_routing_fallbacks_total"),
        "upstream_errors": m(samples, "kvfleet_gateway_upstream_errors_total"),
    }


def _engine_counters(urls: list[str]) -> list[dict[str, float]]:
    out = []
    for url in urls:
        s = fleet_metrics.scrape(url)
        out.append({
            "prompt_tokens": fleet_metrics.metric_sum(s, "kvfleet_engine_prompt_tokens_total"),
            "cached_prompt_tokens": fleet_metrics.metric_sum(s, "kvfleet_engine_cached_prompt_tokens_total"),
            "preemptions": fleet_metrics.metric_sum(s, "kvfleet_engine_num_preemptions"),
            "prefill_tokens_per_s": fleet_metrics.metric_sum(s, "kvfleet_engine_prefill_tokens_per_second"),
            "requests": fleet_metrics.metric_sum(s, "kvfleet_engine_requests_total", status="200"),
        })  # fmt: skip
    return out


def run_policy(
    fl: fleet_mod.Fleet, workload: Workload, policy: str, args: argparse.Namespace
) -> dict[str, Any]:
    """One run of ``workload`` on a cold fleet, through the kvfleet gateway under ``policy``, or through the
    peer router (``vllm-router:<its policy>``) with the gateway stopped."""
    info: dict[str, Any] = {"policy": policy}
    router_policy = policy.removeprefix(PEER_PREFIX) if policy.startswith(PEER_PREFIX) else None
    try:
        fresh = args.between_runs
        if fl.num_kv_blocks != workload.info["num_kv_blocks"]:  # another KV cache size: new replicas
            fl.num_kv_blocks, fresh = workload.info["num_kv_blocks"], "restart"
        common.log(f"{workload.scenario} / {policy}: booting the fleet ({fresh})")
        info["boot_s"] = fl.boot(policy if router_policy is None else "round-robin", fresh)
        with contextlib.ExitStack() as stack:
            router = None
            if router_policy is not None:
                fl.stop_gateway()  # the router alone in front of the replicas
                log = fl.log_dir / f"vllm-router-{workload.scenario}-{router_policy}-boot{fl.boots:02d}.log"
                router = stack.enter_context(vllm_router.VllmRouter(fl.engine_urls, router_policy, log))
                info["router"] = {"version": vllm_router.version(), "ready_s": router.ready_s}
            _measure(fl, workload, args, router, info)
    except Exception as e:
        traceback.print_exc()
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def _measure(
    fl: fleet_mod.Fleet,
    workload: Workload,
    args: argparse.Namespace,
    router: vllm_router.VllmRouter | None,
    info: dict[str, Any],
) -> None:
    """Warm-up, then the workload's sessions through the gateway or ``router``, with the counters around
    them, into ``info``."""
    url, key = (router.url, None) if router is not None else (fl.gateway_url, fl.api_key)
    pids = [*fl.pids(), *([router.pid] if router is not None else [])]

    def front_counters() -> dict[str, Any]:
        return router.counters() if router is not None else _gateway_counters(fleet_metrics.scrape(url))

    info["warmup_ok"] = asyncio.run(warm_up(url, key, args.replicas, workload.output_len))
    front0, eng0 = front_counters(), _engine_counters(fl.engine_urls)
    cpu0, client0 = fleet_metrics.cpu_seconds(pids), time.process_time()
    contention0 = common.contention()
    n = sum(len(s.messages) for s in workload.sessions)
    common.log(
        f"{workload.scenario} / {info['policy']}: {n} requests at {workload.info['rate_req_s']:.2f} req/s"
    )
    records, makespan = asyncio.run(run_sessions(url, key, workload, args.request_timeout))
    cpu = fleet_metrics.cpu_seconds(pids) - cpu0
    client_cpu = time.process_time() - client0
    contention1 = common.contention()
    front1, eng1 = front_counters(), _engine_counters(fl.engine_urls)
    fl.check_alive()
    if router is not None:
        router.check_alive()
        served = {
            f"sim-{i}": round(e1["requests"] - e0["requests"]) for i, (e0, e1) in enumerate(zip(eng0, eng1))
        }
        info["summary"] = summarize(records, makespan, args.replicas, workload.output_len, served)
        info["router"]["counters"] = vllm_router.counters_delta(front0, front1)
    else:
        info["summary"] = summarize(records, makespan, args.replicas, workload.output_len)
        info["gateway"] = {k: front1[k] - front0[k] for k in front1}
    info["engines"] = [{k: e1[k] - e0[k] if k != "prefill_tokens_per_s" else e1[k] for k in e1}
                       for e0, e1 in zip(eng0, eng1)]  # fmt: skip
    info["cpu"] = {
        "fleet_s": cpu,
        "client_s": client_cpu,
        "cores_used": (cpu + client_cpu) / max(makespan, 1e-9),
    }
    info["contention_before"], info["contention_after"] = contention0, contention1
    info["requests"] = request_table(records)


# ---- report ----------------------------------------------------------------------------------------


def _f(x: Any, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def render(result: dict[str, Any]) -> None:
    rows = []
    for scen, s in result["scenarios"].items():
        for policy, run in s["policies"].items():
            m = run.get("summary")
            if m is None:
                rows.append([scen, policy, "error", *["-"] * 10])
                continue
            counts = "/".join(str(v) for v in m["requests_per_replica"].values())
            g = run.get("gateway", {})
            rows.append([
                scen, policy, f"{m['completed']}/{m['requests']}", _f(m["request_throughput"], 2),
                _f(m["output_tok_s"], 1), _f(m["ttft_ms"]["mean"]), _f(m["ttft_ms"]["p50"]), _f(m["ttft_ms"]["p99"]),
                _f(100 * m["cache_hit_rate"], 1) if m["cache_hit_rate"] is not None else "-",
                f"{_f(g.get('predicted_cached_tokens'))}/{_f(g.get('actual_cached_tokens'))}",
                counts, _f(m["load_share_max_over_mean"], 2),
            ])  # fmt: skip
    notes = []
    for scen, s in result["scenarios"].items():
        w = s["workload"]
        capped = "capped, " if w["rate_capped"] else ""
        notes.append(
            f"{scen}: {w['requests']} requests, prompt {w['prompt_tokens_mean']:.0f} tokens mean, "
            f"{w['uncached_tokens_mean_ideal']:.0f} uncached if reused ideally; capacity (timing model) "
            f"{w['capacity_req_s_prefix_aware_ideal']:.2f} req/s prefix-aware ideal, "
            f"{w['capacity_req_s_no_reuse']:.2f} no reuse; rate {w['rate_req_s']:.2f} req/s ({capped}"
            f"{100 * w['load_vs_prefix_aware_capacity']:.0f} % / {100 * w['load_vs_no_reuse_capacity']:.0f} % of them); "
            f"KV cache {w.get('num_kv_blocks', '?')} blocks per replica"
        )
        for policy, run in s["policies"].items():
            if "error" in run:
                notes.append(f"{scen} / {policy} failed: {run['error']}")
            elif run["summary"]["errors"]:
                notes.append(f"{scen} / {policy} errors: {run['summary']['errors']}")
        for other, c in s.get("comparison", {}).items():
            notes.append(f"{scen}: prefix-aware {other.replace('_', ' ', 1)}: TTFT mean {_f(c['ttft_mean_ratio'], 2)}x "
                         f"lower, throughput {_f(c['throughput_ratio'], 2)}x")  # fmt: skip
    for name, t in result["targets"].items():
        figures = ", ".join(f"{k} {v:.3g}" for k, v in t.items() if isinstance(v, float))
        if name.startswith("peer_"):  # issue 27's, against vllm-router: PASS / FAIL, or only reported
            if "load_share_max_over_mean" in t:
                figures = ", ".join(f"{p} {_f(v, 2)}" for p, v in t["load_share_max_over_mean"].items())
            verdict = "reported:" if t["met"] is None else ("PASS" if t["met"] else "FAIL")
            notes.append(f"{verdict} {name} ({figures})")
        else:
            notes.append(f"target {name}: {'met' if t['met'] else 'NOT met'} ({figures})")
    notes.extend(result["notes"])
    common.print_table(
        f"Routing benchmark: {result['command']}",
        ["scenario", "policy", "ok", "req/s", "out tok/s", "TTFT mean ms", "p50", "p99", "hit %",
         "cached pred/actual", "per replica", "max/mean"],
        rows, notes,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    log_dir = (
        Path(args.log_dir)
        if args.log_dir
        else common.RESULTS_DIR / "logs" / f"routing-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    cost = fleet_mod.SimCost(args.prefill_ms_per_1k, args.decode_ms_per_step, args.decode_ms_per_seq,
                             args.step_overhead_ms)  # fmt: skip
    common.log("loading the tokenizer and building prompts")
    tokenizer = sc.load_tokenizer(model_dir)
    words = sc.word_pool(tokenizer)
    workloads = {}
    for scen in args.scenarios:
        w = build_workload(scen, args, tokenizer, words)
        w.info.update(calibrate(w, args, cost))
        w.info["num_kv_blocks"] = kv_blocks(scen, args)
        workloads[scen] = w
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": command_line(argv),
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "model": str(model_dir),
        "timing_model": {
            **asdict(cost),
            "prefill_tokens_per_s": cost.prefill_tokens_per_s,
            "num_kv_blocks": args.num_kv_blocks,
            "block_size": BLOCK_SIZE,
            "replicas": args.replicas,
        },
        "env": common.env_info(),
        "scenarios": {},
        "notes": [busy] if busy else [],
    }
    with fleet_mod.Fleet(model_dir, MODEL, log_dir, args.replicas, cost, args.num_kv_blocks, args.max_model_len,
                         gateway_env=args.gateway_env) as fl:  # fmt: skip
        for scen, w in workloads.items():
            runs = {policy: run_policy(fl, w, policy, args) for policy in args.policies}
            result["scenarios"][scen] = {"workload": w.info, "policies": runs, "comparison": compare(runs)}
    result["targets"] = targets(result["scenarios"])
    result["log_dir"] = str(log_dir)
    render(result)
    compact_json.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
