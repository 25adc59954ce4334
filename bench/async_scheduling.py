"""How much of the engine's own per-step host work async scheduling hides, on a modelled device.

The device is the simulated executor (no weights): each step "runs" for what a timing model charges and
the executor blocks until then, so the host is idle while the modelled device works, as it is while a GPU
computes. Everything else is the real offline path (``LLM.generate``): the scheduler, the KV cache manager,
output processing and detokenization. Step by step, a step costs the host's work plus the device's; with
``async_scheduling`` the host schedules and launches step n+1, then applies step n while the device runs
n+1, so a step costs about the larger of the two.

Default cost model: the decode step of the ``bench`` model (Qwen2-0.5B shape, bf16) on an H100 at 256
running requests, from the GPU run of 2026-11-26 (docs/BENCHMARKS.md): 3.12 ms a step of which about
1.1 ms was host work, so ~2.0 ms of device time (``--decode-ms-per-step 1.0 --decode-ms-per-seq
0.004``), prefill at ~3 ms per 1,000 tokens. The host here is the machine this runs on (a development VM's
host work per step is slower than an H100 server's), so the ratio is this machine's, not a GPU's.

Workload: ``--num-requests`` (256) random token-id prompts of ``--min-prompt``..``--max-prompt`` tokens,
outputs of ``--min-output``..``--max-output`` tokens, ``ignore_eos``, greedy, seed 0, one
``LLM.generate`` per run. Step-by-step and async runs alternate, ``--repeats`` times each, in one process;
every run's tokens must equal the first run's (the simulated tokens do not depend on batching).

    .venv/bin/python -m bench.async_scheduling                 # ~1 min
    .venv/bin/python -m bench.async_scheduling --quick         # smoke run, seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from bench import _common as common

NAME = "async_scheduling"
MODES = ("step-by-step", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=400)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-ms-per-step", type=float, default=1.0)
    p.add_argument("--decode-ms-per-seq", type=float, default=0.004)
    p.add_argument("--prefill-ms-per-1k-tokens", type=float, default=3.0)
    p.add_argument("--step-overhead-ms", type=float, default=0.0)
    p.add_argument("--quick", action="store_true", help="16 short requests, 1 repeat (a smoke run)")
    p.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.repeats = 16, 1
        args.min_prompt, args.max_prompt, args.min_output, args.max_output = 8, 32, 4, 12
    return args


def run_once(llm, prompts, params) -> tuple[float, list[list[int]], int, int]:
    """(wall seconds, tokens per request, steps, steps launched while the one before was in flight)."""
    engine = llm.engine
    before, overlapped = len(engine.executor.step_log), engine.overlapped_steps
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return wall, tokens, len(engine.executor.step_log) - before, engine.overlapped_steps - overlapped


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from kvfleet_engine import LLM, SamplingParams
    from kvfleet_engine.engine_args import SimulationCost

    args = parse_args(argv)
    model_dir = common.ensure_demo_model("qwen2", "tiny", 0, None)
    rng = random.Random(0)
    prompts = [
        {
            "prompt_token_ids": [
                rng.randrange(3, 4000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))
            ]
        }
        for _ in range(args.num_requests)
    ]
    outs = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_requests)]
    params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0) for k in outs]
    cost = SimulationCost(
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        decode_ms_per_step=args.decode_ms_per_step,
        decode_ms_per_seq=args.decode_ms_per_seq,
        step_overhead_ms=args.step_overhead_ms,
    )
    engines = {
        mode: LLM(
            str(model_dir),
            use_tqdm=False,
            simulation=cost,
            max_model_len=args.max_prompt + args.max_output,
            max_num_seqs=args.num_requests,
            num_kv_blocks=args.num_requests * ((args.max_prompt + args.max_output) // 16 + 2),
            async_scheduling=mode == "async",
        )
        for mode in MODES
    }
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    reference = None
    before = common.contention()
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            llm = engines[mode]
            llm.reset_prefix_cache()
            device_s = sum(s.seconds for s in llm.engine.executor.step_log)
            wall, tokens, steps, overlapped = run_once(llm, prompts, params)
            device_s = sum(s.seconds for s in llm.engine.executor.step_log) - device_s
            reference = tokens if reference is None else reference
            if tokens != reference:
                raise RuntimeError(f"{mode} run {r}: outputs differ from the first run's")
            runs[mode].append(
                {
                    "wall_s": wall,
                    "steps": steps,
                    "overlapped_steps": overlapped,
                    "device_s": device_s,
                    "output_tokens": sum(outs),
                }
            )
            common.log(f"{mode} run {r}: {wall:.2f}s, {steps} steps, device {device_s:.2f}s")
    after = common.contention()
    for llm in engines.values():
        llm.shutdown()

    summary = {}
    for mode in MODES:
        walls = [x["wall_s"] for x in runs[mode]]
        wall = statistics.median(walls)
        steps = runs[mode][0]["steps"]
        device = runs[mode][0]["device_s"]
        summary[mode] = {
            "wall_s_median": wall,
            "wall_s": walls,
            "steps": steps,
            "overlapped_steps": runs[mode][0]["overlapped_steps"],
            "device_s": device,
            "output_tok_s": sum(outs) / wall,
            "ms_per_step": 1e3 * wall / steps,
            "host_ms_per_step_not_hidden": 1e3 * (wall - device) / steps,
        }
    ratio = summary["step-by-step"]["wall_s_median"] / summary["async"]["wall_s_median"]
    rows = [
        [
            mode, s["steps"], f"{s['device_s']:.2f}", f"{s['wall_s_median']:.2f}", f"{s['ms_per_step']:.2f}",
            f"{s['host_ms_per_step_not_hidden']:.2f}", f"{s['output_tok_s']:,.0f}",
        ]
        for mode, s in summary.items()
    ]  # fmt: skip
    notes = [
        f"{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt}, outputs "
        f"{args.min_output}-{args.max_output} ({sum(outs):,} tokens); median of {args.repeats} alternated runs",
        f"cost model: decode {args.decode_ms_per_step} ms/step + {args.decode_ms_per_seq} ms/seq, prefill "
        f"{args.prefill_ms_per_1k_tokens} ms/1k tokens; identical outputs in every run",
        f"async vs step-by-step: {ratio:.2f}x output tok/s",
        f"contention probe before/after: {before['small_op_ms']:.2f} / {after['small_op_ms']:.2f} ms",
    ]
    common.print_table(
        "Async scheduling on a modelled device",
        ["mode", "steps", "device s", "wall s", "ms/step", "host ms/step not hidden", "output tok/s"],
        rows,
        notes,
    )
    result = {
        "benchmark": NAME,
        "command": common.command_line("bench.async_scheduling", argv),
        "config": vars(args),
        "env": common.env_info(),
        "contention_before": before,
        "contention_after": after,
        "runs": runs,
        "summary": summary,
        "async_vs_step_by_step": ratio,
    }
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
