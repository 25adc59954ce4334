"""The model runner's host-side work per decode step: what input preparation and sampling add on top of
the model's compute (the GPU issue's "≤ 1 ms on top" target).

Real path, real model: ``LLM.generate`` on a demo model (``tiny`` Qwen2 by default: 4,096-token
vocabulary, the ``bench`` preset's) on the CPU with one torch thread, ``--num-seqs`` (256) requests
decoding together. The worker's methods are wrapped on their instances by timers; per steady-state
decode step (every request decoding, none admitted or finishing) the script reports, in the thread's
CPU time:

- ``update states``: applying the scheduler's diff to the persistent batch;
- ``step arrays``: positions, token ids, slots, block tables (numpy);
- ``device inputs``: the eager path's tensors and attention plan, or with ``--decode-buffers`` the copy
  into the decode graphs' static buffers (``worker/cuda_graph.py``; on the CPU a "replay" calls the
  captured function on them);
- ``sampling metadata``: the batch's sampling parameters as tensors;
- ``sample bookkeeping``: everything in ``_sample`` around the sampler itself (reading the tokens back,
  appending them, building the output);
- ``host total``: the sum, against the target;
- for scale: ``model forward`` (the step's compute: on a GPU it runs on the device) and ``sampler``
  (argmax over the vocabulary: on a GPU it runs on the device too).

    .venv/bin/python -m bench.runner_overhead                    # eager and decode-buffer paths, ~1 min
    .venv/bin/python -m bench.runner_overhead --quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench import _common as common

NAME = "runner_overhead"
TARGET_MS = 1.0
HOST_PARTS = ("update_states", "step_arrays", "device_inputs", "sampling_metadata", "sample_bookkeeping")
LABELS = {
    "update_states": "update states (diff -> batch)",
    "step_arrays": "step arrays (numpy)",
    "device_inputs": "device inputs / decode buffers",
    "sampling_metadata": "sampling metadata",
    "sample_bookkeeping": "sample bookkeeping",
    "host_total": "host total",
    "model_forward": "model forward (device work on a GPU)",
    "sampler": "sampler (device work on a GPU)",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p, default_preset="tiny", default_arch="qwen2")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target-ms", type=float, default=TARGET_MS)
    p.add_argument("--quick", action="store_true", help="a smoke run: 16 requests, 8 steps, 1 repeat")
    p.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    if args.quick:
        args.num_seqs, args.decode_steps, args.repeats = 16, 8, 1
    return args


class RunnerTimer:
    """Wraps the worker's methods on their instances; records one dict of CPU seconds per step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}
        for name in ("_update_states", "_step_arrays", "_device_inputs", "_sample"):
            self._wrap(runner, name, name.lstrip("_"))
        self._wrap(runner.batch, "sampling_metadata", "sampling_metadata")
        self._wrap(runner.sampler, "forward", "sampler")
        self._wrap(runner.model, "forward", "model_forward")
        self._wrap(runner.model, "compute_logits", "model_forward")
        execute = runner.execute_model

        def timed_execute(*a, **kw):
            self.current = {}
            out = execute(*a, **kw)
            self.steps.append(self.current)
            return out

        runner.execute_model = timed_execute

    def _wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.current[key] = self.current.get(key, 0.0) + time.thread_time() - t0

        setattr(obj, attr, timed)

    def use_decode_buffers(self) -> None:
        """Time the copy into the decode graphs' static buffers as this step's device inputs."""
        graphs = self.runner.graphs
        run = graphs.run

        def timed_run(*a, **kw):
            t0 = time.thread_time()
            forward0 = self.current.get("model_forward", 0.0)
            out = run(*a, **kw)
            inner = self.current.get("model_forward", 0.0) - forward0
            self.current["device_inputs"] = time.thread_time() - t0 - inner
            return out

        graphs.run = timed_run


def step_costs(raw: dict[str, float]) -> dict[str, float]:
    sample = raw.get("sample", 0.0)
    costs = {
        "update_states": raw.get("update_states", 0.0),
        "step_arrays": raw.get("step_arrays", 0.0),
        "device_inputs": raw.get("device_inputs", 0.0),
        "sampling_metadata": raw.get("sampling_metadata", 0.0),
        # _sample contains sampling_metadata and the sampler: what is left is its own bookkeeping.
        "sample_bookkeeping": sample - raw.get("sampling_metadata", 0.0) - raw.get("sampler", 0.0),
        "model_forward": raw.get("model_forward", 0.0),
        "sampler": raw.get("sampler", 0.0),
    }
    costs["host_total"] = sum(costs[k] for k in HOST_PARTS)
    return {k: 1e3 * v for k, v in costs.items()}


def measure(args: argparse.Namespace, model_dir: Path, decode_buffers: bool) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvfleet_engine import LLM, SamplingParams
    from kvfleet_engine.worker.cuda_graph import eager_capture

    torch.set_num_threads(1)  # one thread: its CPU time is all of the step's work
    llm = LLM(
        model_dir, use_tqdm=False, device="cpu", dtype="float32", max_num_seqs=args.num_seqs,
        max_model_len=args.prompt_len + args.decode_steps + 32, max_num_batched_tokens=8192,
    )  # fmt: skip
    runner = llm.engine.executor.worker.runner
    if decode_buffers:
        runner.use_decode_graphs(eager_capture)
    timer = RunnerTimer(runner)
    if decode_buffers:
        timer.use_decode_buffers()
    params = SamplingParams(max_tokens=args.decode_steps, temperature=0.0, ignore_eos=True)
    samples: list[dict[str, float]] = []
    for r in range(args.repeats + 1):  # the first run warms up
        rng = np.random.default_rng(r)
        prompts = [
            {"prompt_token_ids": rng.integers(3, 4000, args.prompt_len).tolist()}
            for _ in range(args.num_seqs)
        ]
        timer.steps.clear()
        llm.generate(prompts, params, use_tqdm=False)
        # Steady state: all requests decoding (the first steps prefill, the last one finishes them).
        steady = [s for s in timer.steps[:-1] if "step_arrays" in s and s.get("model_forward")]
        steady = steady[-(args.decode_steps - 2) :]
        if r:
            samples += [step_costs(s) for s in steady]
    if decode_buffers and not runner.graph_steps:
        raise RuntimeError("no decode step went through the decode buffers")
    llm.shutdown()
    keys = [*HOST_PARTS, "host_total", "model_forward", "sampler"]
    return {
        "steps": len(samples),
        "median_ms": {k: statistics.median(s[k] for s in samples) for k in keys},
        "p90_ms": {k: common_percentile([s[k] for s in samples], 0.9) for k in keys},
    }


def common_percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model_dir = common.resolve_model(args)
    before = common.contention()
    paths = {"eager": measure(args, model_dir, False), "decode-buffers": measure(args, model_dir, True)}
    after = common.contention()
    met = {name: res["median_ms"]["host_total"] <= args.target_ms for name, res in paths.items()}
    rows = [
        [LABELS[k], *(f"{paths[n]['median_ms'][k]:.3f} / {paths[n]['p90_ms'][k]:.3f}" for n in paths)]
        for k in [*HOST_PARTS, "host_total", "model_forward", "sampler"]
    ]
    notes = [
        f"{args.num_seqs} requests decoding together, {sum(p['steps'] for p in paths.values())} steady steps; "
        "median / p90 ms of thread CPU time (one torch thread)",
        f"contention probe (small-matmul ms before/after): {before['small_op_ms']:.2f}/{after['small_op_ms']:.2f}",
        *(
            f"target {name}: host total <= {args.target_ms:g} ms: {'met' if ok else 'NOT met'}"
            for name, ok in met.items()
        ),
    ]
    common.print_table("Model runner: host-side work per decode step", ["part", *paths], rows, notes)
    result = {
        "benchmark": NAME,
        "command": common.command_line("bench.runner_overhead", argv),
        "config": vars(args),
        "model": {"path": str(model_dir)},
        "env": common.env_info(),
        "contention_before": before,
        "contention_after": after,
        "paths": paths,
        "target": {"host_total_median_ms_max": args.target_ms, "met": met},
    }
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
