"""The gateway overhead benchmark's load (``bench/gateway_overhead.py``): the streamed requests, the two loads
(``paced``: open-loop Poisson arrivals; ``closed``: clients back to back), the alternating direct / gateway
(/ peer router) rounds with the counters taken around each (gateway metrics, Redis's own counters, CPU
seconds).

Invariant: every round of a set sends the same prompts (at the same arrival times under ``paced``), and
every request carries an ``X-Request-Id`` (``bench_request_id``) that the gateway and the peer router
forward and the servers log, so a sample can be matched with the servers' own timings of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench import _common as common
from bench import _fleet as fleet_mod
from bench import _fleet_client as fleet_client
from bench import _fleet_metrics as fleet_metrics
from bench import _serve_common as sc

MODEL = "sim"
PEER_SIDE = "vllm-router"  # the side through vLLM's router (``--peer vllm-router``)
REFERENCE_ROUND = -2  # the sequential reference's requests (warm-up: -1, measured rounds: 0, 1, ...)


@dataclass(slots=True)
class Sample:
    side: str  # "direct" | "gateway" | PEER_SIDE
    round: int
    client: int
    index: int
    ok: bool
    ttft: float | None
    e2e: float | None
    error: str | None
    start: float = 0.0  # seconds into the round (open loop)
    # the replica's own view (its per-request log line): arrival at its handler -> first token / last chunk
    engine_ttft: float | None = None
    engine_e2e: float | None = None
    # the gateway's own view (its per-request log line): arrival -> upstream request sent / first event relayed
    gateway_overhead: float | None = None
    gateway_ttft: float | None = None

    @property
    def request_id(self) -> str:
        return bench_request_id(self.side, self.round, self.client, self.index)


def bench_request_id(side: str, rnd: int, client: int, index: int) -> str:
    """The ``X-Request-Id`` a request carries (the gateway forwards it; the replica logs it)."""
    return f"gwo-{side}-{rnd}-{client}-{index}"


async def send(
    client: Any, side: str, rnd: int, i: int, j: int, text: str, output_len: int, t0: float = 0.0
) -> Sample:
    """One streamed request; ``t0``: the round's start (``Sample.start`` is counted from it)."""
    headers = {"x-request-id": bench_request_id(side, rnd, i, j)}
    r = await fleet_client.stream_request(client, "/v1/chat/completions", body(text, output_len), headers)
    return Sample(side, rnd, i, j, r.ok, r.ttft, r.e2e, r.error, r.sent - t0)


def open_client(args: argparse.Namespace, base_url: str, api_key: str | None) -> Any:
    """The load generator's client for one side (``--client``), to use in ``async with``."""
    if args.client == "httpx":
        return fleet_client.make_client(base_url, api_key, 120.0)
    return fleet_client.SseClient(base_url, api_key, 120.0)


def body(prompt: str, output_len: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


async def closed_loop(
    client: Any, side: str, rnd: int, prompts: list[list[str]], output_len: int
) -> tuple[list[Sample], float]:
    """``len(prompts)`` clients, client ``i`` sending ``prompts[i]`` one after another. Returns the samples and
    the round's wall time."""

    async def one_client(i: int) -> list[Sample]:
        out = []
        for j, text in enumerate(prompts[i]):
            out.append(await send(client, side, rnd, i, j, text, output_len, t0))
        return out

    t0 = time.perf_counter()
    per_client = await asyncio.gather(*(one_client(i) for i in range(len(prompts))))
    return [s for c in per_client for s in c], time.perf_counter() - t0


def arrival_times(count: int, rate: float, seed: int) -> list[float]:
    """``count`` Poisson arrival offsets (seconds from the round's start) at ``rate`` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def paced_rate(args: argparse.Namespace) -> float:
    """Arrivals per second that keep ``--concurrency`` streams in flight (Little's law): a stream lasts about
    half a step (to the next step) plus one step per token."""
    return args.concurrency / ((args.output_len + 0.5) * args.step_ms / 1e3)


def in_flight(spans: Sequence[tuple[float, float]], wall: float) -> dict[str, float]:
    """Mean (time-weighted) and peak number of ``(start, end)`` intervals open at once."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return {"mean": round(sum(b - a for a, b in spans) / wall, 1) if wall > 0 else 0.0, "peak": peak}


async def open_loop(
    client: Any, side: str, rnd: int, prompts: list[str], arrivals: list[float], output_len: int
) -> tuple[list[Sample], float, dict[str, float]]:
    """Request ``i`` (``prompts[i]``) starts at ``arrivals[i]`` seconds into the round, whatever the others do.
    Returns the samples, the round's wall time and the streams in flight (mean, peak)."""
    t0 = time.perf_counter()

    async def one(i: int) -> Sample:
        delay = t0 + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await send(client, side, rnd, i, 0, prompts[i], output_len, t0)

    samples = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    spans = [(s.start, s.start + s.e2e) for s in samples if s.e2e is not None]
    return list(samples), wall, in_flight(spans, wall)


async def run_round(
    client: Any, side: str, rnd: int, texts: list[str], args: argparse.Namespace, seed: int
) -> tuple[list[Sample], float, dict[str, float]]:
    """One round of ``texts`` under ``--load``: open-loop Poisson arrivals (``seed``) at the paced rate, or
    ``--concurrency`` clients each sending its consecutive share back to back (client ``i``'s ``j``-th request
    is ``texts[i * share + j]``). Returns samples, wall time and streams in flight (paced only)."""
    if args.load == "paced":
        arrivals = arrival_times(len(texts), paced_rate(args), seed)
        return await open_loop(client, side, rnd, texts, arrivals, args.output_len)
    width = min(args.concurrency, len(texts)) or 1
    share = -(-len(texts) // width)
    got, wall = await closed_loop(
        client, side, rnd, [texts[i * share : (i + 1) * share] for i in range(width)], args.output_len
    )
    return got, wall, {}


@dataclass(slots=True)
class Snapshot:
    """Counters around a round: gateway metrics, Redis's own counters, CPU seconds of each process (the peer
    router's too when there is one)."""

    request_trips: float
    background_trips: float
    trips_by_op: dict[str, float]
    redis: dict[str, Any]
    cpu_gateway: float
    cpu_engine: float
    cpu_client: float
    cpu_peer: float | None = None  # None: no peer router in this run

    @classmethod
    def take(cls, fl: fleet_mod.Fleet, peer_pid: int | None = None) -> Snapshot:
        assert fl.redis is not None and fl.gateway is not None
        s = fleet_metrics.scrape(fl.gateway_url)
        trips = fleet_metrics.metric_by(s, "kvfleet_gateway_redis_round_trips_total", "op")
        return cls(
            request_trips=fleet_metrics.metric_sum(s, "kvfleet_gateway_redis_round_trips_total", path="request"),
            background_trips=fleet_metrics.metric_sum(s, "kvfleet_gateway_redis_round_trips_total", path="background"),
            trips_by_op=trips, redis=fl.redis.command_stats(),
            cpu_gateway=fleet_metrics.cpu_seconds([fl.gateway.pid]), cpu_engine=fleet_metrics.cpu_seconds([fl.engines[0].pid]),
            cpu_client=time.process_time(),
            cpu_peer=fleet_metrics.cpu_seconds([peer_pid]) if peer_pid is not None else None,
        )  # fmt: skip


def delta(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    return {
        "request_trips": b.request_trips - a.request_trips,
        "background_trips": b.background_trips - a.background_trips,
        "trips_by_op": {
            k: v - a.trips_by_op.get(k, 0.0)
            for k, v in b.trips_by_op.items()
            if v - a.trips_by_op.get(k, 0.0)
        },
        "redis": fleet_metrics.command_stats_delta(a.redis, b.redis),
        "cpu_gateway": b.cpu_gateway - a.cpu_gateway,
        "cpu_engine": b.cpu_engine - a.cpu_engine,
        "cpu_client": b.cpu_client - a.cpu_client,
        **(
            {"cpu_peer": b.cpu_peer - a.cpu_peer} if a.cpu_peer is not None and b.cpu_peer is not None else {}
        ),
    }


def _add(total: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """Sum two ``delta`` results (nested dicts of numbers)."""
    out = dict(total)
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _add(total.get(k, {}), v)
        else:
            out[k] = total.get(k, 0) + v
    return out


def make_prompts(
    args: argparse.Namespace, tokenizer: Any, words: list[str], count: int, salt: int
) -> list[str]:
    return sc.make_prompts(tokenizer, count, args.prompt_words, seed=args.seed * 100 + salt, words=words)


@contextlib.contextmanager
def collections_between_rounds():
    """The load generator's garbage collections wait until the round is over. This process holds the
    tokenizer (transformers, torch: hundreds of thousands of objects), and a full collection in the middle
    of a round stalled every stream in flight for 100-200 ms: one such cluster per round decided the p99 of
    whichever side it fell in (seen in the request table: on both sides, at one moment per round, outside
    the replica's time)."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()  # what is alive now (the tokenizer, the clients) is not walked again
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if not frozen_before:  # unfreeze() thaws everything: leave what someone else froze (a test's server)
            gc.unfreeze()
        gc.collect()


def side_order(sides: Sequence[str], k: int) -> list[str]:
    """The order of the sides in round set (or sequential request) ``k``: direct first, then the routed
    sides, rotated from one set to the next so that neither router always runs right after the direct
    round (a slow drift of the shared machine, or what one round leaves behind, hits each alike)."""
    first, routed = list(sides[:1]), list(sides[1:])
    if not routed:
        return first
    shift = k % len(routed)
    return first + routed[shift:] + routed[:shift]


async def measure(
    fl: fleet_mod.Fleet,
    args: argparse.Namespace,
    tokenizer: Any,
    words: list[str],
    peer_url: str | None = None,
    peer_pid: int | None = None,
) -> dict[str, Any]:
    """Warm-up, the sequential reference (closed load), then alternating rounds with counters taken around
    each. ``peer_url``: a peer router in front of the same replica, the third side (``PEER_SIDE``)."""
    assert fl.api_key is not None
    paced = args.load == "paced"
    clients = {"direct": open_client(args, fl.engine_urls[0], None)}
    # --a-a: the "gateway" side goes straight to the replica too (what the measures read when nothing differs)
    clients["gateway"] = (
        open_client(args, fl.engine_urls[0], None)
        if args.a_a
        else open_client(args, fl.gateway_url, fl.api_key)
    )
    if peer_url is not None:
        clients[PEER_SIDE] = open_client(args, peer_url, None)  # the router has no tenants or keys
    sides = list(clients)

    def snapshot() -> Snapshot:
        return Snapshot.take(fl, peer_pid)

    async with contextlib.AsyncExitStack() as stack:
        for c in clients.values():
            await stack.enter_async_context(c)
        warm = make_prompts(args, tokenizer, words, args.warmup_requests, 1)
        for side, c in clients.items():
            samples, _, _ = await run_round(c, side, -1, warm, args, args.seed)
            if not any(s.ok for s in samples):
                raise RuntimeError(f"every warm-up request to the {side} side failed: {samples[0].error}")

        # Sequential reference: one request at a time, alternating sides, same prompt on each.
        ref: list[Sample] = []
        before = snapshot()
        for j, text in enumerate(make_prompts(args, tokenizer, words, args.reference_requests, 2)):
            for side in side_order(sides, j):
                ref.append(await send(clients[side], side, REFERENCE_ROUND, 0, j, text, args.output_len))
        ref_counters = delta(before, snapshot())

        rounds: list[dict[str, Any]] = []
        samples: list[Sample] = []
        counters: dict[str, dict[str, Any]] = {side: {} for side in sides}
        per_round = args.requests_per_round if paced else args.concurrency * args.requests_per_client
        for k in range(args.rounds):
            texts = make_prompts(args, tokenizer, words, per_round, 10 + k)
            for side in side_order(sides, k):
                what = (f"{per_round} requests at {paced_rate(args):.1f}/s" if paced
                        else f"{args.concurrency} streams x {args.requests_per_client}")  # fmt: skip
                common.log(f"round {k + 1}/{args.rounds}: {side}, {what}")
                before = snapshot()
                with collections_between_rounds():
                    got, wall, streams = await run_round(
                        clients[side], side, k, texts, args, args.seed * 1000 + k
                    )
                d = delta(before, snapshot())
                counters[side] = _add(counters[side], d)
                samples.extend(got)
                rounds.append({
                    "round": k, "side": side, "requests": len(got), "ok": sum(s.ok for s in got), "wall_s": wall,
                    "streams_in_flight": streams, "loadavg": common.loadavg(),
                })  # fmt: skip
    return {"reference": ref, "reference_counters": ref_counters, "samples": samples, "rounds": rounds,
            "counters": counters}  # fmt: skip
