"""Tensor and pipeline parallelism on one machine: throughput, per-step communication, PP overlap.

Each configuration (``TPxPP``; ``1x1`` is the in-process engine, ``1x1-mp`` the same single rank in a
worker process, which isolates the cost of the multiprocess executor itself) runs the same workload:
``--num-prompts`` random prompts of ``--prompt-len`` tokens, ``--output-len`` greedy tokens each, EOS
ignored, after an untimed warm-up. Reported per configuration:

* wall time, output and total tokens/s, and whether the greedy tokens equal ``1x1``'s;
* per-step communication: seconds inside TP all-reduce/all-gather, and inside PP send/receive (a
  receive includes waiting for the previous stage to finish its part), per engine step, the maximum
  over ranks;
* PP overlap: the time the first and the last stage both compute (receives excluded) / wall time, with
  each stage's busy fraction. The batch queue keeps up to PP steps in flight to make this non-zero.

On a machine with fewer cores than ranks x threads, parallelism cannot make anything faster: the
ranks share the same cores (each rank gets ``cpu_count // ranks`` threads unless ``--threads`` says). The numbers show what the
communication and the pipeline cost, not a speed-up.

    .venv/bin/python -m bench.parallel                          # small preset: 1x1, 1x1-mp, 2x1, 1x2
    .venv/bin/python -m bench.parallel --configs 1x1 2x2 --preset tiny
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path
from typing import Any

from bench import _common as common

NAME = "parallel"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="small")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=16)
    w.add_argument("--prompt-len", type=int, default=128)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--configs", nargs="+", default=["1x1", "1x1-mp", "2x1", "1x2"], help="TPxPP[-mp]")
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument(
        "--threads", type=int, default=None, help="torch threads of the in-process engine and of every rank"
    )
    p.add_argument("--out", default=None, help=f"JSON output (default bench/results/{NAME}.json)")
    return p.parse_args(argv)


def _parse_config(text: str) -> tuple[int, int, str]:
    sizes, _, backend = text.partition("-")
    tp, _, pp = sizes.partition("x")
    return int(tp), int(pp), backend or ("uni" if int(tp) * int(pp) == 1 else "mp")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total time covered by both interval sets."""
    a, b = _union(a), _union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def run_config(model_dir: Path, text: str, prompts, args) -> dict[str, Any]:
    from kvfleet_engine import LLM, SamplingParams

    tp, pp, backend = _parse_config(text)
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        use_tqdm=False,
        dtype="float32",
        max_model_len=args.prompt_len + args.output_len + 16,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend=backend,
    )
    startup = time.perf_counter() - t0
    try:
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p[:8]} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        executor = llm.engine.executor
        mp = backend == "mp"
        if mp:
            executor.collective_rpc("comm_stats", True)
            executor.collective_rpc("busy_intervals", True)
            steps0 = executor.num_steps
        before = common.contention()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        t1 = time.perf_counter()
        wall = t1 - t0
        result: dict[str, Any] = {
            "tp": tp,
            "pp": pp,
            "executor": backend,
            "startup_s": startup,
            "wall_s": wall,
            "contention_before": before,
            "contention_after": common.contention(),
            "_tokens": [o.outputs[0].token_ids for o in outs],
        }
        generated = sum(len(t) for t in result["_tokens"])
        result["output_tok_s"] = generated / wall
        result["total_tok_s"] = (generated + sum(len(p) for p in prompts)) / wall
        if mp:
            steps = executor.num_steps - steps0
            stats = executor.collective_rpc("comm_stats", False)
            busy = executor.collective_rpc("busy_intervals", False)
            result["steps"] = steps
            result["tp_comm_ms_per_step"] = max(s["tp_seconds"] for s in stats) / steps * 1e3
            result["pp_comm_ms_per_step"] = max(s["pp_seconds"] for s in stats) / steps * 1e3
            result["tp_comm_mb_per_step"] = max(s["tp_bytes"] for s in stats) / steps / 2**20
            result["pp_comm_mb_per_step"] = max(s["pp_bytes"] for s in stats) / steps / 2**20
            first = [(s, e) for s, e in busy[0] if t0 <= s <= t1]
            last = [(s, e) for s, e in busy[executor.output_rank] if t0 <= s <= t1]
            result["stage_busy_frac"] = [_length(_union(first)) / wall, _length(_union(last)) / wall]
            result["pp_overlap"] = overlap_seconds(first, last) / wall if pp > 1 else None
        else:
            result["steps"] = None
        return result
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        common.set_threads(args.threads)
        os.environ["KVFLEET_WORKER_THREADS"] = str(args.threads)  # every rank too
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    rng = random.Random(args.seed)
    vocab = common.read_model_config(model_dir)["vocab_size"]
    special = common.special_token_ids(model_dir)
    prompts = [common.random_token_ids(rng, args.prompt_len, vocab, special) for _ in range(args.num_prompts)]
    common.log(f"model {model_dir}; {len(prompts)} prompts x {args.prompt_len} tokens, {args.output_len} out")

    systems: dict[str, dict[str, Any]] = {}
    for text in args.configs:
        common.log(f"running {text}")
        try:
            systems[text] = run_config(model_dir, text, prompts, args)
        except Exception as e:  # one failing configuration should not lose the others' numbers
            systems[text] = {"error": f"{type(e).__name__}: {e}"}
            common.log(f"  {text} failed: {e}")
            continue
        s = systems[text]
        common.log(f"  {s['wall_s']:.2f}s, {s['output_tok_s']:.1f} output tok/s")

    base = systems.get("1x1", {}).get("_tokens")
    for s in systems.values():
        if "_tokens" in s:
            s["same_tokens_as_1x1"] = None if base is None else s["_tokens"] == base
            s["speedup_vs_1x1"] = (
                systems["1x1"]["wall_s"] / s["wall_s"] if "wall_s" in systems.get("1x1", {}) else None
            )

    rows = []
    for name, s in systems.items():
        if "error" in s:
            rows.append([name, "error", "", "", "", "", "", "", s["error"][:60]])
            continue
        rows.append(
            [
                name,
                common.fmt(s["wall_s"]),
                common.fmt(s["output_tok_s"], 1),
                common.fmt(s["speedup_vs_1x1"]),
                common.fmt(s.get("tp_comm_ms_per_step")),
                common.fmt(s.get("pp_comm_ms_per_step")),
                "" if s.get("pp_overlap") is None else f"{100 * s['pp_overlap']:.0f} %",
                ""
                if "stage_busy_frac" not in s
                else " / ".join(f"{100 * f:.0f} %" for f in s["stage_busy_frac"]),
                str(s["same_tokens_as_1x1"]),
            ]
        )
    common.print_table(
        "TP x PP on one machine",
        [
            "config",
            "wall s",
            "out tok/s",
            "vs 1x1",
            "TP comm ms/step",
            "PP comm ms/step",
            "PP overlap",
            "busy first/last",
            "same tokens",
        ],
        rows,
    )
    notes = [busy] if busy else []
    notes.append(
        "PP comm includes waiting in receive for the previous stage; TP comm is all-reduce/all-gather time. "
        "Ranks share the machine's cores (cpu_count // ranks threads each), so no configuration can be faster "
        "than 1x1 here: the table measures the cost of parallelism, not a speed-up."
    )
    result = {
        "benchmark": NAME,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": str(model_dir),
        "systems": {
            k: {kk: vv for kk, vv in v.items() if not kk.startswith("_")} for k, v in systems.items()
        },
        "notes": notes,
        "env": common.env_info(),
    }
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
