"""GPU throughput: kvfleet offline and served vs Hugging Face static and continuous batching, in one run.

Workload (defaults, nano-vllm's benchmark shape): the ``bench`` demo model (Qwen2-0.5B shape, ``--arch
qwen2``) in bfloat16, 256 requests of random token ids, prompt lengths uniform in [100, 1024], output lengths
uniform in [100, 1024], greedy, EOS ignored, seed 0 (``bench/_offline.py``'s ``make_workload``, the one
``bench/engine_throughput.py`` uses). Requests go in arrival order (never sorted by length).

Systems, one after another on the same device (each releases its memory before the next starts):

* ``kvfleet-offline``: one ``LLM.generate`` call with per-request ``SamplingParams(max_tokens=k,
  ignore_eos=True, temperature=0)``.
* ``kvfleet-server``: ``kvfleet engine serve`` as a subprocess, all requests sent at once to
  ``/v1/completions`` (prompt as token ids, ``max_tokens = min_tokens = k``, ``ignore_eos``, greedy; not
  streamed unless ``--server-stream``); output tokens are the responses' ``usage.completion_tokens``. Timed
  from the first request sent to the last response; server start-up is not timed.
* ``hf-static``: ``model.generate`` over left-padded batches of ``--hf-batch-size`` requests (default: all of
  them in one batch), ``max_new_tokens = min_new_tokens =`` the batch's largest ask, greedy, SDPA; only the
  tokens each request asked for are counted.
* ``hf-continuous``: transformers' continuous batching, ``model.generate_batch`` (one ``max_new_tokens``, the
  largest ask, for every request; only the asked tokens are counted), or ``--hf-cb-api manager`` for the
  manager's ``add_request`` with each request's own ``max_new_tokens``.

Every system gets an untimed warm-up (2 short requests) first. Targets: kvfleet offline >= 20,000 output
tok/s, >= 8x HF static batching, and the server >= 0.9x kvfleet offline.

    .venv/bin/python -m bench.gpu_throughput                      # on the GPU machine
    .venv/bin/python -m bench.gpu_throughput --device cpu --dtype float32 --preset tiny --num-requests 8 \\
        --min-prompt 8 --max-prompt 32 --min-output 4 --max-output 16           # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _offline as offline
from bench import _serve_common as sc
from bench import _servers as servers

NAME = "gpu_throughput"
TARGET_OFFLINE_TOK_S = 20_000.0
TARGET_VS_HF_STATIC = 8.0
TARGET_SERVER_VS_OFFLINE = 0.9
SERVED_MODEL_NAME = "kvfleet-bench"
OFFLINE, SERVER, HF_STATIC, HF_CB = "kvfleet-offline", "kvfleet-server", "hf-static", "hf-continuous"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="bench", default_arch="qwen2")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cuda, cuda:N, cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    offline.add_workload_args(p, "--num-requests", 256, (100, 1024), (100, 1024))
    k = p.add_argument_group("kvfleet (offline and server)")
    k.add_argument("--max-num-seqs", type=int, default=256)
    k.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine default when not given")
    k.add_argument("--max-model-len", type=int, default=None, help="default: --max-prompt + --max-output")
    k.add_argument("--gpu-memory-utilization", type=float, default=None, help="engine default when not given")
    k.add_argument(
        "--enforce-eager", action="store_true", help="pass enforce_eager=True / --enforce-eager to kvfleet"
    )
    k.add_argument(
        "--async-scheduling",
        action="store_true",
        help="pass async_scheduling=True / --async-scheduling to kvfleet (schedule step n+1 while n runs)",
    )
    k.add_argument("--skip-server", action="store_true", help="skip the kvfleet server")
    k.add_argument("--server-stream", action="store_true", help="stream the server's responses (SSE)")
    k.add_argument("--server-args", default="", help="extra `kvfleet engine serve` flags (one string)")
    k.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for the server to get ready")
    k.add_argument("--request-timeout", type=float, default=3600.0)
    k.add_argument("--log-dir", default=None, help=f"server logs (default {common.RESULTS_DIR / 'logs'})")
    h = p.add_argument_group("Hugging Face")
    h.add_argument("--skip-hf", action="store_true", help="skip both HF baselines")
    h.add_argument("--skip-hf-cb", action="store_true", help="skip HF continuous batching")
    h.add_argument(
        "--hf-batch-size", type=int, default=None, help="HF static batch size (default: all requests)"
    )
    offline.add_hf_cb_args(h, default_api="generate_batch")
    m = p.add_argument_group("measurement")
    m.add_argument("--threads", type=int, default=None, help="torch threads here (default: torch's)")
    m.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up requests")
    m.add_argument("--check", type=int, default=4, help="compare the first N requests' greedy outputs")
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    offline.check_workload_args(p, args, "--num-requests")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    if args.max_model_len is None:
        args.max_model_len = args.max_prompt + args.max_output
    return args


# ---- kvfleet -------------------------------------------------------------------------------------


def engine_args(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments; ``enforce_eager`` and ``async_scheduling`` only when their flags are given."""
    kw: dict[str, Any] = {
        "dtype": args.dtype,
        "device": device,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
    }
    for name in ("max_num_batched_tokens", "gpu_memory_utilization"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if args.async_scheduling:
        kw["async_scheduling"] = True
    return kw


def server_flags(args: argparse.Namespace, device: str) -> list[str]:
    """``kvfleet engine serve`` flags matching :func:`engine_args` (``--max-model-len`` goes separately)."""
    flags = []
    for name, value in engine_args(args, device).items():
        if name == "max_model_len":
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags + shlex.split(args.server_args)


async def _drive_server(
    base_url: str,
    warm_bodies: list[dict[str, Any]],
    bodies: list[dict[str, Any]],
    stream: bool,
    timeout_s: float,
) -> tuple[list[sc.RequestResult], float]:
    from tqdm.auto import tqdm

    send = sc.stream_request if stream else sc.complete_request
    path = sc.ENDPOINTS["completions"]
    async with sc.make_client(base_url, timeout_s) as client:
        if warm_bodies:
            warm, _ = await sc.run_load(client, path, warm_bodies, concurrency=len(warm_bodies), send=send)
            bad = [r.error for r in warm if not r.ok]
            if bad:
                raise RuntimeError(f"{len(bad)} warm-up requests failed: {bad[0]}")
        with tqdm(total=len(bodies), desc="kvfleet server", unit="req") as bar:
            return await sc.run_load(
                client, path, bodies, concurrency=len(bodies), send=send, on_done=lambda r: bar.update(1)
            )


def _p50_p99(seconds: list[float]) -> dict[str, float | None]:
    return {f"p{q}": None if not seconds else 1e3 * (sc.percentile(seconds, q) or 0.0) for q in (50, 99)}


def run_server(
    model_dir: Path, work: offline.Workload, args: argparse.Namespace, device: str, log_dir: Path
) -> dict[str, Any]:
    """Start ``kvfleet engine serve``, send every request at once, stop the server."""
    prompts, outs, warm = work
    cmd = servers.kvfleet_command(
        model_dir,
        servers.free_port(),
        SERVED_MODEL_NAME,
        max_model_len=args.max_model_len,
        extra_args=server_flags(args, device),
    )
    log_path = log_dir / f"kvfleet-server-{time.strftime('%Y%m%d-%H%M%S')}.log"
    info: dict[str, Any] = {
        "command": shlex.join(cmd.argv),
        "log": str(log_path),
        "stream": args.server_stream,
    }

    def bodies(ps: list[list[int]], ks: list[int]) -> list[dict[str, Any]]:
        extras = sc.generation_extras  # min_tokens = max_tokens, ignore_eos
        return [
            sc.request_body("completions", SERVED_MODEL_NAME, p, k, extras("kvfleet", k), args.server_stream)
            for p, k in zip(ps, ks)
        ]

    proc = servers.ServerProcess(cmd, log_path)
    common.log(f"kvfleet server: starting {info['command']}")
    proc.start()
    try:
        info["startup_s"] = proc.wait_ready(args.startup_timeout)
        common.log(f"kvfleet server: ready after {info['startup_s']:.1f}s")
        warm_bodies = [] if args.no_warmup else bodies(warm, [offline.WARMUP_TOKENS] * len(warm))
        results, wall = asyncio.run(
            _drive_server(
                cmd.base_url, warm_bodies, bodies(prompts, outs), args.server_stream, args.request_timeout
            )
        )
        proc.check_alive()
    finally:
        info["exit_code"] = proc.stop()
        info["needed_sigkill"] = proc.needed_sigkill
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} server requests failed: {failed[0].error}")
    e2e = [r.e2e for r in results if r.e2e is not None]
    ttft = [r.ttft for r in results if r.ttft is not None]
    return {
        **info,
        "wall_s": wall,
        "generated_tokens": sum(r.output_tokens or 0 for r in results),
        "requests_with_other_output_tokens": sum(1 for r, k in zip(results, outs) if r.output_tokens != k),
        "prompt_tokens_as_sent": all(r.prompt_tokens == len(p) for r, p in zip(results, prompts)),
        "finish_reasons": sorted({str(r.finish_reason) for r in results}),
        "e2e_ms": _p50_p99(e2e),
        **({"ttft_ms": _p50_p99(ttft)} if ttft else {}),
    }


# ---- report --------------------------------------------------------------------------------------


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or "output_tok_s" not in a or not b.get("output_tok_s"):
        return None
    return a["output_tok_s"] / b["output_tok_s"]


def _target(value: float | None, target: float, tokens_ok: bool) -> dict[str, Any]:
    """A target's entry: met only when the value reaches it and the systems involved produced every asked token."""
    return {
        "target": target,
        "value": value,
        "met": value is not None and tokens_ok and value >= target,
    }


def evaluate(systems: dict[str, dict[str, Any]], output_tokens: int) -> dict[str, Any]:
    """Per-system output tok/s and ratios (in place), and the targets."""
    for s in systems.values():
        if "error" in s:
            continue
        s["output_tok_s"] = s["generated_tokens"] / s["wall_s"]
        s["tokens_match_workload"] = s["generated_tokens"] == output_tokens
    hf, kv = systems.get(HF_STATIC), systems.get(OFFLINE)
    for s in systems.values():
        if "error" not in s:
            s["vs_hf_static"] = _ratio(s, hf)
            s["vs_kvfleet_offline"] = _ratio(s, kv)

    def ok(*names: str) -> bool:
        return all(systems.get(n, {}).get("tokens_match_workload") is True for n in names)

    kvs = systems.get(OFFLINE) or {}
    targets = {
        "offline_output_tok_s": _target(kvs.get("output_tok_s"), TARGET_OFFLINE_TOK_S, ok(OFFLINE)),
        "offline_vs_hf_static": _target(kvs.get("vs_hf_static"), TARGET_VS_HF_STATIC, ok(OFFLINE, HF_STATIC)),
        "server_vs_offline": _target(
            (systems.get(SERVER) or {}).get("vs_kvfleet_offline"),
            TARGET_SERVER_VS_OFFLINE,
            ok(OFFLINE, SERVER),
        ),
    }
    return {"targets": targets, "all_met": all(t["met"] for t in targets.values())}


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cells(name: str, s: dict[str, Any]) -> list[str]:
    """A system's row: its name (with the batch size for HF static), then the numbers (or its error)."""
    label = f"{name} (bs={s['batch_size']})" if name == HF_STATIC and "batch_size" in s else name
    if "error" in s:
        return [label, "error", *["-"] * 4]
    numbers = (f"{s['generated_tokens']:,}", f"{s['wall_s']:.2f}", f"{s['output_tok_s']:,.1f}")
    return [label, *numbers, _x(s["vs_hf_static"]), _x(s["vs_kvfleet_offline"])]


def render(result: dict[str, Any]) -> None:
    rows = [_cells(name, s) for name, s in result["systems"].items()]
    wl, env = result["workload"], result["env"]
    notes = [
        f"{result['card']} ({result['device']}), {result['dtype']}, {result['arch']}-{result['preset']} model; "
        f"torch {env['torch']}, transformers {env['transformers']}",
        f"{wl['num_requests']} requests, prompt {wl['prompt_len']} / output {wl['output_len']} tokens (uniform), "
        f"seed {wl['seed']}: {wl['prompt_tokens']:,} prompt + {wl['output_tokens']:,} output tokens, "
        "greedy, EOS ignored",
    ]
    for name, s in result["systems"].items():
        if "error" in s:
            notes.append(f"{name} failed: {s['error']}")
        elif not s["tokens_match_workload"]:
            notes.append(
                f"WARNING {name}: {s['generated_tokens']:,} output tokens, {wl['output_tokens']:,} asked"
            )
    labels = {
        "offline_output_tok_s": "kvfleet offline output tok/s",
        "offline_vs_hf_static": "kvfleet offline vs HF static",
        "server_vs_offline": "kvfleet server vs offline",
    }
    for key, t in result["targets"].items():
        v = t["value"]
        shown = "-" if v is None else (f"{v:,.0f}" if key == "offline_output_tok_s" else f"{v:.2f}x")
        target = f"{t['target']:,.0f}" if key == "offline_output_tok_s" else f"{t['target']:g}x"
        verdict = "not measured" if v is None else ("PASS" if t["met"] else "FAIL")
        notes.append(f"target {labels[key]} >= {target}: {shown} ({verdict})")
    for name, c in result["sanity"].items():
        notes.append(
            f"sanity {name}: {c['exact_matches']}/{c['compared']} identical greedy outputs; "
            f"common prefix {c['common_prefix_lens']} of {c['lens']} tokens"
        )
    notes.extend([*result["notes"], f"command: {result['command']}"])
    common.print_table(
        f"Offline and served throughput on {result['card']} ({result['dtype']})",
        ["system", "output tokens", "seconds", "output tok/s", "vs HF static", "vs kvfleet offline"],
        rows,
        notes,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        common.set_threads(args.threads)
    device = common.resolve_device(args.device)
    card = common.device_name(device)
    notes: list[str] = []
    if device == "cpu":
        busy = common.busy_machine_warning()
        notes += [busy] if busy else []
    model_dir = common.resolve_model(args)
    work = offline.workload_from_args(args, args.num_requests, model_dir)
    prompts, outs, _ = work
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(outs)
    common.log(
        f"{card}: {args.dtype} {model_dir}; {len(prompts)} requests, {prompt_tokens:,} prompt + "
        f"{output_tokens:,} output tokens"
    )
    log_dir = Path(args.log_dir) if args.log_dir else common.RESULTS_DIR / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    systems: dict[str, dict[str, Any]] = {}
    kw = engine_args(args, device)
    offline.run_system(
        systems, OFFLINE, lambda: offline.run_kvfleet(model_dir, work, kw, warmup=not args.no_warmup)
    )
    common.release_device_memory()  # the server process needs the memory the offline engine held
    if not args.skip_server:
        offline.run_system(systems, SERVER, lambda: run_server(model_dir, work, args, device, log_dir))
    if not args.skip_hf:
        kv_budget = (systems[OFFLINE].get("engine_config") or {}).get("max_num_batched_tokens")
        offline.run_hf_baselines(
            systems,
            model_dir,
            work,
            args,
            batch_sizes=[args.hf_batch_size or len(prompts)],
            static_name=HF_STATIC,
            max_batch_tokens=args.hf_cb_max_batch_tokens or kv_budget or args.max_num_batched_tokens or 8192,
            cb_warmup=not args.no_warmup,
            dtype=args.dtype,
            device=device,
            progress=device == "cpu",  # the per-step bar copies each step's tokens to the host
        )

    verdict = evaluate(systems, output_tokens)
    kv = systems[OFFLINE]
    sanity = {
        f"{OFFLINE} vs {name}": offline.compare(kv["_tokens"], s["_tokens"], args.check)
        for name, s in systems.items()
        if name != OFFLINE and "_tokens" in s and "_tokens" in kv
    }
    env = common.env_info()
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": common.command_line("bench.gpu_throughput", argv),
        "card": card,
        "device": device,
        "dtype": args.dtype,
        "preset": args.preset,
        "arch": args.arch,
        "torch": env["torch"],
        "transformers": env["transformers"],
        "model": {
            "arch": args.arch,
            "preset": args.preset,
            "path": str(model_dir),
            "architecture": common.read_model_config(model_dir).get("architectures", [None])[0],
            "params": common.parameter_counts(model_dir),
        },
        "workload": {
            "num_requests": len(prompts),
            "prompt_len": [args.min_prompt, args.max_prompt],
            "output_len": [args.min_output, args.max_output],
            "seed": args.seed,
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "ignore_eos": True,
            "greedy": True,
        },
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "env": env,
        "systems": {
            k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in systems.items()
        },
        **verdict,
        "sanity": sanity,
        "notes": notes,
    }
    render(result)
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
