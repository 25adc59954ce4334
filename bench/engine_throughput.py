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

    .venv/bin/python bench/engine_throughput.py                      # full run (10-20 min on 2 cores)
    .venv/bin/python bench/engine_throughput.py --num-prompts 16 --skip-hf
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common

NAME = "engine_throughput"
TARGET_SPEEDUP = 3.0
TARGET_EFFICIENCY = 0.50


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="small")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=128)
    w.add_argument("--min-prompt", type=int, default=32)
    w.add_argument("--max-prompt", type=int, default=512)
    w.add_argument("--min-output", type=int, default=32)
    w.add_argument("--max-output", type=int, default=256)
    w.add_argument("--seed", type=int, default=0, help="workload seed (prompt tokens and lengths)")
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
    s.add_argument(
        "--hf-cb-api",
        choices=("manager", "generate_batch"),
        default="manager",
        help="manager: per-request max_new_tokens via the CB manager; generate_batch: one max_new_tokens",
    )
    s.add_argument(
        "--hf-cb-max-batch-tokens",
        type=int,
        default=None,
        help="HF CB tokens per step (default: kvfleet's budget)",
    )
    s.add_argument(
        "--hf-cb-max-requests",
        type=int,
        default=None,
        help="HF CB max_requests_per_batch (default: kvfleet's max_num_seqs, at most the number of prompts)",
    )
    s.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up requests")
    m = p.add_argument_group("measurement")
    m.add_argument("--matmul-n", type=int, default=2048, help="matmul size for the FLOP/s probe")
    m.add_argument("--matmul-reps", type=int, default=8)
    m.add_argument("--check", type=int, default=4, help="compare the first N requests' greedy outputs")
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    if not (1 <= args.min_prompt <= args.max_prompt) or not (1 <= args.min_output <= args.max_output):
        p.error("need 1 <= --min-prompt <= --max-prompt and 1 <= --min-output <= --max-output")
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    try:
        args.hf_batch_sizes = [int(b) for b in str(args.hf_batch_sizes).split(",") if b.strip()]
    except ValueError:
        p.error("--hf-batch-sizes must be comma-separated integers")
    if any(b < 1 for b in args.hf_batch_sizes):
        p.error("--hf-batch-sizes must be positive")
    return args


# ---- workload ------------------------------------------------------------------------------------


def make_workload(
    args: argparse.Namespace, model_dir: Path
) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Prompts (token ids), output lengths, and 2 short warm-up prompts, all from ``--seed``."""
    cfg = common.read_model_config(model_dir)
    specials = common.special_token_ids(model_dir)
    rng = random.Random(args.seed)
    prompts, outs = [], []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_prompt, args.max_prompt)
        prompts.append(common.random_token_ids(rng, n, cfg["vocab_size"], specials))
        outs.append(rng.randint(args.min_output, args.max_output))
    wrng = random.Random(args.seed + 1_000_003)
    warm = [
        common.random_token_ids(wrng, min(32, args.max_prompt), cfg["vocab_size"], specials) for _ in range(2)
    ]
    return prompts, outs, warm


WARMUP_TOKENS = 8


# ---- kvfleet -------------------------------------------------------------------------------------


def run_kvfleet(
    model_dir: Path,
    prompts: list[list[int]],
    outs: list[int],
    warm: list[list[int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    from kvfleet_engine import LLM, SamplingParams

    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    common.log("kvfleet: building the engine")
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="float32", use_tqdm=False, **kwargs)
    setup_s = time.perf_counter() - t0
    cfg = llm.config
    try:
        if not args.no_warmup:
            wp = SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0)
            llm.generate([{"prompt_token_ids": p} for p in warm], wp, use_tqdm=False)
            llm.reset_prefix_cache()
        params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0) for k in outs]
        inputs = [{"prompt_token_ids": p} for p in prompts]
        common.log("kvfleet: generating")
        t0 = time.perf_counter()
        results = llm.generate(inputs, params, use_tqdm=True)
        wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    tokens = [list(r.outputs[0].token_ids) for r in results]
    return {
        "wall_s": wall,
        "setup_s": setup_s,
        "generated_tokens": sum(len(t) for t in tokens),
        "num_cached_tokens": sum(r.num_cached_tokens for r in results),
        "engine_config": {
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": cfg.max_model_len,
            "block_size": cfg.block_size,
            "enable_prefix_caching": cfg.enable_prefix_caching,
            "attention_backend": cfg.attention_backend,
            "num_kv_blocks": llm.engine.num_kv_blocks,
        },
        "_tokens": tokens,
    }


# ---- Hugging Face --------------------------------------------------------------------------------


def load_hf_model(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


class _StepBar:
    """A ``generate`` streamer that advances a tqdm bar by one per decoding step (the first put is the prompt)."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.seen_prompt = False

    def put(self, value: Any) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.bar.update(1)

    def end(self) -> None:
        self.seen_prompt = False


def _hf_static_batches(
    model: Any, prompts: list[list[int]], outs: list[int], bs: int, pad_id: int, bar: Any = None
) -> tuple[list[list[int]], int]:
    """Run ``model.generate`` over consecutive batches; return each request's asked-for tokens and the number
    of token positions processed (prompt padding and unasked generated tokens included)."""
    import torch
    from transformers import GenerationConfig

    tokens: list[list[int]] = []
    processed = 0
    for start in range(0, len(prompts), bs):
        bp, bo = prompts[start : start + bs], outs[start : start + bs]
        width, k = max(len(p) for p in bp), max(bo)
        ids = torch.full((len(bp), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(bp), width), dtype=torch.long)
        for i, p in enumerate(bp):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        gen_cfg = GenerationConfig(
            max_new_tokens=k,
            min_new_tokens=k,  # EOS is suppressed until k tokens: no row can stop early
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=pad_id,
            use_cache=True,
        )
        streamer = _StepBar(bar) if bar is not None else None
        with torch.inference_mode():
            seqs = model.generate(
                input_ids=ids, attention_mask=mask, generation_config=gen_cfg, streamer=streamer
            )
        if seqs.shape[1] != width + k:
            raise RuntimeError(f"HF generate returned {seqs.shape[1] - width} new tokens, expected {k}")
        for i, n in enumerate(bo):
            tokens.append(seqs[i, width : width + n].tolist())
        processed += len(bp) * (width + k)
    return tokens, processed


def run_hf_static(
    model: Any,
    prompts: list[list[int]],
    outs: list[int],
    warm: list[list[int]],
    bs: int,
    pad_id: int,
    args: Any,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    if not args.no_warmup:
        _hf_static_batches(model, warm, [WARMUP_TOKENS] * len(warm), bs, pad_id)
    steps = sum(max(outs[i : i + bs]) for i in range(0, len(outs), bs))
    with tqdm(total=steps, desc=f"HF static bs={bs}", unit="step") as bar:
        t0 = time.perf_counter()
        tokens, processed = _hf_static_batches(model, prompts, outs, bs, pad_id, bar)
        wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "batch_size": bs,
        "generated_tokens": sum(len(t) for t in tokens),
        "padded_token_positions": processed,
        "_tokens": tokens,
    }


def _cb_configs(prompts: list[list[int]], outs: list[int], args: Any, max_batch_tokens: int, pad_id: int):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cb_cfg = ContinuousBatchingConfig()
    # Cache pages for every request at once (kvfleet's KV cache also holds the whole workload), the same
    # token budget per step and the same request cap as kvfleet.
    pages = sum(-(-(len(p) + k) // cb_cfg.page_size) for p, k in zip(prompts, outs))
    cb_cfg = ContinuousBatchingConfig(
        num_blocks=pages + 4,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=args.hf_cb_max_requests or min(args.max_num_seqs, len(prompts)),
        seed=args.seed,
    )
    gen_cfg = GenerationConfig(
        max_new_tokens=max(outs), do_sample=False, eos_token_id=-1, pad_token_id=pad_id
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(outs),
        num_requests=len(prompts),
    )
    return cb_cfg, gen_cfg, hints


def _cb_collect(manager: Any, ids: list[str], bar: Any, stall_s: float = 600.0) -> dict[str, Any]:
    results: dict[str, Any] = {}
    wanted = set(ids)
    last = time.perf_counter()
    while len(results) < len(wanted):
        r = manager.get_result(timeout=1)
        if r is not None:
            if r.request_id in wanted and r.is_finished():
                results[r.request_id] = r
                bar.update(1)
                last = time.perf_counter()
        elif not manager.is_running():
            raise RuntimeError("HF continuous-batching generation thread stopped unexpectedly")
        elif time.perf_counter() - last > stall_s:
            raise RuntimeError(f"HF continuous batching made no progress for {stall_s:.0f}s")
    return results


def run_hf_continuous(
    model: Any,
    prompts: list[list[int]],
    outs: list[int],
    warm: list[list[int]],
    args: Any,
    max_batch_tokens: int,
    pad_id: int,
) -> dict[str, Any]:
    from tqdm.auto import tqdm

    cb_cfg, gen_cfg, hints = _cb_configs(prompts, outs, args, max_batch_tokens, pad_id)
    info = {
        "api": args.hf_cb_api,
        "cb_config": {
            "page_size": cb_cfg.page_size,
            "num_blocks": cb_cfg.num_blocks,
            "max_batch_tokens": cb_cfg.max_batch_tokens,
            "max_requests_per_batch": cb_cfg.max_requests_per_batch,
        },
    }
    if args.hf_cb_api == "generate_batch":
        # One max_new_tokens for every request: the largest ask; only the asked tokens are counted.
        # The call includes the manager's set-up and warm-up, so they are inside the timed region.
        with tqdm(total=len(prompts), desc="HF continuous (generate_batch)", unit="req") as bar:
            t0 = time.perf_counter()
            out = model.generate_batch(
                inputs=prompts,
                generation_config=gen_cfg,
                continuous_batching_config=cb_cfg,
                progress_bar=False,
            )
            wall = time.perf_counter() - t0
            bar.update(len(out))
        ordered = list(out.values())
        if len(ordered) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(ordered)} results for {len(prompts)} requests")
    else:
        with model.continuous_batching_context_manager(
            generation_config=gen_cfg,
            continuous_batching_config=cb_cfg,
            block=True,
            timeout=30,
            workload_hints=hints,
        ) as manager:
            if not args.no_warmup:
                wids = [
                    manager.add_request(
                        p, request_id=f"warm_{i}", max_new_tokens=WARMUP_TOKENS, eos_token_id=-1
                    )
                    for i, p in enumerate(warm)
                ]
                with tqdm(total=len(wids), desc="HF continuous warm-up", unit="req", leave=False) as bar:
                    _cb_collect(manager, wids, bar)
            with tqdm(total=len(prompts), desc="HF continuous", unit="req") as bar:
                t0 = time.perf_counter()
                ids = [
                    manager.add_request(p, request_id=f"req_{i}", max_new_tokens=k, eos_token_id=-1)
                    for i, (p, k) in enumerate(zip(prompts, outs))
                ]
                if any(i is None for i in ids):
                    raise RuntimeError("the HF continuous-batching manager dropped requests")
                res = _cb_collect(manager, ids, bar)
                wall = time.perf_counter() - t0
        ordered = [res[i] for i in ids]
    errors = [r.error for r in ordered if r.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} HF continuous-batching requests failed: {errors[0]}")
    tokens = [list(r.generated_tokens[:k]) for r, k in zip(ordered, outs)]
    short = sum(1 for r, k in zip(ordered, outs) if len(r.generated_tokens) < k)
    if short:
        raise RuntimeError(f"{short} HF continuous-batching requests returned fewer tokens than asked")
    return {
        "wall_s": wall,
        "generated_tokens": sum(len(t) for t in tokens),
        "generated_tokens_returned": sum(len(r.generated_tokens) for r in ordered),
        **info,
        "_tokens": tokens,
    }


# ---- report --------------------------------------------------------------------------------------


def _compare(a: list[list[int]], b: list[list[int]], n: int) -> dict[str, Any]:
    """Greedy agreement of the first ``n`` requests: exact matches and common-prefix lengths."""
    n = min(n, len(a), len(b))
    prefixes = []
    for x, y in zip(a[:n], b[:n]):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
    exact = sum(1 for x, y in zip(a[:n], b[:n]) if x == y)
    return {
        "compared": n,
        "exact_matches": exact,
        "common_prefix_lens": prefixes,
        "lens": [len(x) for x in a[:n]],
    }


def _run_system(systems: dict[str, dict[str, Any]], name: str, fn: Any, **on_error: Any) -> None:
    """Run one system; a failure is recorded (error string) instead of ending the benchmark."""
    before = common.contention()
    cpu0 = time.process_time()
    try:
        res = fn()
    except Exception as e:
        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {e}", **on_error}
    res["process_cpu_s"] = time.process_time() - cpu0  # all of this process's threads, set-up included
    res["contention_before"], res["contention_after"] = before, common.contention()
    systems[name] = res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.set_threads(args.threads)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    params = common.parameter_counts(model_dir)
    model_cfg = common.read_model_config(model_dir)
    prompts, outs, warm = make_workload(args, model_dir)
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
        _run_system(systems, "kvfleet", lambda: run_kvfleet(model_dir, prompts, outs, warm, args))
        kv_budget = systems["kvfleet"].get("engine_config", {}).get("max_num_batched_tokens")

    if not args.skip_hf:
        hf_model = load_hf_model(model_dir)
        pad_id = model_cfg.get("pad_token_id")
        if not isinstance(pad_id, int):
            pad_id = (common.eos_token_ids(model_dir) or [0])[0]
        for bs in args.hf_batch_sizes:
            _run_system(
                systems,
                f"hf-static-bs{bs}",
                lambda bs=bs: run_hf_static(hf_model, prompts, outs, warm, bs, pad_id, args),
                batch_size=bs,
            )
        notes.append(
            "hf-static: consecutive batches in arrival order, left-padded with pad=EOS and an attention mask, "
            "max_new_tokens = min_new_tokens = the batch's largest ask, greedy, sdpa; output tok/s and efficiency "
            "count only the tokens each request asked for (padded_token_positions is what was processed)."
        )
        if not args.skip_hf_cb:
            mbt = args.hf_cb_max_batch_tokens or kv_budget or args.max_num_batched_tokens or 2048
            _run_system(
                systems,
                "hf-continuous",
                lambda: run_hf_continuous(hf_model, prompts, outs, warm, args, mbt, pad_id),
                api=args.hf_cb_api,
            )
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
        del hf_model

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
            sanity[f"kvfleet vs {name}"] = _compare(kv["_tokens"], s["_tokens"], args.check)

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
