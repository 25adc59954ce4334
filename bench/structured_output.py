"""Structured outputs: throughput with a JSON schema vs unconstrained, and the cost of compiling a grammar.

Workload (defaults): the ``bench`` demo model (Qwen2-0.5B shape; ``--preset small`` or ``tiny`` for quicker
runs) in float32, 32 requests, each a ~200-token document followed by an instruction, each constrained by
one schema of the test corpus (``tests/engine/structured_schemas.py``, cycled: 34 realistic extraction
shapes), greedy, compact JSON (``disable_any_whitespace``), ``max_tokens`` = the corpus budget (400).

Making the two runs comparable: a constrained request ends when its grammar completes, so its length is the
grammar's and the model's doing; an unconstrained one would run to ``max_tokens`` or a random EOS. So the
unconstrained run gives request i ``ignore_eos`` and ``max_tokens`` = the number of tokens request i produced
under its schema (measured in the untimed warm-up; greedy, so every constrained run repeats it, which the
script checks). Both runs then process the same prompts and the same number of output tokens per request,
in the same batches step for step; what differs is the grammar work: the per-step bitmask fill
(llguidance), applying it to the logits, advancing each matcher, and checking completion. (Schemas that
force a fixed-length output would also work, but only for toy shapes; the corpus is what users send.)

Timing: ``--repeats`` rounds of one constrained and one unconstrained ``LLM.generate`` over the whole
workload, alternating which goes first, the prefix cache emptied before each run. The machine is shared and
noisy, so the result is the ratio of the medians. All grammars are compiled in the untimed warm-up: the
throughput runs hit the grammar cache, as a service does for its recurring schemas.

Compile cost, measured separately on the same engine: ``--compile-schemas`` corpus schemas, each made new
``--compile-reps`` times (a unique ``title``: the canonical text misses the cache, the grammar is the same).
For each: the latency of a one-token request with the new schema, then with the same schema again (cached),
then without one, each on a prompt shorter than a KV block (no prefix-cache hit). New minus cached is what a
first request pays for its grammar; cached minus unconstrained is a cache hit plus one mask. Also reported:
the engine's counter (compile-thread time per new grammar) and llguidance alone (a compile, the first mask of
a fresh grammar, a later mask, and copying a compiled template: what a cache hit costs).

Target (issue 25): constrained throughput within 10 % of unconstrained on the CPU.

    .venv/bin/python -m bench.structured_output                    # ~5 min on 2 cores
    .venv/bin/python -m bench.structured_output --preset tiny --num-prompts 8 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench import _common as common
from tests.engine.structured_schemas import MAX_TOKENS, SCHEMAS, validate_instance

NAME = "structured_output"
TARGET_MAX_SLOWDOWN = 0.10

DOCUMENT = (
    "Quarterly report from the northern warehouse. {n} orders shipped in March, up from 980 in February; "
    "returns fell to 2.1 percent. Two suppliers were late: Acme Parts by nine days and Borealis by four. "
    "The support queue closed 311 tickets, 14 of them escalated, with a median time to close of 6.5 hours. "
    "Dana Kim (dana@example.com) leads the team in Lisbon; the next review is on 2026-03-02 at 14:30. "
    "Invoice INV-20931 for three widgets at 12 dollars each was paid in full on Monday. "
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    common.add_model_args(p, default_preset="bench")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=32)
    w.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="output budget of a constrained request"
    )
    w.add_argument(
        "--no-document",
        action="store_true",
        help="prompts of the instruction alone (decode-bound: the grammar's share of a step is largest)",
    )
    w.add_argument(
        "--whitespace",
        choices=("compact", "default"),
        default="compact",
        help="compact: disable_any_whitespace; default: the engine's bounded JSON whitespace",
    )
    m = p.add_argument_group("measurement")
    m.add_argument("--repeats", type=int, default=3, help="rounds of (constrained, unconstrained) runs")
    m.add_argument("--compile-schemas", type=int, default=8, help="corpus schemas timed for the compile cost")
    m.add_argument("--compile-reps", type=int, default=3, help="new variants of each of them timed")
    m.add_argument("--threads", type=int, default=2, help="torch threads")
    m.add_argument("--max-num-seqs", type=int, default=256)
    m.add_argument("--out", default=None, help=f"JSON output (default {common.default_out(NAME)})")
    args = p.parse_args(argv)
    if (
        min(args.num_prompts, args.repeats, args.max_tokens, args.compile_reps) < 1
        or args.compile_schemas < 0
    ):
        p.error(
            "--num-prompts, --repeats, --max-tokens and --compile-reps must be >= 1, --compile-schemas >= 0"
        )
    return args


def workload(num_prompts: int, with_document: bool = True) -> list[tuple[str, str]]:
    """(schema name, prompt) per request: the corpus cycled, each prompt its own document variant (or, without
    the document, only the ~10-token instruction: decode-bound, the grammar's worst case)."""
    names = list(SCHEMAS)
    work = []
    for i in range(num_prompts):
        name = names[i % len(names)]
        document = DOCUMENT.format(n=1000 + i) + "\n" if with_document else f"Request {i}. "
        work.append((name, f"{document}Extract a {name} record as JSON.\n"))
    return work


def _constraint(schema: dict[str, Any], whitespace: str):
    from kvfleet_engine.structured_output.params import StructuredOutputsParams

    return StructuredOutputsParams(json=schema, disable_any_whitespace=whitespace == "compact")


def _timed_generate(
    llm: Any, prompts: list[str], params: list[Any]
) -> tuple[float, list[Any], dict[str, Any]]:
    llm.reset_prefix_cache()  # every run prefills the same prompts from scratch
    before = common.contention()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, outputs, {"before": before, "after": common.contention()}


def _conformance(outputs: list[Any], names: list[str]) -> dict[str, Any]:
    """How many constrained responses completed their grammar and validate against their schema."""
    stopped = valid = 0
    for name, out in zip(names, outputs):
        completion = out.outputs[0]
        stopped += completion.finish_reason == "stop"
        try:
            validate_instance(completion.text, SCHEMAS[name])
            valid += 1
        except Exception:  # not JSON, or not an instance of the schema
            pass
    return {"responses": len(outputs), "finished_stop": stopped, "valid": valid}


def measure_throughput(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvfleet_engine import SamplingParams

    work = workload(args.num_prompts, with_document=not args.no_document)
    names, prompts = [n for n, _ in work], [p for _, p in work]
    constrained = [
        SamplingParams(
            temperature=0,
            max_tokens=args.max_tokens,
            structured_outputs=_constraint(SCHEMAS[n], args.whitespace),
        )
        for n in names
    ]
    common.log(f"warm-up: {len(prompts)} constrained requests (compiles {len(set(names))} grammars)")
    warm = llm.generate(prompts, constrained, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in warm]
    free = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in warm)

    runs: dict[str, list[dict[str, Any]]] = {"constrained": [], "unconstrained": []}
    conformance = None
    for r in range(args.repeats):
        order = ("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained", "constrained")
        for kind in order:
            common.log(f"round {r + 1}/{args.repeats}: {kind}")
            wall, outputs, contention = _timed_generate(
                llm, prompts, constrained if kind == "constrained" else free
            )
            got = [len(o.outputs[0].token_ids) for o in outputs]
            if got != lengths:
                raise RuntimeError(f"{kind} run produced {sum(got)} tokens, the warm-up {sum(lengths)}")
            runs[kind].append({"wall_s": wall, "output_tok_s": sum(got) / wall, "contention": contention})
            if kind == "constrained":
                conformance = _conformance(outputs, names)
    medians = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
    output_tokens = sum(lengths)
    return {
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_len_min": min(lengths),
        "output_len_max": max(lengths),
        "runs": runs,
        "median_wall_s": medians,
        "median_output_tok_s": {k: output_tokens / w for k, w in medians.items()},
        "slowdown": medians["constrained"] / medians["unconstrained"] - 1.0,
        "conformance": conformance,
    }


def measure_compile(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """First-request latency with a new schema vs the same schema cached vs no schema (one-token requests)."""
    from kvfleet_engine import SamplingParams

    manager = llm.engine.structured_outputs
    nonce = time.time_ns()
    names = list(SCHEMAS)[: args.compile_schemas]
    rows = []
    compiles0, seconds0 = manager.num_compiles, manager.compile_seconds
    for rep in range(args.compile_reps):
        for i, name in enumerate(names):
            # A new canonical text, so a cache miss; the grammar is the corpus schema's.
            schema = {**SCHEMAS[name], "title": f"{name}-{nonce}-{rep}"}
            constraint = _constraint(schema, args.whitespace)
            sp = SamplingParams(temperature=0, max_tokens=1, structured_outputs=constraint)
            latency = {}
            for kind, params in (
                ("new", sp),
                ("cached", sp),
                ("unconstrained", SamplingParams(temperature=0, max_tokens=1)),
            ):
                prompt = f"Q{rep}.{i}{kind[0]} {nonce % 9973}:"  # under a KV block: never a prefix-cache hit
                t0 = time.perf_counter()
                llm.generate(prompt, params, use_tqdm=False)
                latency[kind] = time.perf_counter() - t0
            rows.append({"schema": name, "rep": rep, **{f"{k}_ms": 1e3 * v for k, v in latency.items()}})
    engine_compiles = manager.num_compiles - compiles0
    library = _library_compile(llm, names, args.whitespace)

    def med(key: str) -> float | None:
        return statistics.median(r[key] for r in rows) if rows else None

    return {
        "schemas": rows,
        "median_new_ms": med("new_ms"),
        "median_cached_ms": med("cached_ms"),
        "median_unconstrained_ms": med("unconstrained_ms"),
        "engine_compiles": engine_compiles,
        "engine_compile_ms_per_schema": (
            1e3 * (manager.compile_seconds - seconds0) / engine_compiles if engine_compiles else None
        ),
        "library": library,
    }


def _library_compile(llm: Any, names: list[str], whitespace: str) -> dict[str, Any]:
    """llguidance alone, on the engine's tokenizer: a fresh compile, the first mask of a fresh grammar (it
    builds lexer states lazily, so part of the compile happens here), a later mask, and a copy of a compiled
    template (what a cache hit costs)."""
    import numpy as np

    compiler = llm.engine.structured_outputs.compiler
    _ = compiler.tokenizer  # built on first use; not part of a compile
    mask = np.empty((compiler.vocab_size + 31) // 32, dtype=np.int32)
    times: dict[str, list[float]] = {"compile": [], "first_mask": [], "cached_mask": [], "copy": []}

    def timed(key: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        times[key].append(time.perf_counter() - t0)
        return out

    for name in names:
        template = timed("compile", compiler.compile, _constraint(SCHEMAS[name], whitespace))
        matcher = timed("copy", template.deep_copy)
        for key in ("first_mask", "cached_mask"):
            timed(key, matcher.unsafe_compute_mask_ptr, mask.ctypes.data, mask.nbytes)
    result = {f"median_{key}_ms": 1e3 * statistics.median(v) if v else None for key, v in times.items()}
    result["max_compile_ms"] = 1e3 * max(times["compile"]) if names else None
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from kvfleet_engine import LLM

    args = parse_args(argv)
    common.set_threads(args.threads)
    busy = common.busy_machine_warning()
    model_dir = common.resolve_model(args)
    common.log(f"model {model_dir}")
    llm = LLM(
        model=str(model_dir), dtype="float32", device="cpu", use_tqdm=False, max_num_seqs=args.max_num_seqs
    )
    try:
        throughput = measure_throughput(llm, args)
        compile_cost = measure_compile(llm, args)
    finally:
        llm.shutdown()

    slowdown = throughput["slowdown"]
    result: dict[str, Any] = {
        "benchmark": NAME,
        "command": common.command_line(f"bench.{NAME}", argv),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": {"path": str(model_dir), "params": common.parameter_counts(model_dir)},
        "env": common.env_info(),
        "throughput": throughput,
        "compile": compile_cost,
        "targets": {"max_slowdown": TARGET_MAX_SLOWDOWN, "met": slowdown <= TARGET_MAX_SLOWDOWN},
        "notes": [busy] if busy else [],
    }
    _print(result)
    common.write_json(args.out or common.default_out(NAME), result)
    return result


def _print(result: dict[str, Any]) -> None:
    t, c = result["throughput"], result["compile"]
    rows = []
    for kind in ("unconstrained", "constrained"):
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in t["runs"][kind])
        rows.append([kind, walls, f"{t['median_wall_s'][kind]:.2f}", f"{t['median_output_tok_s'][kind]:.1f}"])
    conf = t["conformance"]
    notes = [
        *result["notes"],
        f"{t['num_requests']} requests, {t['prompt_tokens']:,} prompt + {t['output_tokens']:,} output tokens "
        f"(outputs {t['output_len_min']}-{t['output_len_max']} tokens); same output tokens per request in both runs",
        f"constrained / unconstrained median wall: {1 + t['slowdown']:.3f} -> slowdown {100 * t['slowdown']:+.1f} % "
        f"(target <= {100 * TARGET_MAX_SLOWDOWN:.0f} %: {'met' if result['targets']['met'] else 'NOT met'})",
        f"constrained responses: {conf['finished_stop']}/{conf['responses']} finished 'stop', "
        f"{conf['valid']}/{conf['responses']} valid instances of their schemas",
    ]
    common.print_table(
        "Structured outputs: JSON schema vs unconstrained (greedy, float32, CPU)",
        ["run", "wall s per round", "median wall s", "median output tok/s"],
        rows,
        notes,
    )
    lib = c["library"]
    common.print_table(
        "Grammar compile cost (one-token requests; medians over schemas)",
        ["", "ms"],
        [
            ["first request, new schema", common.fmt(c["median_new_ms"])],
            ["same schema again (cached)", common.fmt(c["median_cached_ms"])],
            ["no schema", common.fmt(c["median_unconstrained_ms"])],
            ["engine compile thread, per new schema", common.fmt(c["engine_compile_ms_per_schema"])],
            [
                "llguidance compile (median / max)",
                f"{common.fmt(lib['median_compile_ms'])} / {common.fmt(lib['max_compile_ms'])}",
            ],
            ["llguidance first mask of a fresh grammar", common.fmt(lib["median_first_mask_ms"], 3)],
            ["llguidance the same mask again", common.fmt(lib["median_cached_mask_ms"], 3)],
            ["llguidance copy of a cached template", common.fmt(lib["median_copy_ms"], 3)],
        ],
        [f"{len(c['schemas'])} requests per row: corpus schemas, each made new with a unique title"],
    )


if __name__ == "__main__":
    main()
