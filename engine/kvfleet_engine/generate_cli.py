"""``kvfleet generate`` / ``kvfleet engine generate``: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Flags mirroring ``LLM(...)``'s arguments in kebab case."""
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache size in blocks (default: from memory; 4096 with --simulate)")  # fmt: skip
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--enforce-eager", action="store_true",
                   help="never replay decode steps from captured CUDA graphs (slower; for debugging)")  # fmt: skip
    sim = p.add_argument_group(
        "simulation",
        "--simulate: the real engine with a timing model instead of the model (no weights loaded)",
    )
    sim.add_argument("--simulate", action="store_true",
                     help="replace the forward pass by a timing model emitting deterministic tokens")  # fmt: skip
    sim.add_argument("--sim-prefill-ms-per-1k-tokens", type=float, default=50.0,
                     help="cost of 1,000 uncached prompt tokens (default 50: 20k tokens/s)")  # fmt: skip
    sim.add_argument("--sim-decode-ms-per-step", type=float, default=15.0,
                     help="cost of a step in which any sequence decodes (default 15)")  # fmt: skip
    sim.add_argument("--sim-decode-ms-per-seq", type=float, default=0.1,
                     help="extra cost per decoding sequence in a step (default 0.1)")  # fmt: skip
    sim.add_argument("--sim-step-overhead-ms", type=float, default=1.0,
                     help="fixed cost of every step that computes something (default 1)")  # fmt: skip


def engine_kwargs(args: argparse.Namespace) -> dict:
    keys = [
        "model",
        "dtype",
        "device",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "num_kv_blocks",
        "kv_cache_memory_bytes",
        "enable_prefix_caching",
        "seed",
        "scheduling_policy",
        "attention_backend",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "enforce_eager",
    ]
    kwargs = {k: getattr(args, k) for k in keys}
    if getattr(args, "simulate", False):
        from kvfleet_engine.executor.simulated import SimulationCost

        kwargs["simulation"] = SimulationCost(
            prefill_ms_per_1k_tokens=args.sim_prefill_ms_per_1k_tokens,
            decode_ms_per_step=args.sim_decode_ms_per_step,
            decode_ms_per_seq=args.sim_decode_ms_per_seq,
            step_overhead_ms=args.sim_step_overhead_ms,
        )
    return kwargs


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvfleet generate", description="Generate text offline.")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: a few demo prompts")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message with the chat template"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from kvfleet_engine import LLM, SamplingParams

    prompts = args.prompt or [
        "The history of computing",
        "A recipe for bread starts with",
        "In the mountains, the weather",
    ]
    try:
        llm = LLM(**engine_kwargs(args))
    except ValueError as e:
        print(f"kvfleet generate: {e}", file=sys.stderr)
        return 2
    if args.chat:
        tok = llm.get_tokenizer()
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
            for q in prompts
        ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    n_out = 0
    for o in outputs:
        c = o.outputs[0]
        n_out += len(c.token_ids)
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": o.prompt,
                        "text": c.text,
                        "token_ids": c.token_ids,
                        "finish_reason": c.finish_reason,
                    }
                )
            )
        else:
            print(f"--- {o.prompt!r}\n{c.text!r}  [{len(c.token_ids)} tokens, {c.finish_reason}]")
    print(f"generated {n_out} tokens for {len(outputs)} prompts in {dt:.2f}s", file=sys.stderr)
    return 0


def engine_main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvfleet engine {serve,generate} [args...]")
        return 0
    if argv[0] == "generate":
        return generate_main(argv[1:])
    if argv[0] == "serve":
        from kvfleet_engine.server.serve_cli import serve_main

        return serve_main(argv[1:])
    print(f"kvfleet engine: unknown sub-command {argv[0]!r} (available: serve, generate)", file=sys.stderr)
    return 2
