"""``kvfleet generate`` / ``kvfleet engine generate``: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from kvfleet_engine.engine_args import EngineArgs


def generate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvfleet generate", description="Generate text offline.")
    EngineArgs.add_cli_args(p)
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
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
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
