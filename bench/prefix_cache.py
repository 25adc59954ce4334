"""Prefix caching on vs off, end to end, on the kvfleet engine (``LLM.generate``).

Two scenarios, each measured with caching on and off (defaults):

* ``shared``: 64 prompts = one 448-token random prefix + 64 unique random tokens each; 16 output tokens.
  Target (issue): >= 3x faster end to end with caching on.
* ``no-share``: 64 fully random 512-token prompts; 16 output tokens. Target: <= 3 % slower with caching on
  (its cost is hashing blocks and cache bookkeeping, with nothing to gain).

One engine per setting, each built once; every measurement starts cold (``llm.reset_prefix_cache()``).
Measurements alternate on/off over ``--rounds`` rounds (the order flips each round) and the median wall
time is reported, since the no-share difference is within run-to-run noise. Greedy, EOS ignored; the
outputs with caching on and off are compared token for token (they must agree). Hit rate = sum of
``num_cached_tokens`` / sum of prompt tokens.

    .venv/bin/python -m bench.prefix_cache                 # small preset, 3 rounds
    .venv/bin/python -m bench.prefix_cache --rounds 5 --out /tmp/prefix.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench import _common as common

NAME = "prefix_cache"
TARGET_SPEEDUP = 3.0
TARGET_MAX_SLOWDOWN_PCT = 3.0
SETTINGS = ("on", "off")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="small")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--prefix-len", type=int, default=448, help="shared prefix tokens (shared scenario)")
    w.add_argument("--suffix-len", type=int, default=64, help="unique tokens after the prefix")
    w.add_argument("--output-len", type=int, default=16)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--skip-no-share", action="store_true", help="measure only the shared-prefix scenario")
    e = p.add_argument_group("engine")
    e.add_argument("--threads", type=int, default=2)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget per step (engine default)"
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine max_model_len (default: prompt + output length, which keeps the two KV caches small)",
    )
    m = p.add_argument_group("measurement")
    m.add_argument("--rounds", type=int, default=3, help="alternating on/off rounds; medians are reported")
    m.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up requests")
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.rounds < 1 or args.output_len < 1:
        p.error("--num-prompts, --rounds and --output-len must be >= 1")
    if args.prefix_len < 0 or args.suffix_len < 1:
        p.error("need --prefix-len >= 0 and --suffix-len >= 1")
    return args


def make_workloads(args: argparse.Namespace, model_dir: Path) -> dict[str, list[list[int]]]:
    vocab = common.read_model_config(model_dir)["vocab_size"]
    specials = common.special_token_ids(model_dir)
    rng = random.Random(args.seed)
    prefix = common.random_token_ids(rng, args.prefix_len, vocab, specials)
    work = {
        "shared": [
            prefix + common.random_token_ids(rng, args.suffix_len, vocab, specials)
            for _ in range(args.num_prompts)
        ]
    }
    if not args.skip_no_share:
        n = args.prefix_len + args.suffix_len
        work["no-share"] = [common.random_token_ids(rng, n, vocab, specials) for _ in range(args.num_prompts)]
    return work


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    common.set_threads(args.threads)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    work = make_workloads(args, model_dir)
    prompt_len = args.prefix_len + args.suffix_len
    max_model_len = args.max_model_len or prompt_len + args.output_len

    from kvfleet_engine import LLM, SamplingParams

    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "max_model_len": max_model_len}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    common.log(f"model {model_dir}; building one engine with prefix caching on and one with it off")
    llms = {
        s: LLM(
            model=str(model_dir), dtype="float32", enable_prefix_caching=(s == "on"), use_tqdm=False, **kwargs
        )
        for s in SETTINGS
    }
    engine_cfg = llms["on"].config
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    vocab = common.read_model_config(model_dir)["vocab_size"]
    specials = common.special_token_ids(model_dir)

    try:
        if not args.no_warmup:
            wrng = random.Random(args.seed + 1_000_003)
            warm = [
                {"prompt_token_ids": common.random_token_ids(wrng, 32, vocab, specials)} for _ in range(2)
            ]
            for llm in llms.values():
                llm.generate(
                    warm, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False
                )

        runs: dict[str, dict[str, list[dict[str, Any]]]] = {sc: {s: [] for s in SETTINGS} for sc in work}
        outputs: dict[str, dict[str, list[list[int]]]] = {sc: {} for sc in work}
        total = args.rounds * len(work) * len(SETTINGS)
        k = 0
        for r in range(args.rounds):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for sc, prompts in work.items():
                inputs = [{"prompt_token_ids": p} for p in prompts]
                for s in order:
                    k += 1
                    llm = llms[s]
                    llm.reset_prefix_cache()  # every measurement starts cold
                    common.log(f"[{k}/{total}] round {r + 1}/{args.rounds}, {sc}, prefix caching {s}")
                    t0 = time.perf_counter()
                    res = llm.generate(inputs, params, use_tqdm=True)
                    wall = time.perf_counter() - t0
                    runs[sc][s].append(
                        {
                            "round": r,
                            "wall_s": wall,
                            "prompt_tokens": sum(len(o.prompt_token_ids) for o in res),
                            "cached_tokens": sum(o.num_cached_tokens for o in res),
                            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in res),
                            "contention_after": common.contention(),
                        }
                    )
                    outputs[sc].setdefault(s, [list(o.outputs[0].token_ids) for o in res])
    finally:
        for llm in llms.values():
            llm.shutdown()

    scenarios: dict[str, Any] = {}
    for sc, by_setting in runs.items():
        entry: dict[str, Any] = {"num_prompts": len(work[sc]), "prompt_len": prompt_len}
        for s, rs in by_setting.items():
            walls = [x["wall_s"] for x in rs]
            ptoks = sum(x["prompt_tokens"] for x in rs)
            gtoks = rs[0]["generated_tokens"]
            med = _median(walls)
            entry[s] = {
                "walls_s": walls,
                "median_s": med,
                "min_s": min(walls),
                "max_s": max(walls),
                "hit_rate": sum(x["cached_tokens"] for x in rs) / ptoks if ptoks else 0.0,
                "cached_tokens_per_round": [x["cached_tokens"] for x in rs],
                "prompt_tokens": rs[0]["prompt_tokens"],
                "generated_tokens": gtoks,
                "total_tok_s": (rs[0]["prompt_tokens"] + gtoks) / med,
                "runs": rs,
            }
        on, off = entry["on"], entry["off"]
        per_round = [b["wall_s"] / a["wall_s"] for a, b in zip(by_setting["on"], by_setting["off"])]
        entry["speedup"] = off["median_s"] / on["median_s"]  # > 1: caching on is faster
        entry["slowdown_pct"] = 100.0 * (on["median_s"] / off["median_s"] - 1.0)  # > 0: caching on is slower
        entry["speedup_per_round"] = per_round
        entry["speedup_median_of_rounds"] = _median(per_round)
        a, b = outputs[sc]["on"], outputs[sc]["off"]
        entry["outputs_identical"] = sum(1 for x, y in zip(a, b) if x == y)
        scenarios[sc] = entry

    sh = scenarios["shared"]
    ns = scenarios.get("no-share")
    result: dict[str, Any] = {
        "benchmark": NAME,
        "config": {k: v for k, v in vars(args).items()},
        "model": {"path": str(model_dir)},
        "engine": {
            "max_num_seqs": engine_cfg.max_num_seqs,
            "max_num_batched_tokens": engine_cfg.max_num_batched_tokens,
            "max_model_len": engine_cfg.max_model_len,
            "block_size": engine_cfg.block_size,
            "attention_backend": engine_cfg.attention_backend,
            "dtype": str(engine_cfg.dtype),
        },
        "env": common.env_info(),
        "scenarios": scenarios,
        "speedup_shared": sh["speedup"],
        "slowdown_pct_no_share": ns["slowdown_pct"] if ns else None,
        "notes": [busy] if busy else [],
        "targets": {
            "speedup_shared": TARGET_SPEEDUP,
            "max_slowdown_pct_no_share": TARGET_MAX_SLOWDOWN_PCT,
            "speedup_met": sh["speedup"] >= TARGET_SPEEDUP,
            "slowdown_met": None if ns is None else ns["slowdown_pct"] <= TARGET_MAX_SLOWDOWN_PCT,
        },
    }

    rows = []
    for sc, e in scenarios.items():
        for s in SETTINGS:
            x = e[s]
            if s == "off":
                vs = "baseline"
            elif sc == "shared":
                vs = f"{e['speedup']:.2f}x faster"
            else:
                vs = f"{e['slowdown_pct']:+.1f}% time"
            rows.append(
                [
                    sc,
                    s,
                    f"{x['median_s']:.2f}",
                    f"{x['min_s']:.2f}-{x['max_s']:.2f}",
                    f"{x['total_tok_s']:.0f}",
                    f"{100 * x['hit_rate']:.1f}%",
                    f"{e['outputs_identical']}/{e['num_prompts']}",
                    vs,
                ]
            )
    notes = [
        *([busy] if busy else []),
        f"{args.num_prompts} prompts x {prompt_len} tokens (shared: {args.prefix_len}-token common prefix + "
        f"{args.suffix_len} unique), {args.output_len} output tokens, {args.rounds} rounds alternating on/off, "
        f"medians; {args.threads} threads",
        f"shared prefix: {sh['speedup']:.2f}x faster with caching (per-round {', '.join(f'{v:.2f}' for v in sh['speedup_per_round'])}); "
        f"target >= {TARGET_SPEEDUP:.0f}x: {'met' if sh['speedup'] >= TARGET_SPEEDUP else 'NOT met'}",
    ]
    if ns:
        notes.append(
            f"no sharing: {ns['slowdown_pct']:+.1f}% time with caching on (per-round on/off ratios "
            f"{', '.join(f'{1 / v:.3f}' for v in ns['speedup_per_round'])}); target <= {TARGET_MAX_SLOWDOWN_PCT:.0f}% "
            f"slower: {'met' if ns['slowdown_pct'] <= TARGET_MAX_SLOWDOWN_PCT else 'NOT met'}"
        )
    common.print_table(
        "Prefix caching (kvfleet, float32, CPU)",
        ["scenario", "caching", "median s", "range s", "total tok/s", "hit rate", "same output", "vs off"],
        rows,
        notes,
    )
    common.write_json(args.out or common.default_out(NAME), result)
    return result


if __name__ == "__main__":
    main()
