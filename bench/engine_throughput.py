"""Offline throughput: kvfleet ``LLM.generate`` vs Hugging Face ``generate`` (static batching) and HF's
continuous batching, on the same random-token workload in the same run.

Workload (defaults): the ``small`` demo model in float32, 128 prompts of random token ids with lengths
uniform in [32, 512] and output lengths uniform in [32, 256], greedy, EOS ignored, fixed seed. Requests are
submitted in arrival order (never sorted by length).

Systems:

* ``kvfleet``: one ``LLM.generate`` call with per-request ``SamplingParams(max_tokens=k, ignore_eos=True,
  temperature=0)``.
* ``hf-static-bs<B>``: ``model.generate`` over consecutive batches of B requests, left-padded (pad = EOS,
  attention mask), ``max_new_tokens = min_new_tokens =`` the batch's largest ask (so EOS cannot end a row
  early), greedy; SDPA attention. Only the tokens each request asked for are counted as output.
* ``hf-continuous``: transformers' continuous batching (paged cache, background generation thread). By
  default requests go through the manager's ``add_request`` with their own ``max_new_tokens`` (the API that
  ``generate_batch`` wraps, which itself takes a single ``max_new_tokens`` for all requests); ``--hf-cb-api
  generate_batch`` calls ``model.generate_batch`` with the largest ask and counts only the asked tokens.

Every system gets the same untimed warm-up (2 short requests); only generation is timed (model loading,
KV-cache allocation and HF's CB manager set-up are not). The machine's float32 matmul FLOP/s is measured
in the same run (before and after; the higher is used) and compute efficiency is

    (prompt + generated tokens) x 2 x (non-embedding + LM-head parameters) / FLOP/s / wall seconds.

Targets (issue): kvfleet >= 3x HF's best output tokens/s, and >= 50 % compute efficiency.

    .venv/bin/python -m bench.engine_throughput                      # full run (10-20 min on 2 cores)
    .venv/bin/python -m bench.engine_throughput --num-prompts 16 --skip-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench import _common as common
from bench import _offline as offline

NAME = "engine_throughput"
TARGET_SPEEDUP = 3.0
TARGET_EFFICIENCY = 0.50


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="small")
    offline.add_workload_args(p, "--num-prompts", 128, (32, 512), (32, 256))
    s = p.add_argument_group("systems")
    s.add_argument(
        "--threads", type=int, default=2, help="torch threads for every system and the matmul probe"
    )
    s.add_argument("--max-num-seqs", type=int, default=256, help="kvfleet max_num_seqs")
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="kvfleet token budget per step (engine default)",
    )
    s.add_argument("--skip-kvfleet", action="store_true")
    s.add_argument("--skip-hf", action="store_true", help="skip both HF baselines")
    s.add_argument("--skip-hf-cb", action="store_true", help="skip HF continuous batching")
    s.add_argument("--hf-batch-sizes", default="16,64", help="HF static batch sizes (comma-separated)")
    offline.add_hf_cb_args(s, default_api="manager")
    s.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up requests")
    m = p.add_argument_group("measurement")
    m.add_argument("--matmul-n", type=int, default=2048, help="matmul size for the FLOP/s probe")
    m.add_argument("--matmul-reps", type=int, default=8)
    m.add_argument("--check", type=int, default=4, help="compare the first N requests' greedy outputs")
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    offline.check_workload_args(p, args, "--num-prompts")
    try:
        args.hf_batch_sizes = [int(b) for b in str(args.hf_batch_sizes).split(",") if b.strip()]
    except ValueError:
        p.error("--hf-batch-sizes must be comma-separated integers")
    if any(b < 1 for b in args.hf_batch_sizes):
        p.error("--hf-batch-sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.set_threads(args.threads)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    params = common.parameter_counts(model_dir)
    model_cfg = common.read_model_config(model_dir)
    work = offline.workload_from_args(args, args.num_prompts, model_dir)
    prompts, outs, _ = work
    prompt_tokens, output_tokens = sum(len(p) for p in prompts), sum(outs)
    total_tokens = prompt_tokens + output_tokens
    common.log(
        f"model {model_dir} ({params['flop_params']:,} non-embedding + LM-head parameters); "
        f"{len(prompts)} prompts, {prompt_tokens:,} prompt + {output_tokens:,} output tokens"
    )

    common.log("measuring float32 matmul FLOP/s")
    flops_before = common.measure_matmul_flops(args.matmul_n, args.matmul_reps)
    common.log(f"  {flops_before['flops'] / 1e9:.1f} GFLOP/s")

    systems: dict[str, dict[str, Any]] = {}
    notes: list[str] = [busy] if busy else []
    kv_budget = None
    if not args.skip_kvfleet:
        engine_args: dict[str, Any] = {"dtype": "float32", "max_num_seqs": args.max_num_seqs}
        if args.max_num_batched_tokens is not None:
            engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
        offline.run_system(
            systems,
            "kvfleet",
            lambda: offline.run_kvfleet(model_dir, work, engine_args, warmup=not args.no_warmup),
        )
        kv_budget = systems["kvfleet"].get("engine_config", {}).get("max_num_batched_tokens")

    if not args.skip_hf:
        offline.run_hf_baselines(
            systems,
            model_dir,
            work,
            args,
            batch_sizes=args.hf_batch_sizes,
            static_name="hf-static-bs{bs}",
            max_batch_tokens=args.hf_cb_max_batch_tokens or kv_budget or args.max_num_batched_tokens or 2048,
            # generate_batch: its manager set-up and warm-up are timed (see the note below)
            cb_warmup=not args.no_warmup and args.hf_cb_api == "manager",
        )
        notes.append(
            "hf-static: consecutive batches in arrival order, left-padded with pad=EOS and an attention mask, "
            "max_new_tokens = min_new_tokens = the batch's largest ask, greedy, sdpa; output tok/s and efficiency "
            "count only the tokens each request asked for (padded_token_positions is what was processed)."
        )
        if not args.skip_hf_cb:
            if args.hf_cb_api == "manager":
                notes.append(
                    "hf-continuous: transformers continuous batching through model.continuous_batching_context_manager"
                    " + manager.add_request(max_new_tokens=<each request's ask>, eos_token_id=-1), the API that "
                    "model.generate_batch wraps (generate_batch itself takes one max_new_tokens for all requests). "
                    "Manager set-up and warm-up are not timed."
                )
            else:
                notes.append(
                    "hf-continuous: model.generate_batch with max_new_tokens = the largest ask for every request "
                    "(it has no per-request limit); only the asked tokens are counted; its manager set-up and "
                    "warm-up are inside the timed call."
                )

    common.log("measuring float32 matmul FLOP/s again")
    flops_after = common.measure_matmul_flops(args.matmul_n, args.matmul_reps)
    peak = max(flops_before["flops"], flops_after["flops"])

    # Per-system metrics.
    for s in systems.values():
        if "error" in s:
            continue
        w = s["wall_s"]
        s["prompt_tokens"] = prompt_tokens
        s["output_tokens"] = output_tokens
        s["output_tok_s"] = output_tokens / w
        s["total_tok_s"] = total_tokens / w
        s["efficiency"] = total_tokens * 2 * params["flop_params"] / peak / w
        if s["generated_tokens"] != output_tokens:
            notes.append(
                f"WARNING: a system generated {s['generated_tokens']} tokens, {output_tokens} were asked"
            )
    hf_ok = {k: v for k, v in systems.items() if k.startswith("hf-") and "error" not in v}
    hf_best_name = max(hf_ok, key=lambda k: hf_ok[k]["output_tok_s"]) if hf_ok else None
    hf_best = hf_ok[hf_best_name]["output_tok_s"] if hf_best_name else None
    for s in systems.values():
        if "error" not in s:
            s["speedup_vs_hf_best"] = s["output_tok_s"] / hf_best if hf_best else None

    # Greedy agreement between kvfleet and the HF systems on the first few requests.
    sanity: dict[str, Any] = {}
    kv = systems.get("kvfleet", {})
    for name, s in systems.items():
        if name != "kvfleet" and "_tokens" in s and "_tokens" in kv:
            sanity[f"kvfleet vs {name}"] = offline.compare(kv["_tokens"], s["_tokens"], args.check)

    kvm = systems.get("kvfleet", {})
    speedup = kvm.get("speedup_vs_hf_best")
    eff = kvm.get("efficiency")
    result: dict[str, Any] = {
        "benchmark": NAME,
        "config": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if not k.startswith("_")
        },
        "model": {"path": str(model_dir), "architecture": model_cfg.get("architectures", [None])[0]},
        "params": params,
        "workload": {
            "num_prompts": len(prompts),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "total_tokens": total_tokens,
            "prompt_len_min": min(len(p) for p in prompts),
            "prompt_len_max": max(len(p) for p in prompts),
            "output_len_min": min(outs),
            "output_len_max": max(outs),
            "ignore_eos": True,
            "greedy": True,
        },
        "machine": {"matmul_before": flops_before, "matmul_after": flops_after, "peak_flops": peak},
        "env": common.env_info(),
        "systems": {
            k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in systems.items()
        },
        "hf_best": {"system": hf_best_name, "output_tok_s": hf_best},
        "speedup_vs_hf_best": speedup,
        "efficiency": eff,
        "targets": {
            "speedup_vs_hf_best": TARGET_SPEEDUP,
            "efficiency": TARGET_EFFICIENCY,
            "speedup_met": None if speedup is None else speedup >= TARGET_SPEEDUP,
            "efficiency_met": None if eff is None else eff >= TARGET_EFFICIENCY,
        },
        "sanity": sanity,
        "notes": notes,
    }

    rows = []
    for name, s in systems.items():
        if "error" in s:
            rows.append([name, "error", "-", "-", "-", "-"])
            continue
        rows.append(
            [
                name,
                f"{s['wall_s']:.1f}",
                f"{s['output_tok_s']:.1f}",
                f"{s['total_tok_s']:.1f}",
                "-" if s["speedup_vs_hf_best"] is None else f"{s['speedup_vs_hf_best']:.2f}x",
                f"{100 * s['efficiency']:.1f}%",
            ]
        )
    table_notes = [
        *([busy] if busy else []),
        f"{len(prompts)} prompts, {prompt_tokens:,} prompt + {output_tokens:,} output tokens; "
        f"{params['flop_params'] / 1e6:.1f} M FLOP parameters; matmul peak {peak / 1e9:.1f} GFLOP/s "
        f"({flops_before['flops'] / 1e9:.1f} before, {flops_after['flops'] / 1e9:.1f} after), {args.threads} threads",
    ]
    table_notes.append(
        "contention probe (small-matmul ms before/after; idle machine < "
        f"{common.CONTENDED_MS:g} ms): "
        + ", ".join(
            f"{name} {s['contention_before']['small_op_ms']:.2f}/{s['contention_after']['small_op_ms']:.2f}"
            for name, s in systems.items()
        )
    )
    for name, s in systems.items():
        if "error" in s:
            table_notes.append(f"{name} failed: {s['error']}")
    if speedup is not None:
        table_notes.append(
            f"kvfleet vs HF best ({hf_best_name}): {speedup:.2f}x (target >= {TARGET_SPEEDUP:.0f}x: "
            f"{'met' if speedup >= TARGET_SPEEDUP else 'NOT met'})"
        )
    if eff is not None:
        table_notes.append(
            f"kvfleet compute efficiency: {100 * eff:.1f}% (target >= {100 * TARGET_EFFICIENCY:.0f}%: "
            f"{'met' if eff >= TARGET_EFFICIENCY else 'NOT met'})"
        )
    for name, c in sanity.items():
        table_notes.append(
            f"sanity {name}: {c['exact_matches']}/{c['compared']} identical greedy outputs; "
            f"common prefix {c['common_prefix_lens']} of {c['lens']} tokens"
        )
    common.print_table(
        "Engine throughput (float32, CPU)",
        ["system", "wall s", "output tok/s", "total tok/s", "speedup vs HF best", "efficiency"],
        rows,
        table_notes,
    )
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
