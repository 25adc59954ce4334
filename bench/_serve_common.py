"""Workload, streaming client and statistics for the serving benchmarks (``bench/serve.py``, ``bench/sleep_wake.py``).

* Prompts: deterministic synthetic text of an exact token length for the model's own tokenizer. Words are
  vocabulary entries of the form ``" <letters>"`` that encode back to themselves as one token; the
  pre-tokenizer splits text at such word boundaries, so a prompt of N words is N tokens (checked when the
  prompts are built, and again against each server's reported ``usage.prompt_tokens``).
* Client: one streamed OpenAI request (``/v1/completions`` or ``/v1/chat/completions``, ``stream: true``,
  ``stream_options.include_usage``); records time to the first chunk carrying text (TTFT), the gaps between
  later text chunks (inter-token latency, per streamed chunk), end-to-end time and the server's usage.
* Load: fixed concurrency (N workers in a closed loop) or open loop (Poisson arrivals at a rate, seeded).
* Statistics: pure functions over the per-request records (percentiles, throughput, token-count checks).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

# ---- prompts -------------------------------------------------------------------------------------

_WORD = re.compile(r"^ [A-Za-z]{2,}$")


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def word_pool(tokenizer: Any) -> list[str]:
    """Vocabulary words (``" <letters>"``) that the tokenizer encodes back to exactly their own single id,
    sorted for determinism."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if _WORD.match(text) and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            words.append(text)
    words = sorted(set(words))
    if len(words) < 50:
        raise ValueError(f"only {len(words)} single-token words in this tokenizer's vocabulary: too few")
    return words


def make_prompts(
    tokenizer: Any, count: int, length: int, seed: int, words: Sequence[str] | None = None
) -> list[str]:
    """``count`` distinct prompts of exactly ``length`` tokens (without special tokens), from ``seed``.

    Each prompt is ``length`` random pool words; a draw whose encoding is not ``length`` tokens (a word pair
    that merges differently) is redrawn, and a prompt equal to an earlier one too (requests never share a
    whole prompt; random first words make shared prefixes short)."""
    if length < 1 or count < 0:
        raise ValueError("need length >= 1 and count >= 0")
    pool = list(words) if words is not None else word_pool(tokenizer)
    rng = random.Random(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > 20 * count + 100:
            raise RuntimeError(f"could not build {count} prompts of exactly {length} tokens")
        text = "".join(rng.choice(pool) for _ in range(length))
        if text in seen or len(tokenizer.encode(text, add_special_tokens=False)) != length:
            continue
        seen.add(text)
        prompts.append(text)
    return prompts


# ---- requests ------------------------------------------------------------------------------------

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def generation_extras(profile: str, output_len: int) -> dict[str, Any]:
    """Request fields that make a server generate exactly ``output_len`` tokens whatever it samples.

    * ``kvfleet`` (and vLLM-compatible servers): ``min_tokens`` and ``ignore_eos``.
    * ``transformers-cb``: ``transformers serve`` rejects unknown fields (422) and has no ``min_tokens``; its
      ``generation_config`` field (a JSON string) replaces the model's generation config, and continuous
      batching takes each request's ``eos_token_id`` from it: -1 matches no token, so only ``max_tokens``
      ends a request.
    * ``transformers`` (sequential ``generate``): the same, plus ``min_new_tokens``.
    * ``none``: nothing (the server may stop early at EOS; the report shows it).
    """
    if profile == "kvfleet":
        return {"min_tokens": output_len, "ignore_eos": True}
    if profile == "transformers-cb":
        return {"generation_config": json.dumps({"do_sample": False, "eos_token_id": -1})}
    if profile == "transformers":
        cfg = {"do_sample": False, "eos_token_id": -1, "min_new_tokens": output_len}
        return {"generation_config": json.dumps(cfg)}
    if profile == "none":
        return {}
    raise ValueError(f"unknown generation-extras profile {profile!r}")


def request_body(
    endpoint: str,
    model: str | None,
    prompt: str | list[int],
    output_len: int,
    extras: dict[str, Any],
    stream: bool = True,
) -> dict[str, Any]:
    """A greedy generation request, streamed with usage in the last chunk unless ``stream`` is False; a
    completions ``prompt`` may be a string or a list of token ids."""
    body: dict[str, Any] = {"max_tokens": output_len, "temperature": 0.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if model is not None:
        body["model"] = model
    if endpoint == "completions":
        body["prompt"] = prompt
    elif endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    body.update(extras)
    return body


@dataclass(slots=True)
class RequestResult:
    """One streamed request. Times are seconds; ``sent`` is ``time.perf_counter()`` when it was sent."""

    sent: float
    ok: bool = False
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    text_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    status: int | None = None
    error: str | None = None
    text: str | None = None  # the streamed text, when asked for
    retry_after: str | None = None  # the Retry-After header of a refused request


def _chunk_text(obj: dict[str, Any]) -> str:
    out = []
    for choice in obj.get("choices") or ():
        if "text" in choice:
            out.append(choice.get("text") or "")
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("content") or "")
    return "".join(out)


def _finish_reason(obj: dict[str, Any]) -> str | None:
    for choice in obj.get("choices") or ():
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


def stream_shortfall(output_tokens: int | None, ttft: float | None) -> str | None:
    """What a stream that ended cleanly lacked to count as a success (None: nothing)."""
    if output_tokens is None:
        return "no usage in the stream"
    if ttft is None:
        return "no text in the stream"
    return None


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], keep_text: bool = False
) -> RequestResult:
    """Send one streaming request and time its chunks. Never raises for server or transport errors: they end
    up in ``error``."""
    res = RequestResult(sent=time.perf_counter())
    last: float | None = None
    parts: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.retry_after = resp.headers.get("retry-after")
                detail = (await resp.aread()).decode(errors="replace")[:300]
                res.error = f"HTTP {resp.status_code}: {detail}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    res.error = f"stream error: {str(obj['error'])[:300]}"
                    return res
                text = _chunk_text(obj)
                if text:
                    parts.append(text)
                    if last is None:
                        res.ttft = now - res.sent
                    else:
                        res.itls.append(now - last)
                    last = now
                    res.text_chunks += 1
                res.finish_reason = _finish_reason(obj) or res.finish_reason
                usage = obj.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.output_tokens = usage.get("completion_tokens")
        res.e2e = time.perf_counter() - res.sent
        if keep_text:
            res.text = "".join(parts)
        res.error = stream_shortfall(res.output_tokens, res.ttft)
        res.ok = res.error is None
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def complete_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], keep_text: bool = False
) -> RequestResult:
    """Send one non-streamed request (``stream: false``) and read its usage: ``e2e`` is the whole request,
    ``ttft`` stays None (there is no first chunk). Never raises for server or transport errors."""
    res = RequestResult(sent=time.perf_counter())
    try:
        resp = await client.post(path, json=body)
        res.status = resp.status_code
        if resp.status_code != 200:
            res.retry_after = resp.headers.get("retry-after")
            res.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return res
        obj = resp.json()
        res.e2e = time.perf_counter() - res.sent
        res.finish_reason = _finish_reason(obj)
        usage = obj.get("usage") or {}
        res.prompt_tokens, res.output_tokens = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if keep_text:
            res.text = _chunk_text(obj)
        res.error = None if res.output_tokens is not None else "no usage in the response"
        res.ok = res.error is None
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def make_client(base_url: str, timeout_s: float) -> httpx.AsyncClient:
    # No connection cap: open-loop arrivals must not queue in the client's pool.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=30.0), limits=limits)


# ---- load ----------------------------------------------------------------------------------------


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of ``count`` requests in a Poisson process of ``rate`` per
    second; all zero for an infinite rate."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(
    client: httpx.AsyncClient,
    path: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
    send: Callable[[httpx.AsyncClient, str, dict[str, Any]], Awaitable[RequestResult]] = stream_request,
) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` with ``concurrency`` closed-loop workers, or open-loop at ``rate`` requests/s (Poisson;
    ``concurrency`` then caps the requests in flight, None = no cap), each through ``send`` (streamed by
    default; ``complete_request`` for non-streamed bodies). Returns the results in body order and the wall
    time from the first send to the last completion."""
    if concurrency is None and rate is None:
        raise ValueError("give concurrency, rate, or both")
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    results: list[RequestResult | None] = [None] * len(bodies)
    cap = asyncio.Semaphore(concurrency) if concurrency is not None else None

    async def one(i: int) -> None:
        if cap is not None:
            async with cap:
                results[i] = await send(client, path, bodies[i])
        else:
            results[i] = await send(client, path, bodies[i])
        if on_done is not None:
            on_done(results[i])

    t0 = time.perf_counter()
    if rate is None:
        queue = list(range(len(bodies)))[::-1]

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        await asyncio.gather(*(worker() for _ in range(min(concurrency or 1, len(bodies)))))
    else:
        tasks = []
        for i, offset in enumerate(poisson_offsets(len(bodies), rate, seed)):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


# ---- statistics ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 3)


def summarize(
    results: Sequence[RequestResult],
    wall_s: float,
    expected_prompt_tokens: int | None,
    expected_output_tokens: int,
) -> dict[str, Any]:
    """Throughput and latency of a timed run. Latencies in milliseconds.

    ``tpot`` (time per output token after the first) = (E2E - TTFT) / (output tokens - 1) per request, which
    does not depend on how the server groups tokens into chunks; ``itl`` is per streamed text chunk.
    ``output_tokens_exact`` is whether every request reported exactly the expected number of tokens."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.e2e is not None and r.ttft is not None and r.output_tokens and r.output_tokens > 1
    ]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown")[:120]
            errors[key] = errors.get(key, 0) + 1
    out_counts = sorted({r.output_tokens for r in ok if r.output_tokens is not None})
    prompt_counts = sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None})
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "wall_s": round(wall_s, 4),
        "request_throughput": len(ok) / wall_s if wall_s > 0 else None,
        "output_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "total_tok_s": (out_tokens + prompt_tokens) / wall_s if wall_s > 0 else None,
        "output_tokens": out_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_request": out_counts,
        "prompt_tokens_per_request": prompt_counts,
        "output_tokens_exact": bool(ok) and out_counts == [expected_output_tokens],
        "prompt_tokens_as_built": None
        if expected_prompt_tokens is None
        else prompt_counts == [expected_prompt_tokens],
        "finish_reasons": _count(r.finish_reason for r in ok),
        "text_chunks_per_request_mean": (sum(r.text_chunks for r in ok) / len(ok)) if ok else None,
        "ttft_ms": _dist(ttfts),
        "itl_ms": _dist(itls),
        "tpot_ms": _dist(tpots),
        "e2e_ms": _dist(e2es),
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def _dist(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "mean": _ms(sum(values) / len(values)) if values else None,
        "p50": _ms(percentile(values, 50)),
        "p90": _ms(percentile(values, 90)),
        "p99": _ms(percentile(values, 99)),
        "max": _ms(max(values)) if values else None,
    }


def result_records(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request records for the JSON (ITL lists summarised to keep files small)."""
    out = []
    for r in results:
        d = asdict(r)
        itls = d.pop("itls")
        d["itl_count"] = len(itls)
        d["itl_max"] = max(itls) if itls else None
        out.append(d)
    return out
