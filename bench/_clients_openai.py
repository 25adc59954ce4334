"""What a user of the ``openai`` SDK writes against an OpenAI-compatible server, as a script.

It imports only the standard library and ``openai`` (so it runs in any environment that has the SDK, as
``python bench/_clients_openai.py``), reads the key from ``OPENAI_API_KEY`` as the SDK does, and sends
``--requests`` requests from ``--concurrency`` threads, cycling through the four shapes a user sends:
chat and completions, each streamed (``stream_options.include_usage``) and not. Every request asks for
logprobs, which carry one entry per generated token: the count of those entries is an exact, client-side
count of the tokens received, to hold ``usage.completion_tokens`` against (re-tokenizing the text is not:
see docs/BENCHMARKS.md). The results go to ``--out`` as JSON, one record per request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

SHAPES = ("chat-stream", "completions-stream", "chat", "completions")


def _prompt(i: int) -> str:
    # Distinct prompts: no two requests share more than a few leading tokens.
    return f"Request {i}: write a short story about harbour number {i * 7919 % 1009} and its lighthouse."


def _one(client: openai.OpenAI, model: str, i: int, max_tokens: int) -> dict[str, Any]:
    shape = SHAPES[i % len(SHAPES)]
    record: dict[str, Any] = {"index": i, "shape": shape, "ok": False}
    t0 = time.perf_counter()
    try:
        if shape == "chat":
            r = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": _prompt(i)}], max_tokens=max_tokens,
                logprobs=True,
            )  # fmt: skip
            record["logprob_tokens"] = len(r.choices[0].logprobs.content or [])
            record["text"] = r.choices[0].message.content or ""
            usage = r.usage
        elif shape == "completions":
            r = client.completions.create(model=model, prompt=_prompt(i), max_tokens=max_tokens, logprobs=0)
            record["logprob_tokens"] = len(r.choices[0].logprobs.tokens or [])
            record["text"] = r.choices[0].text
            usage = r.usage
        else:
            usage, count, parts = None, 0, []
            if shape == "chat-stream":
                stream = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": _prompt(i)}], max_tokens=max_tokens,
                    logprobs=True, stream=True, stream_options={"include_usage": True},
                )  # fmt: skip
            else:
                stream = client.completions.create(
                    model=model, prompt=_prompt(i), max_tokens=max_tokens, logprobs=0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if shape == "chat-stream":
                        count += len(choice.logprobs.content or []) if choice.logprobs else 0
                        parts.append(choice.delta.content or "")
                    else:
                        count += len(choice.logprobs.tokens or []) if choice.logprobs else 0
                        parts.append(choice.text)
            record["logprob_tokens"] = count
            record["text"] = "".join(parts)
        if usage is None:
            raise RuntimeError("no usage in the response")
        record["completion_tokens"] = usage.completion_tokens
        record["prompt_tokens"] = usage.prompt_tokens
        details = usage.prompt_tokens_details
        record["cached_tokens"] = (details.cached_tokens or 0) if details is not None else 0
        record["ok"] = True
    except Exception as e:  # a failed request is a result: recorded, not raised
        record["error"] = f"{type(e).__name__}: {e}"
    record["latency_s"] = time.perf_counter() - t0
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="the server's root URL, without /v1")
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    # OPENAI_API_KEY from the environment, as the SDK reads it; a server without auth takes any key.
    client = openai.OpenAI(base_url=args.base_url.rstrip("/") + "/v1", max_retries=0, timeout=120)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        records = list(pool.map(lambda i: _one(client, args.model, i, args.max_tokens), range(args.requests)))
    result = {
        "openai_version": openai.__version__,
        "wall_s": time.perf_counter() - t0,
        "requests": len(records),
        "failed": sum(not r["ok"] for r in records),
        "records": records,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
