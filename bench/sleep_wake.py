"""Sleep / wake of the kvfleet engine server against a cold start, on the ``bench`` demo model by default.

One server, ``KVFLEET_ADMIN_TOKEN=T kvfleet engine serve --model DIR [--kvfleet-args ...]``:

1. **Cold start**: from spawning the process to the first streamed token of a request sent as soon as
   ``/health`` answers (polled every 50 ms). The reference prompt's greedy output is recorded next.
2. For each cycle and each level L in ``--levels``: ``POST /sleep?level=L`` (returns when done: timed),
   memory while asleep, one generation request (expected: 503 with ``Retry-After``), ``POST /wake_up``
   (timed), then the first-token time of a request never seen before (no prefix-cache help), and the
   reference prompt again: its greedy output must be identical to the one before sleeping.

Memory at each step: the server's process tree (API server + engine-core child) summed from ``/proc``
(RSS and PSS), the engine's own ``kvfleet_engine_device_memory_bytes{kind=weights|kv_cache}`` from
``/metrics``, and on a GPU machine the device's used memory from ``torch.cuda.mem_get_info`` (this process
holds a CUDA context too; differences are what count). Freed = awake - asleep.

"Wake to first token" = wake_up time + first-token time of the next request; the issue's target compares it
with the cold start: **level-1 wake >= 10x faster than a cold start** (the ratio of the wake_up call alone is
reported too). Medians over ``--cycles``.

    .venv/bin/python -m bench.sleep_wake                                  # bench preset, levels 1 and 2
    .venv/bin/python -m bench.sleep_wake --preset small --cycles 2
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _serve_common as sc
from bench import _servers as servers

NAME = "sleep_wake"
TARGET_L1_SPEEDUP = 10.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="bench")
    p.add_argument("--levels", default="1,2", help="sleep levels to measure, in order (comma-separated)")
    p.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles per level (medians reported)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the probe requests")
    p.add_argument("--output-len", type=int, default=8, help="generated tokens of the probe requests")
    p.add_argument("--served-model-name", default="kvfleet-bench")
    p.add_argument("--max-model-len", type=int, default=None, help="kvfleet --max-model-len")
    p.add_argument("--kvfleet-args", default="", help="more kvfleet engine serve flags (one shell string)")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--admin-timeout", type=float, default=600.0, help="seconds for one sleep or wake call")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the contention probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server log (default bench/results/logs)")
    p.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    try:
        args.levels = [int(x) for x in str(args.levels).split(",") if x.strip()]
    except ValueError:
        p.error("--levels must be comma-separated integers")
    if not args.levels or any(lv not in (1, 2) for lv in args.levels):
        p.error("--levels must name levels 1 and/or 2")
    if args.cycles < 1 or args.prompt_len < 1 or args.output_len < 1:
        p.error("--cycles, --prompt-len and --output-len must be >= 1")
    return args


# ---- measurements --------------------------------------------------------------------------------


def gpu_used_bytes() -> int | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return total - free
    except Exception:
        return None


def engine_gauges(metrics_text: str) -> dict[str, float]:
    """``sleep_level`` and ``device_memory_<kind>`` from the engine's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kvfleet_engine_sleep_level":
                out["sleep_level"] = sample.value
            elif sample.name == "kvfleet_engine_device_memory_bytes":
                out[f"device_memory_{sample.labels.get('kind', '?')}"] = sample.value
    return out


async def memory_snapshot(client: Any, pid: int, expect_level: int | None = None) -> dict[str, Any]:
    """Memory of the server now; with ``expect_level``, first waits (up to 5 s) for ``/metrics`` to show that
    sleep level (its gauges follow the engine's periodic stats)."""
    deadline = time.perf_counter() + 5.0
    gauges: dict[str, float] = {}
    while True:
        resp = await client.get("/metrics")
        gauges = engine_gauges(resp.text) if resp.status_code == 200 else {}
        if (
            expect_level is None
            or gauges.get("sleep_level") == expect_level
            or time.perf_counter() > deadline
        ):
            break
        await asyncio.sleep(0.1)
    tree = servers.tree_memory(pid)
    return {
        "rss_bytes": tree["rss_bytes"],
        "pss_bytes": tree["pss_bytes"],
        "processes": len(tree["processes"]),
        "gpu_used_bytes": gpu_used_bytes(),
        **gauges,
    }


def freed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    keys = ("rss_bytes", "pss_bytes", "gpu_used_bytes", "device_memory_weights", "device_memory_kv_cache")
    return {
        k: before[k] - after[k]
        for k in keys
        if isinstance(before.get(k), (int, float)) and isinstance(after.get(k), (int, float))
    }


async def timed_admin(client: Any, method: str, path: str, token: str, timeout_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    resp = await client.request(method, path, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    dt = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:300]}")
    return {"seconds": dt, "response": resp.json()}


# ---- the run -------------------------------------------------------------------------------------


async def measure(
    proc: servers.ServerProcess, args: argparse.Namespace, token: str, prompts: list[str]
) -> dict[str, Any]:
    """``prompts``: [reference, cold-start probe, one fresh probe per wake]."""
    cmd = proc.command
    path = sc.ENDPOINTS["completions"]
    extras = sc.generation_extras("kvfleet", args.output_len)

    def body(prompt: str) -> dict[str, Any]:
        return sc.request_body("completions", cmd.request_model, prompt, args.output_len, extras)

    fresh = iter(prompts[2:])
    out: dict[str, Any] = {}
    async with sc.make_client(cmd.base_url, args.admin_timeout) as client:
        # Cold start: process spawn -> first token of a request sent as soon as /health answers.
        ready_s = await asyncio.to_thread(proc.wait_ready, args.startup_timeout, "/health", 0.05)
        first = await sc.stream_request(client, path, body(prompts[1]))
        if not first.ok:
            raise RuntimeError(f"first request after start failed: {first.error}")
        assert proc.started_at is not None and first.ttft is not None
        out["cold_start"] = {
            "ready_s": ready_s,
            "first_request_ttft_s": first.ttft,
            "to_first_token_s": first.sent + first.ttft - proc.started_at,
        }
        common.log(
            f"cold start: ready {ready_s:.2f}s, first token {out['cold_start']['to_first_token_s']:.2f}s"
        )
        ref = await sc.stream_request(client, path, body(prompts[0]), keep_text=True)
        if not ref.ok:
            raise RuntimeError(f"reference request failed: {ref.error}")
        out["reference_output_tokens"] = ref.output_tokens
        out["cold_start"]["second_request_ttft_s"] = ref.ttft
        cycles: list[dict[str, Any]] = []
        for cycle in range(args.cycles):
            for level in args.levels:
                awake = await memory_snapshot(client, proc.pid, expect_level=0)
                slept = await timed_admin(client, "POST", f"/sleep?level={level}", token, args.admin_timeout)
                asleep = await memory_snapshot(client, proc.pid, expect_level=level)
                refused = await sc.stream_request(client, path, body(prompts[0]))
                sleeping = await client.get("/is_sleeping", headers={"Authorization": f"Bearer {token}"})
                woke = await timed_admin(client, "POST", "/wake_up", token, args.admin_timeout)
                probe = await sc.stream_request(client, path, body(next(fresh)))
                again = await sc.stream_request(client, path, body(prompts[0]), keep_text=True)
                woken = await memory_snapshot(client, proc.pid, expect_level=0)
                if not probe.ok or not again.ok:
                    raise RuntimeError(f"request after wake failed: {probe.error or again.error}")
                assert probe.ttft is not None
                rec = {
                    "cycle": cycle,
                    "level": level,
                    "sleep_s": slept["seconds"],
                    "wake_s": woke["seconds"],
                    "first_token_after_wake_s": probe.ttft,
                    "second_request_ttft_s": again.ttft,
                    "wake_to_first_token_s": woke["seconds"] + probe.ttft,
                    "output_identical_after_wake": again.text == ref.text,
                    "request_while_asleep": {"status": refused.status, "retry_after": refused.retry_after},
                    "is_sleeping_while_asleep": sleeping.json().get("is_sleeping")
                    if sleeping.status_code == 200
                    else None,
                    "memory_awake": awake,
                    "memory_asleep": asleep,
                    "memory_after_wake": woken,
                    "freed": freed(awake, asleep),
                    "sleep_response": slept["response"],
                }
                cycles.append(rec)
                common.log(
                    f"cycle {cycle} level {level}: sleep {rec['sleep_s']:.3f}s, wake {rec['wake_s']:.3f}s, "
                    f"first token after wake {probe.ttft:.3f}s, identical {rec['output_identical_after_wake']}, "
                    f"freed PSS {rec['freed'].get('pss_bytes', 0) / 2**20:.0f} MiB"
                )
        out["cycles"] = cycles
    return out


def per_level(cycles: list[dict[str, Any]], cold_s: float) -> dict[str, Any]:
    """Medians per level, and the cold-start / wake speed-ups."""
    out: dict[str, Any] = {}
    for level in sorted({c["level"] for c in cycles}):
        cs = [c for c in cycles if c["level"] == level]

        def med(key: str, cs: list[dict[str, Any]] = cs) -> float:
            return statistics.median(c[key] for c in cs)

        freed_keys = sorted({k for c in cs for k in c["freed"]})
        w2t = med("wake_to_first_token_s")
        out[str(level)] = {
            "cycles": len(cs),
            "sleep_s": med("sleep_s"),
            "wake_s": med("wake_s"),
            "first_token_after_wake_s": med("first_token_after_wake_s"),
            "second_request_ttft_s": med("second_request_ttft_s"),
            "wake_to_first_token_s": w2t,
            "speedup_vs_cold_start": cold_s / w2t if w2t > 0 else None,
            "speedup_vs_cold_start_wake_call_only": cold_s / med("wake_s") if med("wake_s") > 0 else None,
            "freed_median": {
                k: statistics.median(c["freed"][k] for c in cs if k in c["freed"]) for k in freed_keys
            },
            "outputs_identical": all(c["output_identical_after_wake"] for c in cs),
            "refused_while_asleep": all(
                c["request_while_asleep"]["status"] == 503 and c["request_while_asleep"]["retry_after"]
                for c in cs
            ),
        }
    return out


def _mib(x: Any) -> str:
    return "-" if not isinstance(x, (int, float)) else f"{x / 2**20:,.0f}"


def render(result: dict[str, Any]) -> None:
    cold = result.get("cold_start") or {}
    rows = []
    if cold:
        rows.append(
            ["cold start", "-", "-", "-", f"{cold['to_first_token_s']:.2f}", "1.00x", "-", "-", "-", "-"]
        )
    for level, s in (result.get("levels") or {}).items():
        f = s["freed_median"]
        rows.append(
            [
                f"level {level}",
                f"{s['sleep_s']:.3f}",
                f"{s['wake_s']:.3f}",
                f"{s['first_token_after_wake_s']:.3f}",
                f"{s['wake_to_first_token_s']:.3f}",
                f"{s['speedup_vs_cold_start']:.1f}x",
                _mib(f.get("pss_bytes")),
                _mib(f.get("device_memory_weights", 0) + f.get("device_memory_kv_cache", 0))
                if "device_memory_weights" in f
                else "-",
                _mib(f.get("gpu_used_bytes")),
                "yes" if s["outputs_identical"] else "NO",
            ]
        )
    notes = list(result["notes"])
    if cold:
        notes.append(
            f"cold start: /health after {cold['ready_s']:.2f}s, then first token after {cold['first_request_ttft_s']:.3f}s"
            f" (the next request's TTFT: {cold['second_request_ttft_s']:.3f}s)"
        )
    for level, s in (result.get("levels") or {}).items():
        notes.append(
            f"level {level}: TTFT of the second request after wake {s['second_request_ttft_s']:.3f}s (median)"
        )
    tm = result.get("target_met")
    l1 = (result.get("levels") or {}).get("1")
    if l1:
        notes.append(
            f"target level-1 wake >= {TARGET_L1_SPEEDUP:g}x faster than cold start: {l1['speedup_vs_cold_start']:.1f}x "
            f"wake-to-first-token ({l1['speedup_vs_cold_start_wake_call_only']:.1f}x for the wake_up call alone): "
            f"{'met' if tm else 'NOT met'}"
        )
    for level, s in (result.get("levels") or {}).items():
        if not s["refused_while_asleep"]:
            notes.append(
                f"WARNING level {level}: a request while asleep was not refused with 503 + Retry-After"
            )
    if "error" in result:
        notes.append(f"failed: {result['error']}")
    common.print_table(
        f"Sleep / wake: {result['command']}",
        [
            "step",
            "sleep s",
            "wake s",
            "1st token s",
            "to 1st token s",
            "vs cold",
            "freed PSS MiB",
            "freed engine MiB",
            "freed GPU MiB",
            "same output",
        ],
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.set_threads(args.threads)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    log_dir = Path(args.log_dir) if args.log_dir else common.RESULTS_DIR / "logs"
    token = secrets.token_hex(16)
    tokenizer = sc.load_tokenizer(model_dir)
    n_probes = 2 + args.cycles * len(args.levels)
    prompts = sc.make_prompts(tokenizer, n_probes, args.prompt_len, args.seed)
    gpu_before = gpu_used_bytes()  # creates this process's CUDA context before the server starts

    cmd = servers.kvfleet_command(
        model_dir,
        servers.free_port(),
        args.served_model_name,
        max_model_len=args.max_model_len,
        admin_token=token,
        extra_args=shlex.split(args.kvfleet_args),
    )
    log_path = log_dir / f"sleep_wake-{time.strftime('%Y%m%d-%H%M%S')}.log"
    shown = "KVFLEET_ADMIN_TOKEN=<token> " + shlex.join(cmd.argv)  # the token is in its environment
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": shlex.join(
            [".venv/bin/python", "-m", "bench.sleep_wake", *(sys.argv[1:] if argv is None else argv)]
        ),
        "server_command": shown,
        "config": vars(args),
        "model": {"path": str(model_dir), "params": common.parameter_counts(model_dir)},
        "env": common.env_info(),
        "gpu_used_before_server_bytes": gpu_before,
        "server_log": str(log_path),
        "notes": [busy] if busy else [],
    }
    common.log(f"starting {shown}")
    proc = servers.ServerProcess(cmd, log_path)
    result["contention_before"] = common.contention()
    try:
        proc.start()
        result.update(asyncio.run(measure(proc, args, token, prompts)))
    except Exception as e:
        traceback.print_exc()
        result["error"] = f"{type(e).__name__}: {e}"
        result["server_log_tail"] = proc.log_tail()
    finally:
        result["exit_code"] = proc.stop()
        result["needed_sigkill"] = proc.needed_sigkill
    result["contention_after"] = common.contention()
    if "cycles" in result:
        result["levels"] = per_level(result["cycles"], result["cold_start"]["to_first_token_s"])
        l1 = result["levels"].get("1")
        result["target_met"] = None if l1 is None else l1["speedup_vs_cold_start"] >= TARGET_L1_SPEEDUP
    render(result)
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
