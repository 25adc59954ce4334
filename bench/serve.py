"""Serving benchmark: an asyncio load generator for OpenAI-compatible servers, and kvfleet's engine server
against ``transformers serve`` on the same model directory in the same run.

Every request streams (``stream: true``, ``stream_options.include_usage``) a deterministic synthetic prompt
of exactly ``--input-len`` tokens (vocabulary words of the model's own tokenizer, fixed seed) and asks for
exactly ``--output-len`` tokens, greedy: kvfleet gets ``min_tokens`` + ``ignore_eos``; ``transformers serve``
a ``generation_config`` with ``eos_token_id: -1`` (see ``_serve_common.generation_extras``). Every server's
``usage`` is checked against both lengths and the table says whether they matched. Per request: TTFT (first
chunk with text), inter-token latency per streamed chunk, TPOT ((E2E - TTFT) / (tokens - 1)), E2E. Warm-up
requests (same shapes, other prompts) run first and are excluded.

Load: ``--concurrency N`` workers in a closed loop (default), or ``--request-rate R`` Poisson arrivals per
second (open loop; ``--max-concurrency`` caps requests in flight).

Targets:

* ``kvfleet``: ``kvfleet engine serve --model DIR --host 127.0.0.1 --port P --served-model-name NAME
  [--max-model-len N] [--kvfleet-args ...]``.
* ``transformers``: ``transformers serve DIR --continuous-batching --device cpu --dtype float32 --host
  127.0.0.1 --port P --cb-num-blocks B --cb-max-batch-tokens T`` with ``HF_HUB_OFFLINE=1``, launched through
  ``bench/hf_serve_cpu.py`` because transformers 5.23 refuses ``device_map="cpu"`` without ``accelerate``
  (not a kvfleet dependency); the launcher maps a CPU-only device map to none, the same placement. Limits
  found: its ``/v1/models`` lists the hub cache (an empty ``HF_HUB_CACHE`` is given so it answers); it
  rejects unknown request fields (422), ignores ``stream_options`` but always sends usage in the last
  chunk; it has no ``min_tokens``/``ignore_eos``; continuous batching uses the first request's sampling
  settings for all requests (all are greedy here). Continuous batching does run on CPU (paged cache, SDPA).
  ``--cb-max-batch-tokens`` defaults to kvfleet's CPU token budget (2048) and ``--cb-num-blocks`` to room for
  every request in flight, since without ``psutil`` it cannot size its cache from free memory.
* ``url:<base>``: an already running server; ``--url-model`` names the model (default: the first of its
  ``/v1/models``) and ``--extra-body`` the JSON merged into each request (default: kvfleet's fields).

``--compare`` runs ``transformers`` then ``kvfleet``, one server at a time (each started on a free port
and stopped -- whole process group -- before the next), and reports kvfleet / transformers ratios.
Issue target at concurrency 32 on the ``small`` preset: >= 3x output tokens/s and <= 1/2 TTFT p50.

    .venv/bin/python -m bench.serve --compare                              # small preset, concurrency 32
    .venv/bin/python -m bench.serve --target transformers --preset tiny --num-requests 8 --concurrency 4
    .venv/bin/python -m bench.serve --target url:http://127.0.0.1:8000 --request-rate 4 --num-requests 100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _serve_common as sc
from bench import _servers as servers

NAME = "serve"
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_TTFT_RATIO = 0.5
KVFLEET_CPU_TOKEN_BUDGET = 2048  # EngineConfig's max_num_batched_tokens default on CPU
WARMUP_OUTPUT_TOKENS = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="small")
    t = p.add_argument_group("target")
    t.add_argument(
        "--target", default="kvfleet", help="kvfleet | transformers | url:<base URL> (default kvfleet)"
    )
    t.add_argument("--compare", action="store_true", help="run transformers then kvfleet and report ratios")
    t.add_argument("--served-model-name", default="kvfleet-bench", help="kvfleet --served-model-name")
    t.add_argument("--max-model-len", type=int, default=None, help="kvfleet --max-model-len")
    t.add_argument("--kvfleet-args", default="", help="more kvfleet engine serve flags (one shell string)")
    t.add_argument("--hf-args", default="", help="more transformers serve flags (one shell string)")
    t.add_argument(
        "--hf-no-continuous-batching",
        action="store_true",
        help="transformers serve without --continuous-batching",
    )
    t.add_argument(
        "--hf-cb-num-blocks", type=int, default=None, help="default: room for every request in flight"
    )
    t.add_argument("--hf-cb-max-batch-tokens", type=int, default=KVFLEET_CPU_TOKEN_BUDGET)
    t.add_argument(
        "--hf-cb-block-size", type=int, default=None, help="transformers' page size (its default 256)"
    )
    t.add_argument("--server-threads", type=int, default=None, help="OMP/MKL_NUM_THREADS for the servers")
    t.add_argument("--url-model", default=None, help="url target: model name (default: first of /v1/models)")
    t.add_argument("--extra-body", default=None, help="url target: JSON merged into each request")
    t.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    t.add_argument("--request-timeout", type=float, default=1800.0, help="per-request read timeout, seconds")
    t.add_argument("--log-dir", default=None, help="server logs (default bench/results/logs)")
    w = p.add_argument_group("workload")
    w.add_argument("--endpoint", choices=sorted(sc.ENDPOINTS), default="completions")
    w.add_argument("--num-requests", type=int, default=96)
    w.add_argument("--warmup-requests", type=int, default=4)
    w.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    w.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    w.add_argument("--concurrency", type=int, default=32, help="closed-loop workers")
    w.add_argument(
        "--request-rate", type=float, default=None, help="open loop: Poisson arrivals/s (inf = all)"
    )
    w.add_argument("--max-concurrency", type=int, default=None, help="open loop: cap on requests in flight")
    w.add_argument("--seed", type=int, default=0, help="prompt and arrival seed")
    m = p.add_argument_group("measurement")
    m.add_argument("--threads", type=int, default=2, help="torch threads of the contention probe")
    m.add_argument("--out", default=None, help="JSON output (default bench/results/serve[-TARGET].json)")
    args = p.parse_args(argv)
    if args.compare:
        args.targets = ["transformers", "kvfleet"]
    elif args.target in ("kvfleet", "transformers") or (
        args.target.startswith("url:") and len(args.target) > 4
    ):
        args.targets = [args.target]
    else:
        p.error(f"--target must be kvfleet, transformers or url:<base URL>, not {args.target!r}")
    for name in ("num_requests", "input_len", "output_len", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    if args.request_rate is not None and not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if args.extra_body is not None:
        try:
            args.extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            p.error(f"--extra-body is not JSON: {e}")
        if not isinstance(args.extra_body, dict):
            p.error("--extra-body must be a JSON object")
    return args


def command_line(argv: list[str] | None) -> str:
    return shlex.join([".venv/bin/python", "-m", "bench.serve", *(sys.argv[1:] if argv is None else argv)])


def in_flight(args: argparse.Namespace) -> int:
    if args.request_rate is None:
        return args.concurrency
    return args.max_concurrency or args.num_requests


def hf_num_blocks(args: argparse.Namespace) -> int:
    """Whole-model pages of transformers' cache: every request in flight at full length, twice over."""
    page = args.hf_cb_block_size or 256
    per_request = math.ceil((args.input_len + args.output_len) / page)
    return max(16, 2 * in_flight(args) * per_request)


# ---- one target ----------------------------------------------------------------------------------


def server_command(
    kind: str, args: argparse.Namespace, model_dir: Path, log_dir: Path
) -> servers.ServerCommand:
    port = servers.free_port()
    if kind == "kvfleet":
        return servers.kvfleet_command(
            model_dir,
            port,
            args.served_model_name,
            max_model_len=args.max_model_len,
            extra_args=shlex.split(args.kvfleet_args),
        )
    return servers.transformers_command(
        model_dir,
        port,
        continuous_batching=not args.hf_no_continuous_batching,
        cb_block_size=args.hf_cb_block_size,
        cb_num_blocks=args.hf_cb_num_blocks or hf_num_blocks(args),
        cb_max_batch_tokens=args.hf_cb_max_batch_tokens,
        extra_args=shlex.split(args.hf_args),
        hub_cache=log_dir / "empty-hf-hub-cache",
    )


def url_model(base_url: str) -> str:
    import httpx

    data = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30).json()
    models = [m["id"] for m in data.get("data") or ()]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --url-model")
    return models[0]


async def drive(
    base_url: str,
    path: str,
    warm_bodies: list[dict[str, Any]],
    bodies: list[dict[str, Any]],
    args: argparse.Namespace,
    label: str,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    async with sc.make_client(base_url, args.request_timeout) as client:
        warm_summary = None
        if warm_bodies:
            common.log(f"{label}: {len(warm_bodies)} warm-up requests")
            warm, warm_wall = await sc.run_load(
                client, path, warm_bodies, concurrency=min(args.concurrency, len(warm_bodies))
            )
            warm_summary = sc.summarize(warm, warm_wall, None, WARMUP_OUTPUT_TOKENS)
            if not any(r.ok for r in warm):
                raise RuntimeError(f"every warm-up request failed: {warm_summary['errors']}")
        contention_before = common.contention()
        with tqdm(total=len(bodies), desc=label, unit="req") as bar:
            results, wall = await sc.run_load(
                client,
                path,
                bodies,
                concurrency=args.max_concurrency if args.request_rate is not None else args.concurrency,
                rate=args.request_rate,
                seed=args.seed,
                on_done=lambda r: bar.update(1),
            )
        contention_after = common.contention()
    return {
        "summary": sc.summarize(
            results, wall, args.input_len if args.endpoint == "completions" else None, args.output_len
        ),
        "warmup": warm_summary,
        "contention_before": contention_before,
        "contention_after": contention_after,
        "requests": sc.result_records(results),
    }


def run_target(
    kind: str,
    args: argparse.Namespace,
    model_dir: Path,
    prompts: list[str],
    warm_prompts: list[str],
    log_dir: Path,
) -> dict[str, Any]:
    path = sc.ENDPOINTS[args.endpoint]
    info: dict[str, Any] = {"target": kind}
    proc: servers.ServerProcess | None = None
    try:
        if kind.startswith("url:"):
            base_url = kind[4:].rstrip("/")
            model = args.url_model or url_model(base_url)
            profile = None
        else:
            cmd = server_command(kind, args, model_dir, log_dir)
            base_url, model, profile = cmd.base_url, cmd.request_model, cmd.extra_body_for
            log_path = log_dir / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.log"
            proc = servers.ServerProcess(cmd, log_path, threads=args.server_threads)
            info.update({"command": shlex.join(cmd.argv), "env": cmd.env, "log": str(log_path)})
            common.log(f"{kind}: starting {shlex.join(cmd.argv)}")
            proc.start()
            info["startup_s"] = proc.wait_ready(args.startup_timeout)
            info["server_pid"] = proc.pid
            common.log(f"{kind}: ready after {info['startup_s']:.1f}s")
            info["memory_idle"] = servers.tree_memory(proc.pid)

        def bodies_for(texts: list[str], n_out: int) -> list[dict[str, Any]]:
            extras = sc.generation_extras(profile, n_out) if profile else _url_extras(args, n_out)
            return [sc.request_body(args.endpoint, model, t, n_out, extras) for t in texts]

        warm_out = min(WARMUP_OUTPUT_TOKENS, args.output_len)
        info["request_example"] = {**bodies_for(prompts[:1], args.output_len)[0], "prompt": "..."}
        run = asyncio.run(
            drive(
                base_url,
                path,
                bodies_for(warm_prompts, warm_out),
                bodies_for(prompts, args.output_len),
                args,
                kind,
            )
        )
        if run["warmup"] is not None:
            run["warmup"]["output_tokens_exact"] = run["warmup"]["output_tokens_per_request"] == [warm_out]
        info.update(run)
        if proc is not None:
            info["memory_after"] = servers.tree_memory(proc.pid)
            proc.check_alive()
    except Exception as e:
        traceback.print_exc()
        info["error"] = f"{type(e).__name__}: {e}"
    finally:
        if proc is not None:
            info["exit_code"] = proc.stop()
            info["needed_sigkill"] = proc.needed_sigkill
    return info


def _url_extras(args: argparse.Namespace, n_out: int) -> dict[str, Any]:
    if args.extra_body is not None:
        return dict(args.extra_body)
    return sc.generation_extras("kvfleet", n_out)


# ---- report --------------------------------------------------------------------------------------


def ratios(kv: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """kvfleet / transformers for each headline metric (None where either is missing)."""

    def get(s: dict[str, Any], *keys: str) -> float | None:
        for k in keys:
            s = s.get(k) if isinstance(s, dict) else None
        return s if isinstance(s, (int, float)) else None

    out: dict[str, Any] = {}
    for name, keys in {
        "output_tok_s": ("output_tok_s",),
        "request_throughput": ("request_throughput",),
        "ttft_p50": ("ttft_ms", "p50"),
        "ttft_p99": ("ttft_ms", "p99"),
        "itl_p50": ("itl_ms", "p50"),
        "itl_p99": ("itl_ms", "p99"),
        "tpot_p50": ("tpot_ms", "p50"),
        "e2e_p50": ("e2e_ms", "p50"),
    }.items():
        a, b = get(kv.get("summary", {}), *keys), get(hf.get("summary", {}), *keys)
        out[name] = a / b if a is not None and b else None
    return out


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x:,.1f}"


def render(result: dict[str, Any]) -> None:
    rows, notes = [], []
    for name, t in result["targets"].items():
        s = t.get("summary")
        if s is None:
            rows.append([name, "error", *["-"] * 9])
            continue
        exact = "yes" if s["output_tokens_exact"] else f"NO {s['output_tokens_per_request']}"
        rows.append(
            [
                name,
                f"{s['completed']}/{s['requests']}",
                f"{s['request_throughput']:.2f}",
                f"{s['output_tok_s']:.1f}",
                _ms(s["ttft_ms"]["p50"]),
                _ms(s["ttft_ms"]["p99"]),
                _ms(s["itl_ms"]["p50"]),
                _ms(s["itl_ms"]["p99"]),
                _ms(s["tpot_ms"]["p50"]),
                _ms(s["e2e_ms"]["p50"]),
                exact,
            ]
        )
    wl = result["workload"]
    notes.append(
        f"{wl['num_requests']} requests ({wl['warmup_requests']} warm-up excluded), {wl['endpoint']}, "
        f"{wl['input_len']} prompt + {wl['output_len']} output tokens each, greedy, streamed; load: {wl['load']}"
    )
    for name, t in result["targets"].items():
        if "error" in t:
            notes.append(f"{name} failed: {t['error']}")
        if "startup_s" in t:
            notes.append(f"{name}: ready {t['startup_s']:.1f}s after start; log {t.get('log')}")
        s = t.get("summary") or {}
        if s.get("prompt_tokens_as_built") is False:
            notes.append(
                f"WARNING {name}: prompt tokens per request {s['prompt_tokens_per_request']}, built {wl['input_len']}"
            )
        if s.get("errors"):
            notes.append(f"{name} errors: {s['errors']}")
        c0, c1 = t.get("contention_before"), t.get("contention_after")
        if c0 and c1:
            notes.append(
                f"{name}: contention probe {c0['small_op_ms']:.2f}/{c1['small_op_ms']:.2f} ms before/after "
                f"(idle < {common.CONTENDED_MS:g}), load average {c0['loadavg']} -> {c1['loadavg']}"
            )
    notes.extend(result["notes"])
    r = result.get("ratios")
    if r:
        tput, ttft = r["output_tok_s"], r["ttft_p50"]
        notes.append(
            "kvfleet / transformers: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if v is not None)
        )
        tg = result["targets_met"]
        notes.append(
            f"target output tok/s >= {TARGET_THROUGHPUT_RATIO:g}x: "
            f"{'-' if tput is None else f'{tput:.2f}x'} ({'met' if tg['throughput'] else 'NOT met'}); "
            f"target TTFT p50 <= {TARGET_TTFT_RATIO:g}x: {'-' if ttft is None else f'{ttft:.2f}x'} "
            f"({'met' if tg['ttft'] else 'NOT met'})"
        )
    common.print_table(
        f"Serving benchmark: {result['command']}",
        [
            "target",
            "ok",
            "req/s",
            "out tok/s",
            "TTFT p50 ms",
            "TTFT p99",
            "ITL p50 ms",
            "ITL p99",
            "TPOT p50 ms",
            "E2E p50 ms",
            "exact tokens",
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
    log_dir.mkdir(parents=True, exist_ok=True)

    common.log(f"building {args.warmup_requests} + {args.num_requests} prompts of {args.input_len} tokens")
    tokenizer = sc.load_tokenizer(model_dir)
    texts = sc.make_prompts(tokenizer, args.warmup_requests + args.num_requests, args.input_len, args.seed)
    warm_prompts, prompts = texts[: args.warmup_requests], texts[args.warmup_requests :]

    targets: dict[str, Any] = {}
    for kind in args.targets:
        targets[kind] = run_target(kind, args, model_dir, prompts, warm_prompts, log_dir)

    if args.request_rate is None:
        load = f"closed loop, concurrency {args.concurrency}"
    else:
        cap = f", at most {args.max_concurrency} in flight" if args.max_concurrency else ""
        load = f"open loop, Poisson {args.request_rate:g} req/s{cap} (seed {args.seed})"
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": command_line(argv),
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "model": {
            "path": str(model_dir),
            "architecture": common.read_model_config(model_dir).get("architectures", [None])[0],
            "params": common.parameter_counts(model_dir),
        },
        "workload": {
            "endpoint": args.endpoint,
            "num_requests": args.num_requests,
            "warmup_requests": args.warmup_requests,
            "warmup_output_len": min(WARMUP_OUTPUT_TOKENS, args.output_len),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "load": load,
            "greedy": True,
            "seed": args.seed,
        },
        "env": common.env_info(),
        "targets": targets,
        "notes": [busy] if busy else [],
    }
    if "kvfleet" in targets and "transformers" in targets:
        r = ratios(targets["kvfleet"], targets["transformers"])
        result["ratios"] = r
        result["targets_met"] = {
            "throughput": r["output_tok_s"] is not None and r["output_tok_s"] >= TARGET_THROUGHPUT_RATIO,
            "ttft": r["ttft_p50"] is not None and r["ttft_p50"] <= TARGET_TTFT_RATIO,
        }
    render(result)
    name = NAME if args.compare else f"{NAME}-{args.targets[0].split(':')[0]}"
    common.write_json(args.out or common.default_out(name), result)
    return result


if __name__ == "__main__":
    main()
