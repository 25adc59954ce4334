"""Per-step CPU overhead of the engine: what one decode step costs with a zero-cost simulated device.

The model's compute is replaced by the simulated executor at ``SimulationCost(0, 0, 0, 0)`` (no
weights, no sleep), so what is left of a step is the engine's own Python work: ``Scheduler.schedule``,
the executor's bookkeeping (~0), ``Scheduler.update_from_output`` (stop checks, block hashes, the KV
cache manager), and the frontend's ``OutputProcessor.process_outputs`` (incremental detokenization,
stop strings). The run is the real offline path, ``LLM.generate``: the methods above are wrapped on
their instances by timers, nothing else changes.

Workload: ``--num-seqs`` requests (256) of random token-id prompts (``--min-prompt``..``--max-prompt``
tokens), ``ignore_eos``, all admitted at once with ``max_num_seqs = --num-seqs`` and enough KV blocks
for all of them, each asking for enough tokens to decode ``--decode-steps`` steps once the last
prompt is prefilled. Only *steady-state decode steps* are reported: every request running and
decoding one token, none admitted, preempted or finishing. Per component: median and p90 over those
steps (all repeats pooled), in milliseconds of the thread's CPU time (other processes on a shared
machine stretch wall time, not CPU time). ``total`` is one whole iteration of ``LLM._run``'s loop and
``other`` what is left of it besides the four (``StepRates.record``, glue, freeing the step's
objects); ``wall`` is the iteration's wall time (it agrees with ``total`` on an idle machine; a gap
means other processes took the core).

Baseline in the same run: ``--baseline-tree DIR`` (a checkout of older code, e.g. ``git worktree add
--detach /tmp/base HEAD~1``) runs each repeat twice, in fresh processes, once against this tree's
``common``/``engine`` and once against DIR's, alternating which goes first; ratios are
current / baseline (paired per repeat, then the median).

Usage::

    .venv/bin/python -m bench.step_overhead                                  # ~30 s
    .venv/bin/python -m bench.step_overhead --baseline-tree /tmp/base        # ~90 s
    .venv/bin/python -m bench.step_overhead --quick                          # smoke run, seconds
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _common as common

NAME = "step_overhead"
TARGET_MS = 1.5  # the target for 256 running requests on the development machine
COMPONENTS = ("schedule", "execute", "update", "other", "output", "total")
COMPONENT_LABELS = {
    "schedule": "Scheduler.schedule",
    "execute": "executor.execute_model",
    "update": "Scheduler.update_from_output (+ KV manager)",
    "other": "rest of the loop (step rates, glue, freeing)",
    "output": "OutputProcessor.process_outputs (+ detokenizer)",
    "total": "total (CPU time)",
    "wall": "total, wall time",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="tiny")
    w = p.add_argument_group("workload")
    w.add_argument("--num-seqs", type=int, default=256, help="requests running at once (= max_num_seqs)")
    w.add_argument("--min-prompt", type=int, default=100)
    w.add_argument("--max-prompt", type=int, default=1000)
    w.add_argument("--decode-steps", type=int, default=400, help="steady-state decode steps per repeat")
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument(
        "--stop", action="append", default=None, help="a stop string (repeatable; none by default)"
    )
    w.add_argument("--seed", type=int, default=0, help="workload seed")
    m = p.add_argument_group("measurement")
    m.add_argument("--repeats", type=int, default=5, help="measured runs (each a fresh LLM.generate)")
    m.add_argument("--target-ms", type=float, default=TARGET_MS, help="target for the median total")
    m.add_argument("--baseline-tree", default=None, help="a checkout of the code to compare against")
    m.add_argument("--profile", default=None, help="write a cProfile of the measured runs here (in-process)")
    m.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (defaults: 16 requests, prompts 20-100, 20 steps, 2 repeats)",
    )
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    m.add_argument("--child-out", default=None, help=argparse.SUPPRESS)  # one configuration, raw samples
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # smaller defaults; explicit options still win
        p.set_defaults(num_seqs=16, min_prompt=20, max_prompt=100, decode_steps=20, repeats=2)
    args = p.parse_args(argv)
    if args.num_seqs < 1 or args.decode_steps < 1 or args.repeats < 1:
        p.error("--num-seqs, --decode-steps and --repeats must be >= 1")
    if not 1 <= args.min_prompt <= args.max_prompt:
        p.error("need 1 <= --min-prompt <= --max-prompt")
    return args


# ---- one configuration, in this process -------------------------------------------------------


class StepTimer:
    """Wraps the engine's per-step methods on their instances and records each step's split.

    A step is one iteration of ``LLM._run``'s loop: ``EngineCore.step()``, then
    ``OutputProcessor.process_outputs()`` of its outputs, then the loop's own work (and freeing the
    step's objects) until the next ``EngineCore.step()`` starts; ``total`` is that whole iteration.
    Only numbers are kept between steps (holding on to a step's objects would move their freeing
    out of the measured time)."""

    def __init__(self, llm: Any) -> None:
        self.steps: list[dict[str, Any]] = []
        self.recording = True
        engine, scheduler, executor = llm.engine, llm.engine.scheduler, llm.engine.executor
        op = llm.output_processor
        # Thread CPU time, not wall time: other processes on the machine stretch the wall time of
        # whatever they interrupt, but not the CPU time this thread spent. (About 1 us per reading.)
        clock, wall_clock = time.thread_time, time.perf_counter
        cur: dict[str, Any] = {}

        step, schedule, execute = engine.step, scheduler.schedule, executor.execute_model
        update, process = scheduler.update_from_output, op.process_outputs

        def timed_step():
            t, wall = clock(), wall_clock()
            if self.recording and "output" in cur:  # the previous iteration is complete
                cur["total"], cur["wall"] = t - cur["t0"], wall - cur["wall0"]
                self.steps.append(self._record(cur))
            cur.clear()
            cur["t0"], cur["wall0"] = t, wall
            return step()

        def timed_schedule():
            t = clock()
            sched = schedule()
            cur["schedule"] = clock() - t
            n = len(sched.num_scheduled_tokens)
            cur["num_scheduled"] = n
            cur["all_decode"] = (
                not sched.scheduled_new_reqs
                and not sched.preempted_req_ids
                and sched.total_num_scheduled_tokens == n  # one token each
                and n == len(scheduler.running)
            )
            return sched

        def timed_execute(sched, *a, **kw):
            t = clock()
            out = execute(sched, *a, **kw)
            cur["execute"] = clock() - t
            return out

        def timed_update(sched, runner_out):
            t = clock()
            out = update(sched, runner_out)
            cur["update"] = clock() - t
            return out

        def timed_process(outputs):
            t = clock()
            res = process(outputs)
            cur["output"] = clock() - t
            cur["num_outputs"] = len(outputs)
            cur["any_finished"] = any(o.finish_reason is not None for o in outputs)
            return res

        engine.step, scheduler.schedule, executor.execute_model = timed_step, timed_schedule, timed_execute
        scheduler.update_from_output, op.process_outputs = timed_update, timed_process
        self._cur = cur

    def start_run(self) -> None:
        self.steps = []
        self._cur.clear()

    @staticmethod
    def _record(cur: dict[str, Any]) -> dict[str, Any]:
        parts = {k: cur.get(k, 0.0) for k in ("schedule", "execute", "update", "output", "total", "wall")}
        parts["other"] = max(
            parts["total"] - parts["schedule"] - parts["execute"] - parts["update"] - parts["output"], 0.0
        )
        n = cur.get("num_scheduled", 0)
        steady = bool(cur.get("all_decode")) and cur.get("num_outputs") == n and not cur.get("any_finished")
        return {"num_scheduled": n, "steady": steady, **parts}


def make_prompts(args: argparse.Namespace, model_dir: Path, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = common.read_model_config(model_dir)["vocab_size"]
    special = common.special_token_ids(model_dir)
    return [
        common.random_token_ids(rng, rng.randint(args.min_prompt, args.max_prompt), vocab, special)
        for _ in range(args.num_seqs)
    ]


def measure(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Build an LLM on the zero-cost simulator, warm it up, and time ``args.repeats`` runs."""
    from kvfleet_engine.engine_args import SimulationCost
    from kvfleet_engine.llm import LLM
    from kvfleet_engine.sampling_params import SamplingParams

    bs = args.block_size
    max_batched = 8192
    # Steps until the last prompt is prefilled (its first token), plus the decode steps wanted.
    ramp_steps = math.ceil(args.num_seqs * args.max_prompt / max_batched) + 2
    max_tokens = args.decode_steps + ramp_steps
    max_model_len = args.max_prompt + max_tokens + bs
    num_blocks = args.num_seqs * math.ceil(max_model_len / bs) + 2
    llm = LLM(
        model_dir,
        use_tqdm=False,
        simulation=SimulationCost(0, 0, 0, 0),
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
        block_size=bs,
    )
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, stop=args.stop)
    timer = StepTimer(llm)

    # Warm-up: a short run of the same shape (imports, caches, tokenizer), not recorded.
    timer.recording = False
    warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, stop=args.stop)
    llm.generate(
        [{"prompt_token_ids": p} for p in make_prompts(args, model_dir, args.seed + 1000)],
        warm,
        use_tqdm=False,
    )
    timer.recording = True

    profiler = cProfile.Profile() if args.profile else None
    runs = []
    for r in range(args.repeats):
        prompts = make_prompts(args, model_dir, args.seed + r)  # fresh prompts: no prefix-cache hits
        timer.start_run()
        t0, cpu0 = time.perf_counter(), time.process_time()
        if profiler is not None:
            profiler.enable()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        steady = [s for s in timer.steps if s["steady"]]
        runs.append(
            {
                "wall_s": wall,
                "process_cpu_s": cpu,
                "steps": len(timer.steps),
                "steady_steps": len(steady),
                "prompt_tokens": sum(len(p) for p in prompts),
                "generated_tokens": generated,
                "text_chars": sum(len(o.outputs[0].text) for o in outs),
                "samples_ms": {k: [1e3 * s[k] for s in steady] for k in (*COMPONENTS, "wall")},
            }
        )
        common.log(
            f"  run {r + 1}/{args.repeats}: {len(timer.steps)} steps, {len(steady)} steady, "
            f"total median {statistics.median(runs[-1]['samples_ms']['total'] or [0]):.3f} ms"
        )
    if profiler is not None:
        profiler.dump_stats(args.profile)
        common.log(f"wrote {args.profile}")
    engine_file = sys.modules["kvfleet_engine"].__file__
    llm.shutdown()
    return {
        "engine_package": str(Path(engine_file).parent) if engine_file else None,
        "engine_config": {
            "max_num_seqs": args.num_seqs,
            "max_num_batched_tokens": max_batched,
            "max_model_len": max_model_len,
            "num_kv_blocks": num_blocks,
            "block_size": bs,
            "max_tokens": max_tokens,
        },
        "runs": runs,
    }


# ---- statistics -------------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per component: median / p90 / mean over all steady steps of all runs, and each run's median."""
    out: dict[str, Any] = {}
    for k in (*COMPONENTS, "wall"):
        pooled = [x for r in runs for x in r["samples_ms"][k]]
        out[k] = {
            "median_ms": statistics.median(pooled) if pooled else None,
            "p90_ms": percentile(pooled, 0.9) if pooled else None,
            "mean_ms": statistics.fmean(pooled) if pooled else None,
            "run_medians_ms": [
                statistics.median(r["samples_ms"][k]) if r["samples_ms"][k] else None for r in runs
            ],
        }
    return out


def strip_samples(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "samples_ms"} for r in runs]


# ---- configurations in child processes (baseline comparison) ----------------------------------


def run_child(args: argparse.Namespace, argv: list[str], tree: Path, out: Path) -> dict[str, Any]:
    """One repeat of this script in a fresh process, importing ``common``/``engine`` from ``tree``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree / "common"), str(tree / "engine"), *filter(None, [env.get("PYTHONPATH")])]
    )
    child_argv = [a for a in argv if a != "--quick"]  # the child gets explicit sizes below
    cmd = [
        sys.executable, "-m", "bench.step_overhead",
        *strip_option(child_argv, ("--baseline-tree", "--out", "--profile", "--repeats")),
        "--num-seqs", str(args.num_seqs), "--min-prompt", str(args.min_prompt),
        "--max-prompt", str(args.max_prompt), "--decode-steps", str(args.decode_steps),
        "--repeats", "1", "--child-out", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, cwd=common.REPO_ROOT)  # where `-m bench.step_overhead` resolves
    return json.loads(out.read_text())


def strip_option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names``, each given as ``--x V`` or ``--x=V``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in names:
            skip = "=" not in a
            continue
        out.append(a)
    return out


# ---- main -------------------------------------------------------------------------------------


def config_entry(tree: Path, package: str | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tree": str(tree),
        "engine_package": package,
        "summary": summarize(runs),
        "runs": strip_samples(runs),
    }


def compare_trees(args: argparse.Namespace, raw_argv: list[str]) -> tuple[dict[str, Any], dict, list[float]]:
    """Each repeat once per tree, in fresh processes, the order alternating. Returns the configs, the
    engine config and the per-repeat ratios of the median totals (current / baseline)."""
    base = Path(args.baseline_tree).resolve()
    if not (base / "engine" / "kvfleet_engine").is_dir():
        raise SystemExit(f"--baseline-tree {base}: no engine/kvfleet_engine there")
    trees = {"current": common.REPO_ROOT, "baseline": base}
    runs: dict[str, list[dict[str, Any]]] = {"current": [], "baseline": []}
    packages: dict[str, str | None] = {}
    engine_config: dict[str, Any] = {}
    paired: list[float] = []
    with tempfile.TemporaryDirectory(prefix="step_overhead-") as tmp:
        for r in range(args.repeats):
            for name in ("current", "baseline") if r % 2 == 0 else ("baseline", "current"):
                common.log(f"repeat {r + 1}/{args.repeats}: {name} ({trees[name]})")
                res = run_child(args, raw_argv, trees[name], Path(tmp) / f"{name}-{r}.json")
                runs[name] += res["runs"]
                packages[name], engine_config = res["engine_package"], res["engine_config"]
            cur, bas = (runs[name][-1]["samples_ms"]["total"] for name in ("current", "baseline"))
            if cur and bas:
                paired.append(statistics.median(cur) / statistics.median(bas))
    configs = {name: config_entry(trees[name], packages[name], runs[name]) for name in trees}
    return configs, engine_config, paired


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    raw_argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(raw_argv)
    model_dir = common.resolve_model(args)

    if args.child_out:  # one configuration for a parent comparing trees: raw samples only
        common.write_json(args.child_out, measure(args, model_dir))
        return {}

    busy = common.busy_machine_warning()
    before = common.contention()
    paired: list[float] = []
    if args.baseline_tree:
        configs, engine_config, paired = compare_trees(args, raw_argv)
    else:
        res = measure(args, model_dir)
        engine_config = res["engine_config"]
        configs = {"current": config_entry(common.REPO_ROOT, res["engine_package"], res["runs"])}
    after = common.contention()

    cur = configs["current"]["summary"]
    bas = configs["baseline"]["summary"] if "baseline" in configs else None
    total_median = cur["total"]["median_ms"]
    met = None if total_median is None else total_median <= args.target_ms
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": common.command_line("bench.step_overhead", argv),
        "config": {k: v for k, v in vars(args).items() if k != "child_out"},
        "model": {"path": str(model_dir), "vocab_size": common.read_model_config(model_dir)["vocab_size"]},
        "engine_config": engine_config,
        "workload": {
            "num_seqs": args.num_seqs,
            "prompt_len_range": [args.min_prompt, args.max_prompt],
            "decode_steps": args.decode_steps,
            "repeats": args.repeats,
            "ignore_eos": True,
            "greedy": True,
            "stop": args.stop or [],
            "simulation": "SimulationCost(0, 0, 0, 0)",
        },
        "env": common.env_info(),
        "contention_before": before,
        "contention_after": after,
        "configs": configs,
        "ratio_current_vs_baseline": None,
        "target": {"total_median_ms_max": args.target_ms, "total_median_ms": total_median, "met": met},
        "notes": [busy] if busy else [],
    }
    if bas is not None:
        result["ratio_current_vs_baseline"] = {
            "total_median": ratio(total_median, bas["total"]["median_ms"]),
            "total_p90": ratio(cur["total"]["p90_ms"], bas["total"]["p90_ms"]),
            "paired_total_medians": paired,
            "paired_median": statistics.median(paired) if paired else None,
        }

    headers = ["component", "median ms", "p90 ms", "share"]
    if bas is not None:
        headers += ["baseline median", "baseline p90", "median ratio"]
    rows = []
    for k in ("schedule", "execute", "update", "output", "other", "total", "wall"):
        c = cur[k]
        share = ratio(c["mean_ms"], cur["total"]["mean_ms"]) if k not in ("total", "wall") else None
        row = [
            COMPONENT_LABELS[k],
            fmt_ms(c["median_ms"]),
            fmt_ms(c["p90_ms"]),
            "" if share is None else f"{100 * share:.0f}%",
        ]
        if bas is not None:
            r = ratio(c["median_ms"], bas[k]["median_ms"])
            row += [fmt_ms(bas[k]["median_ms"]), fmt_ms(bas[k]["p90_ms"]), "-" if r is None else f"{r:.2f}x"]
        rows.append(row)
    steady = sum(r["steady_steps"] for r in configs["current"]["runs"])
    notes = [
        *([busy] if busy else []),
        f"{args.num_seqs} running requests, prompts {args.min_prompt}-{args.max_prompt} tokens; {steady} "
        f"steady-state decode steps over {args.repeats} runs; thread CPU time; share: of the mean total",
        f"contention probe (small-matmul ms before/after; idle < {common.CONTENDED_MS:g} ms): "
        f"{before['small_op_ms']:.2f}/{after['small_op_ms']:.2f}",
    ]
    if total_median is not None:
        notes.append(
            f"target: median total <= {args.target_ms:g} ms per step: "
            f"{'met' if met else 'NOT met'} ({total_median:.3f} ms)"
        )
    rc = result["ratio_current_vs_baseline"]
    if rc and rc["total_median"] is not None:
        notes.append(
            f"current / baseline, median total: {rc['total_median']:.2f}x pooled; per repeat "
            f"{', '.join(f'{x:.2f}x' for x in paired)} (median {rc['paired_median']:.2f}x)"
        )
    title = f"Per-step engine overhead ({args.num_seqs} running requests, zero-cost simulated executor)"
    common.print_table(title, headers, rows, notes)
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
