"""Gateway under abuse: the hostile inputs of the gateway-under-abuse issue, sent end to end to a live fleet
for a bounded time, then the leak checks.

Fleet (``_fleet.Fleet``): a real Redis, ``--replicas`` (2) simulated engine replicas (``kvfleet engine serve
--simulate``: a decode step costs ``--step-ms``, 20 ms, so a 300-token stream lasts ~6 s) and one ``kvfleet
gateway``, all real processes spoken to over real HTTP. Every attack's tenant is its own (a new one per
round), so one attack's limits never answer for another's.

Attacks, in rounds until ``--duration`` is spent (at least one round):

1. 30 parallel streamed completions for a tenant with ``max_concurrent: 5``: exactly 5 admitted (their
   leases in Redis), 25 refused with OpenAI's 429 shape and a ``Retry-After``; the admitted clients then
   leave mid-stream and every lease goes.
2. 30 parallel completions for a tenant with ``tokens_per_minute: 100`` (3 prompt token ids + 5 tokens
   each: an estimate of 8): the tokens admitted overrun the budget by less than one estimate. (Sent in a
   minute's first 52 s, waiting up to 8 s for one: the sliding window fades the previous minute out.)
3. 10 MiB prompts (a completion and a chat in turn, for a second and at least twice each): each a 400
   within ``HUGE_FAST_S``, while the bystander tenant's requests keep being answered (all 200s, none slower
   than ``BYSTANDER_MAX_DURING_HUGE_S``).
4. A non-streamed completion of 400 tokens whose client leaves after ~1 s: the replica aborts it (its
   request log line says 499), the tenant's only slot is free again.
5. ``--junk-names`` (10,000; quick 2,000) requests naming models nobody serves, one name in 400 (at most
   20) 1 MiB long, pipelined on 4 connections: all 404 with clipped names, ``/metrics`` stays under 1 MiB
   and names none of them.
6-7. Inputs that once gave 500s, and the type confusions: prompt token ids ``[2147483648]`` and
   ``[-8466490113]``, ``max_tokens: 2**64``, ``priority: 2**70``, a lone surrogate (the JSON escape
   ``"\\ud800"`` in raw bytes) in message content, 100,000 nested ``[``, ``stream: "yes"``, ``stream: 1``,
   a prompt of booleans, ``max_tokens`` above the context: all OpenAI 400s.
8. Admin: a tenant named ``org/team`` is a 400; ten concurrent creates of one name make one 201, nine 409.
9. Two ``Authorization`` headers (400/401), ``/%61dmin/tenants`` (not served by the admin API), a tenant's
   ``x-kvfleet-debug: 1`` (no ``x-kvfleet-route`` header).

Meanwhile, for the whole run: a bystander tenant (a thread of its own: small completions, model lists,
health checks; all 200s, p99 under ``BYSTANDER_P99_S``), streams whose clients read slowly (a 4 KiB receive
buffer read at 4 KiB/s: the gateway must wait for them; each ends with ``[DONE]``) and streams whose
clients vanish after a few events (closed or reset).

10. Then a replica is SIGKILLed under 8 streams: each stream it served ends with an SSE error event and
    ``[DONE]``, the others finish, the next requests are served by the survivor.

Leak checks, after the attacks and again after the kill: no 5xx anywhere (the clients' statuses, the
gateway's ``kvfleet_gateway_requests_total`` by status, where the streams the kill cut are the only 5xx
allowed, and each replica's ``kvfleet_engine_requests_total``), no ``kvf:inflight:*`` lease in Redis (after a
bounded wait: the lease TTL), every replica at 0 running and 0 waiting requests with as many free KV
blocks as at the start, the gateway's in-flight gauge at 0, the gateway's RSS (``/proc/<pid>/status``)
grown by less than ``--rss-bound-mib``. Last, SIGTERM under 3 streams: the gateway exits within its grace +
2 s (the streams end with its ``gateway_shutdown`` error event and ``[DONE]``, Redis keeps no lease of
them), the replicas within theirs + 2 s, and no process of the fleet is left.

Prints a table (attack, requests, statuses, result) and the leak checks, writes JSON
(``bench/results/adversarial.json``), exits 1 when any check failed; each failed check is also logged as it
happens (``FAIL [attack] check: detail``), and an attack that raises or hangs past 2 minutes fails its row
with the exception while the run goes on.

    .venv/bin/python bench/adversarial.py             # ~60 s of attacks, ~90 s in all on 2 vCPUs
    .venv/bin/python bench/adversarial.py --quick     # smoke: one round, ~35 s in all
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common
import _fleet as fleet_mod
import _servers as servers
import httpx

from kvfleet_common import redis_keys

NAME = "adversarial"
MODEL = "sim"
MAX_MODEL_LEN = 512
PROMPT = [100, 101, 102]  # token ids: the gateway's estimate of the prompt is exact
GATEWAY_GRACE_S = 2.0
REPLICA_GRACE_S = 2.0
EXIT_MARGIN_S = 2.0  # a SIGTERMed process must be gone within its grace + this
HUGE_FAST_S = 5.0  # a 10 MiB prompt's 400 (upload included), on a busy 2-core machine
HUGE_PRESS_S = 1.0  # 10 MiB prompts are sent for at least this long (16 at most)
BYSTANDER_P99_S = 2.0
BYSTANDER_MAX_DURING_HUGE_S = 2.0
ABORT_WITHIN_S = 3.0  # a client left: the replica's abort and the freed lease
SETTLE_S = redis_keys.LEASE_TTL_S + 2.0  # bounded wait for the leases and gauges to come back
ERROR_KEYS = {"message", "type", "param", "code"}


# ---- raw HTTP/1.1 (bytes exactly as written; slow and vanishing readers) --------------------------------


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def connect(url: str, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection; ``rcvbuf``: a small kernel receive buffer and as small a read buffer here, so a slow
    reader pushes back on the server within a few KiB."""
    host, port = _host_port(url)
    if rcvbuf is None:
        return await asyncio.open_connection(host, port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock, limit=max(rcvbuf, 4096))


def raw_request(
    url: str, method: str, path: str, headers: Sequence[tuple[str, str]], body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"host: {url.removeprefix('http://')}"]
    lines += [f"{k}: {v}" for k, v in headers]
    lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers


async def body_pieces(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body as it arrives: each chunk of a chunked body, or the whole of a sized one."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        yield await reader.readexactly(int(headers.get("content-length", "0")))
        return
    while size := int((await reader.readline()).split(b";")[0], 16):
        piece = await reader.readexactly(size + 2)
        yield piece[:-2]
    await reader.readline()


@dataclass(slots=True)
class StreamOutcome:
    status: int | str = "no answer"
    replica: str | None = None
    events: int = 0
    done: bool = False  # [DONE] came
    error: dict | None = None  # an SSE error event's ``error``
    failure: str | None = None  # the transport failed (not our leaving)
    left: bool = False  # the client left on purpose


async def sse_stream(
    url: str,
    key: str,
    body: dict[str, Any],
    *,
    read_rate: float | None = None,
    leave_after: int | None = None,
    reset: bool = False,
    started: asyncio.Event | None = None,
    start_after: int = 1,
    out: StreamOutcome | None = None,
) -> StreamOutcome:
    """One streamed completion read event by event: at ``read_rate`` bytes/s (a 4 KiB receive buffer) when
    given; left after ``leave_after`` events (the connection closed, or ``reset``: aborted); ``started`` set
    after ``start_after`` events (or when the stream failed before them). ``out`` fills in as it goes."""
    out = StreamOutcome() if out is None else out
    head = [("authorization", f"Bearer {key}"), ("content-type", "application/json")]
    writer = None
    try:
        reader, writer = await connect(url, rcvbuf=4096 if read_rate else None)
        writer.write(
            raw_request(url, "POST", "/v1/completions", head, json.dumps({**body, "stream": True}).encode())
        )
        out.status, headers = await read_head(reader)
        out.replica = headers.get("x-kvfleet-replica")
        pending = b""
        async for piece in body_pieces(reader, headers):
            if out.status != 200:
                break
            pending += piece
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                out.events += 1
                if data == b"[DONE]":
                    out.done = True
                elif b'"error"' in data:
                    out.error = json.loads(data).get("error")
            if started is not None and out.events >= start_after:
                started.set()
            if leave_after is not None and out.events >= leave_after:
                out.left = True
                break
            if read_rate:
                await asyncio.sleep(len(piece) / read_rate)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        out.failure = f"{type(e).__name__}: {e}"
    finally:
        if started is not None:
            started.set()
        if writer is not None:
            if reset:
                writer.transport.abort()
            else:
                writer.close()
    return out


# ---- the run's bookkeeping ----------------------------------------------------------------------------


def openai_error(body: Any, kind: str) -> bool:
    """``body`` is OpenAI's error object of type ``kind``."""
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and set(err) == ERROR_KEYS and err["type"] == kind


def rate_limited(body: Any, headers: Any) -> bool:
    """OpenAI's 429: a ``rate_limit_error`` and a ``Retry-After`` of at least a second."""
    retry = headers.get("retry-after", "") if headers is not None else ""
    return openai_error(body, "rate_limit_error") and retry.isdigit() and int(retry) >= 1


def json_or_none(r: httpx.Response | bytes) -> Any:
    try:
        return json.loads(r) if isinstance(r, bytes) else r.json()
    except ValueError:
        return None


def count(values: Sequence[Any]) -> dict[str, int]:
    return {str(k): n for k, n in sorted(Counter(str(v) for v in values).items())}


@dataclass
class Run:
    fl: fleet_mod.Fleet
    args: argparse.Namespace
    http: httpx.AsyncClient
    statuses: dict[str, Counter] = field(default_factory=dict)
    checks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    round: int = 0
    replicas: dict[str, servers.ServerProcess] = field(default_factory=dict)  # by replica name (sim-<i>)
    free_blocks_at_start: dict[str, float] = field(default_factory=dict)
    victim_pids: list[int] = field(default_factory=list)
    five_xx: dict[str, int] = field(default_factory=dict)  # the last leak check's counts

    @property
    def url(self) -> str:
        return self.fl.gateway_url

    def replica(self, replica_id: str | None) -> servers.ServerProcess | None:
        """The live replica behind an ``x-kvfleet-replica`` header (``<name>#<epoch>``)."""
        return self.replicas.get((replica_id or "").split("#")[0])

    def seen(self, attack: str, *statuses: int | str) -> None:
        self.statuses.setdefault(attack, Counter()).update(str(s) for s in statuses)

    def check(self, attack: str, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.setdefault(attack, []).append({"name": name, "ok": bool(ok), "detail": str(detail)})
        if not ok:
            common.log(f"FAIL [{attack}] {name}: {detail}")
        return bool(ok)

    async def tenant(self, name: str, **limits: int) -> str:
        r = await self.http.post("/admin/tenants", json={"name": f"{name}-r{self.round}", **limits},
                                 headers=admin_auth())  # fmt: skip
        if r.status_code != 201:
            raise RuntimeError(f"creating tenant {name!r}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()["api_key"]

    def leases(self, tenant: str | None = None) -> int:
        redis = self.fl.redis.client()  # type: ignore[union-attr]
        if tenant is not None:
            return redis.zcard(redis_keys.inflight(f"{tenant}-r{self.round}"))
        return sum(redis.zcard(k) for k in redis.scan_iter(match="kvf:inflight:*"))


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin_auth() -> dict[str, str]:
    return auth(fleet_mod.ADMIN_TOKEN)


def completion(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


async def wait_for(
    predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.05
) -> tuple[bool, float]:
    """Poll ``predicate`` (sync) until true or ``timeout_s``; returns (became true, seconds waited)."""
    t0 = time.monotonic()
    while True:
        if predicate():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return False, time.monotonic() - t0
        await asyncio.sleep(interval_s)


class Bystander(threading.Thread):
    """Another tenant's ordinary traffic on a thread of its own (its latencies are not the attacks' client
    time): a small completion, a model list, a health check, in turn.

    ``records``: (start, seconds, status) per request."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.records: list[tuple[float, float, int | str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=auth(self.key), timeout=30) as c:
            calls = (lambda: c.post("/v1/completions", json=completion(2)), lambda: c.get("/v1/models"),
                     lambda: c.get("/health"))  # fmt: skip
            i = 0
            while not self.stop.wait(0.03):
                t0 = time.monotonic()
                try:
                    status: int | str = calls[i % len(calls)]().status_code
                except httpx.HTTPError as e:
                    status = type(e).__name__
                self.records.append((t0, time.monotonic() - t0, status))
                i += 1

    def between(self, t0: float, t1: float) -> list[tuple[float, float, int | str]]:
        """The requests that were in flight at some point of [t0, t1]."""
        return [r for r in self.records if r[0] <= t1 and r[0] + r[1] >= t0]


# ---- the attacks ----------------------------------------------------------------------------------------


async def attack_concurrency(run: Run, a: str) -> None:
    key = await run.tenant("burst", max_concurrent=5)
    n, answers = 30, []
    all_answered, leave = asyncio.Event(), asyncio.Event()

    async def one() -> None:
        try:
            async with run.http.stream("POST", "/v1/completions", headers=auth(key),
                                       json=completion(300, stream=True)) as r:  # fmt: skip
                if r.status_code == 200:
                    body = r.aiter_raw()  # kept: the iterator collected would close the response
                    answers.append((200, await anext(body), r.headers))  # in flight: the replica generates
                else:
                    answers.append((r.status_code, json.loads(await r.aread()), r.headers))
                if len(answers) == n:
                    all_answered.set()
                if r.status_code == 200:
                    await leave.wait()  # then leaves mid-stream
        except (httpx.HTTPError, ValueError) as e:
            answers.append((type(e).__name__, None, None))
            if len(answers) == n:
                all_answered.set()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(all_answered.wait(), 60)
    held = run.leases("burst")
    leave.set()
    await asyncio.gather(*tasks)
    statuses = sorted(str(s) for s, _, _ in answers)
    run.seen(a, *statuses)
    run.check(a, "5 admitted, 25 refused", statuses == ["200"] * 5 + ["429"] * 25, count(statuses))
    run.check(a, "5 leases in Redis while they ran", held == 5, f"{held} leases")
    bad = [(s, b) for s, b, h in answers if s == 429 and not rate_limited(b, h)]
    run.check(a, "429s: OpenAI error shape + Retry-After", not bad, bad[:2])
    freed, took = await wait_for(lambda: run.leases("burst") == 0, ABORT_WITHIN_S)
    run.check(a, "every lease freed after the clients left", freed, f"{took:.2f} s")


async def attack_tokens_per_minute(run: Run, a: str) -> None:
    # Not in a minute's last seconds: the sliding window would start letting the previous minute fade.
    await wait_for(lambda: time.time() % 60 < 52, 10, 0.2)
    key = await run.tenant("tpm", tokens_per_minute=100)
    estimate = len(PROMPT) + 5
    rs = await asyncio.gather(*(run.http.post("/v1/completions", headers=auth(key), json=completion(5))
                                for _ in range(30)))  # fmt: skip
    run.seen(a, *(r.status_code for r in rs))
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code != 200]
    used = sum(r.json()["usage"]["total_tokens"] for r in ok)
    only_429 = all(r.status_code == 429 for r in refused)
    run.check(
        a, "only 200s and 429s, some of each", ok and refused and only_429, count([r.status_code for r in rs])
    )
    run.check(a, f"overrun < one estimate ({estimate})", used - 100 < estimate,
              f"{len(ok)} admitted, {used} tokens used of 100")  # fmt: skip
    bad = [r.text[:200] for r in refused if not rate_limited(json_or_none(r), r.headers)]
    run.check(a, "429s: OpenAI error shape + Retry-After", not bad, bad[:2])


async def attack_huge_prompts(run: Run, a: str, bystander: Bystander) -> None:
    key = await run.tenant("huge")
    huge = "word " * (2 << 20)  # 10 MiB
    bodies = [("/v1/completions", json.dumps({"model": MODEL, "prompt": huge, "max_tokens": 2}).encode()),
              ("/v1/chat/completions", json.dumps(chat(huge)).encode())]  # fmt: skip
    headers = {**auth(key), "content-type": "application/json"}
    times, bad = [], []
    t0 = time.monotonic()
    # each body twice, then on for a second at least: the bystander's requests meanwhile are the measure
    while len(times) < 4 or (time.monotonic() - t0 < HUGE_PRESS_S and len(times) < 16):
        path, raw = bodies[len(times) % 2]
        t = time.monotonic()
        r = await run.http.post(path, content=raw, headers=headers)
        times.append(time.monotonic() - t)
        run.seen(a, r.status_code)
        if r.status_code != 400 or not openai_error(json_or_none(r), "invalid_request_error"):
            bad.append((path, r.status_code, r.text[:200]))
    t1 = time.monotonic()
    run.check(a, "OpenAI 400s", not bad, bad[:2])
    run.check(a, f"each answered within {HUGE_FAST_S:g} s", max(times) < HUGE_FAST_S,
              f"slowest {max(times):.2f} s")  # fmt: skip
    during = bystander.between(t0, t1)
    slowest = max((d for _, d, _ in during), default=0.0)
    statuses = [s for _, _, s in during]
    run.check(a, "the bystander's requests kept flowing",
              statuses and all(s == 200 for s in statuses) and slowest < BYSTANDER_MAX_DURING_HUGE_S,
              f"{len(during)} answered meanwhile ({count(statuses)}), slowest {slowest:.2f} s")  # fmt: skip


async def attack_client_leaves(run: Run, a: str) -> None:
    key = await run.tenant("leaver", max_concurrent=1)
    rid = f"adversarial-leaves-r{run.round}"
    _, writer = await connect(run.url)
    head = [("authorization", f"Bearer {key}"), ("content-type", "application/json"), ("x-request-id", rid)]
    writer.write(raw_request(run.url, "POST", "/v1/completions", head, json.dumps(completion(400)).encode()))
    await writer.drain()
    await asyncio.sleep(1.0)
    held = run.leases("leaver")
    writer.transport.abort()
    run.seen(a, "left")
    line = f" {rid} model={MODEL} status=499"
    aborted, took = await wait_for(
        lambda: any(line in e.log_path.read_text(errors="replace") for e in run.fl.engines),
        ABORT_WITHIN_S,
        0.1,
    )
    freed, took_lease = await wait_for(lambda: run.leases("leaver") == 0, ABORT_WITHIN_S)
    r = await run.http.post("/v1/completions", headers=auth(key), json=completion(2))
    run.seen(a, r.status_code)
    run.check(a, "running when the client left", held == 1, f"{held} leases")
    run.check(a, "the replica aborted it (499)", aborted, f"{took:.2f} s")
    run.check(
        a, "the slot freed", freed and r.status_code == 200, f"{took_lease:.2f} s; next: {r.status_code}"
    )


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status, headers = await read_head(reader)
    return status, b"".join([piece async for piece in body_pieces(reader, headers)])


async def pipelined(url: str, requests: Sequence[bytes], connections: int = 4) -> list[tuple[int, bytes]]:
    """``requests`` pipelined on a few keep-alive connections: all of a connection's requests are handed to
    its transport at once (it sends them as the socket drains) and their answers read in order meanwhile."""

    async def over_one_connection(batch: Sequence[bytes]) -> list[tuple[int, bytes]]:
        reader, writer = await connect(url)
        writer.writelines(batch)
        try:
            return [await read_answer(reader) for _ in batch]
        finally:
            writer.close()

    per = await asyncio.gather(*(over_one_connection(requests[i::connections]) for i in range(connections)))
    return [answer for batch in per for answer in batch]


async def attack_junk_names(run: Run, a: str) -> None:
    key = await run.tenant("junk")
    n = run.args.junk_names
    n_huge = min(20, max(1, n // 400))  # 1 MiB names: 20 of 10,000
    names = [f"no-such-model-{run.round}-{i}-" + "z" * (i % 40) for i in range(n - n_huge)]
    names += [f"no-such-huge-model-{run.round}-{i}-" + "q" * (1 << 20) for i in range(n_huge)]
    head = [("authorization", f"Bearer {key}"), ("content-type", "application/json")]
    bodies = [("/v1/chat/completions", chat("x", model=m)) if i % 2
              else ("/v1/completions", completion(1, model=m)) for i, m in enumerate(names)]  # fmt: skip
    requests = [raw_request(run.url, "POST", path, head, json.dumps(body).encode()) for path, body in bodies]
    t0 = time.monotonic()
    answers = await pipelined(run.url, requests)
    took = time.monotonic() - t0
    run.seen(a, *(s for s, _ in answers))
    messages = [(json_or_none(b) or {}).get("error", {}).get("message", "") for _, b in answers]
    run.check(a, f"{n} 404s", len(answers) == n and all(s == 404 for s, _ in answers),
              f"{count([s for s, _ in answers])} in {took:.1f} s")  # fmt: skip
    long = [m[:80] for m in messages if len(m) > 300 or not m]
    clipped = sum("characters)" in m for m in messages)
    run.check(
        a, "names echoed clipped", not long and clipped == n_huge, f"{clipped} clipped; too long: {long[:2]}"
    )
    text = (await run.http.get("/metrics")).text
    size = len(text.encode())
    run.check(a, "/metrics < 1 MiB, names none", size < 1 << 20 and "no-such-" not in text,
              f"{size:,} bytes")  # fmt: skip


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(what, path, raw body): each must be an OpenAI 400."""
    done = completion(2)
    over = MAX_MODEL_LEN + 1
    cases: list[tuple[str, str, Any]] = [
        ("prompt [2147483648]", "/v1/completions", {**done, "prompt": [2147483648]}),
        ("prompt [-8466490113]", "/v1/completions", {**done, "prompt": [-8466490113]}),
        ("max_tokens 2**64", "/v1/completions", {**done, "max_tokens": 2**64}),
        ("priority 2**70", "/v1/completions", {**done, "priority": 2**70}),
        ("lone surrogate in content", "/v1/chat/completions",
         b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("100,000 nested [", "/v1/completions", b"[" * 100_000),
        ("100,000 nested [ (chat)", "/v1/chat/completions", b"[" * 100_000),
        ("stream 'yes'", "/v1/completions", {**done, "stream": "yes"}),
        ("stream 1", "/v1/chat/completions", chat("hi", stream=1)),
        ("prompt of booleans", "/v1/completions", {**done, "prompt": [True, False]}),
        ("max_tokens above the context", "/v1/completions", {**done, "max_tokens": over}),
        ("chat max_tokens above the context", "/v1/chat/completions", chat("hi", max_tokens=over)),
    ]  # fmt: skip
    return [(w, p, b if isinstance(b, bytes) else json.dumps(b).encode()) for w, p, b in cases]


async def attack_hostile_bodies(run: Run, a: str) -> None:
    key = await run.tenant("hostile")
    headers = {**auth(key), "content-type": "application/json"}
    bad = []
    for what, path, raw in hostile_bodies():
        r = await run.http.post(path, content=raw, headers=headers)
        run.seen(a, r.status_code)
        if r.status_code != 400 or not openai_error(json_or_none(r), "invalid_request_error"):
            bad.append(f"{what}: {r.status_code} {r.text[:120]}")
    run.check(a, f"{len(hostile_bodies())} OpenAI 400s", not bad, "; ".join(bad))


async def attack_admin(run: Run, a: str) -> None:
    r = await run.http.post("/admin/tenants", json={"name": "org/team"}, headers=admin_auth())
    run.seen(a, r.status_code)
    body = json_or_none(r)
    run.check(a, "'org/team' refused", r.status_code == 400 and openai_error(body, "invalid_request_error"),
              f"{r.status_code} {r.text[:120]}")  # fmt: skip
    name = f"race-r{run.round}"
    rs = await asyncio.gather(*(run.http.post("/admin/tenants", json={"name": name}, headers=admin_auth())
                                for _ in range(10)))  # fmt: skip
    statuses = sorted(r.status_code for r in rs)
    run.seen(a, *statuses)
    run.check(a, "10 concurrent creates: one 201, nine 409", statuses == [201] + [409] * 9, count(statuses))


async def attack_headers(run: Run, a: str) -> None:
    key = await run.tenant("headers")
    two = [("authorization", f"Bearer {key}"), ("authorization", "Bearer kvf-someone-else")]
    r = await run.http.post("/v1/chat/completions", headers=two, json=chat("hi"))
    run.seen(a, r.status_code)
    run.check(
        a,
        "two Authorization headers: 400/401",
        r.status_code in (400, 401),
        f"{r.status_code} {r.text[:120]}",
    )
    for who, h in (("admin", admin_auth()), ("tenant", auth(key))):
        r = await run.http.get("/%61dmin/tenants", headers=h)
        run.seen(a, r.status_code)
        run.check(a, f"/%61dmin/tenants ({who}) not routed to admin", 400 <= r.status_code < 500,
                  f"{r.status_code} {r.text[:120]}")  # fmt: skip
    r = await run.http.post(
        "/v1/chat/completions", headers={**auth(key), "x-kvfleet-debug": "1"}, json=chat("hi")
    )
    run.seen(a, r.status_code)
    routed = "x-kvfleet-route" in r.headers
    run.check(a, "tenant's x-kvfleet-debug: no route header", r.status_code == 200 and not routed,
              f"{r.status_code}, route header: {routed}")  # fmt: skip


# ---- background streams, the replica kill ---------------------------------------------------------------


async def background_streams(run: Run, key: str, stop: asyncio.Event) -> list[tuple[str, StreamOutcome]]:
    """Slow readers and vanishing clients, each in a loop until ``stop``."""
    outcomes: list[tuple[str, StreamOutcome]] = []

    async def slow() -> None:
        while not stop.is_set():
            outcomes.append(("slow", await sse_stream(run.url, key, completion(80), read_rate=4096)))

    async def vanish(i: int) -> None:
        n = 0
        while not stop.is_set():
            out = await sse_stream(
                run.url, key, completion(300), leave_after=3 + n % 5, reset=(i + n) % 2 == 0
            )
            outcomes.append(("vanish", out))
            n += 1
            await asyncio.sleep(0.1)

    await asyncio.gather(*(slow() for _ in range(3)), *(vanish(i) for i in range(2)))
    return outcomes


def check_background(run: Run, a: str, outcomes: list[tuple[str, StreamOutcome]]) -> None:
    run.seen(a, *(o.status for _, o in outcomes))
    slow = [o for kind, o in outcomes if kind == "slow"]
    vanished = [o for kind, o in outcomes if kind == "vanish"]
    bad_slow = [o for o in slow if not (o.status == 200 and o.done and o.error is None and o.failure is None)]
    run.check(a, f"{len(slow)} slow readers: each to [DONE]", slow and not bad_slow, bad_slow[:2])
    bad_gone = [o for o in vanished if not (o.status == 200 and o.left and o.failure is None)]
    run.check(a, f"{len(vanished)} clients vanished mid-stream", vanished and not bad_gone, bad_gone[:2])


def check_bystander(run: Run, a: str, bystander: Bystander) -> None:
    statuses = [s for _, _, s in bystander.records]
    run.seen(a, *statuses)
    latencies = sorted(d for _, d, _ in bystander.records)
    p99 = latencies[int(len(latencies) * 0.99)] if latencies else float("nan")
    worst = latencies[-1] if latencies else float("nan")
    run.check(a, "all 200", statuses and all(s == 200 for s in statuses), count(statuses))
    run.check(a, f"p99 < {BYSTANDER_P99_S:g} s", p99 < BYSTANDER_P99_S, f"p99 {p99:.3f} s, max {worst:.3f} s")


async def attack_replica_kill(run: Run, a: str) -> int:
    """SIGKILL the replica serving most of 8 streams. Returns how many streams it cut."""
    key = await run.tenant("kill")
    starts = [asyncio.Event() for _ in range(8)]
    outs = [StreamOutcome() for _ in starts]
    tasks = [asyncio.create_task(sse_stream(run.url, key, completion(300), started=s, start_after=3, out=o))
             for s, o in zip(starts, outs)]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    served = Counter(o.replica for o in outs if run.replica(o.replica) is not None)
    if not served:
        run.check(a, "a replica to kill", False, [o.replica for o in outs])
        await asyncio.gather(*tasks)
        return 0
    victim_id = served.most_common(1)[0][0]
    victim = run.replica(victim_id)
    assert victim is not None
    run.check(
        a, "8 streams running at the kill", all(not t.done() for t in tasks), count([o.status for o in outs])
    )
    run.victim_pids = servers.process_tree(victim.pid)
    os.killpg(victim.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await asyncio.to_thread(victim.stop, 1.0, 1.0)  # reaps it
    run.replicas = {n: e for n, e in run.replicas.items() if e is not victim}
    run.fl.engines.remove(victim)
    run.seen(a, *(o.status for o in outs))
    cut = [o for o in outs if o.replica == victim_id]
    bad_cut = [o for o in cut if not (o.done and o.error and o.error.get("code") == "upstream_failed")]
    run.check(a, f"{len(cut)} cut streams: SSE error event + [DONE]", cut and not bad_cut, bad_cut[:2])
    bad_rest = [
        o for o in outs if o.replica != victim_id and not (o.done and o.error is None and o.failure is None)
    ]
    run.check(a, f"{len(outs) - len(cut)} streams elsewhere finished", not bad_rest, bad_rest[:2])
    rs = [await run.http.post("/v1/completions", headers=auth(key), json=completion(2)) for _ in range(4)]
    run.seen(a, *(r.status_code for r in rs))
    ok = all(r.status_code == 200 and r.headers.get("x-kvfleet-replica") != victim_id for r in rs)
    run.check(a, "the next 4 requests served by the survivor", ok, count([r.status_code for r in rs]))
    return len(cut)


# ---- leak checks, shutdown ------------------------------------------------------------------------------


def five_xx(statuses: dict[str, float] | Counter) -> int:
    return int(sum(n for s, n in statuses.items() if str(s).startswith("5")))


async def leak_checks(run: Run, when: str, expected_gateway_5xx: int) -> None:
    c = f"leaks {when}"
    client = sum(five_xx(s) for s in run.statuses.values())
    run.check(c, "no 5xx answered to a client", client == 0, f"{client} 5xx")
    by_status = fleet_mod.metric_by(fleet_mod.scrape(run.url), "kvfleet_gateway_requests_total", "status")
    gw = run.five_xx["gateway"] = five_xx(by_status)
    run.check(c, "gateway: no 5xx but the streams the kill cut", gw == expected_gateway_5xx,
              f"{gw} 5xx, {expected_gateway_5xx} expected; by status {count_floats(by_status)}")  # fmt: skip
    ok, took = await wait_for(lambda: run.leases() == 0, SETTLE_S, 0.1)
    run.check(c, "Redis: no kvf:inflight:* lease", ok, f"{run.leases()} left after {took:.1f} s")

    def gauge() -> float:
        return fleet_mod.metric_sum(fleet_mod.scrape(run.url), "kvfleet_gateway_inflight_requests")

    ok, took = await wait_for(lambda: gauge() == 0, SETTLE_S, 0.1)
    run.check(c, "gateway in-flight gauge 0", ok, f"{gauge():g} after {took:.1f} s")
    replica_5xx = 0
    for name, e in run.replicas.items():
        url = e.command.base_url

        def idle(url: str = url) -> tuple[float, float, float, float]:
            s = fleet_mod.scrape(url)
            return (fleet_mod.metric_sum(s, "kvfleet_engine_num_requests_running"),
                    fleet_mod.metric_sum(s, "kvfleet_engine_num_requests_waiting"),
                    fleet_mod.metric_sum(s, "kvfleet_engine_kv_cache_free_blocks"),
                    five_xx(fleet_mod.metric_by(s, "kvfleet_engine_requests_total", "status")))  # fmt: skip

        start = run.free_blocks_at_start[name]
        ok, took = await wait_for(lambda f=idle, b=start: f()[:3] == (0, 0, b), SETTLE_S, 0.1)
        running, waiting, free, errors = idle()
        run.check(c, f"{name}: 0 running, 0 waiting", running == waiting == 0,
                  f"{running:g} running, {waiting:g} waiting after {took:.1f} s")  # fmt: skip
        run.check(c, f"{name}: free KV blocks back to {start:g}", free == start, f"{free:g} free")
        run.check(c, f"{name}: no 5xx", errors == 0, f"{errors} 5xx")
        replica_5xx += errors
    run.five_xx.update(client=client, replicas=replica_5xx, gateway_expected=expected_gateway_5xx)


def count_floats(d: dict[str, float]) -> dict[str, int]:
    return {k: int(v) for k, v in sorted(d.items())}


def alive(pid: int) -> bool:
    return servers._state(pid) not in (None, "Z")


def sigterm_and_wait(p: servers.ServerProcess, bound_s: float) -> tuple[float | None, int | None]:
    """SIGTERM ``p``'s process group; seconds until every process of it exited (None: not within
    ``bound_s`` + 10 s, then it is SIGKILLed) and the leader's exit code."""
    t0 = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    gone = None
    while time.monotonic() - t0 < bound_s + 10:
        if p.proc is not None and p.proc.poll() is not None and not servers._group_alive(p.pid):
            gone = time.monotonic() - t0
            break
        time.sleep(0.05)
    return gone, p.stop(grace_s=0.5, linger_s=0.5)


async def shutdown(run: Run) -> None:
    """SIGTERM the gateway under 3 streams longer than its grace, then the replicas; nothing may be left."""
    c = "shutdown"
    fl = run.fl
    assert fl.gateway is not None
    pids = [*servers.process_tree(fl.gateway.pid), *run.victim_pids]
    for e in run.replicas.values():
        pids += servers.process_tree(e.pid)
    key = await run.tenant("drain")
    starts = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(sse_stream(run.url, key, completion(400), started=s)) for s in starts]
    await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
    bound = GATEWAY_GRACE_S + EXIT_MARGIN_S
    gone, code = await asyncio.to_thread(sigterm_and_wait, fl.gateway, bound)
    fl.gateway = None
    run.check(c, f"gateway exits within {bound:g} s", gone is not None and gone < bound,
              f"{gone if gone is None else round(gone, 2)} s, exit code {code}")  # fmt: skip
    run.check(c, "gateway exit code 0 (or -SIGTERM)", code in (0, -signal.SIGTERM), code)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    run.seen(c, *(o.status for o in outs))
    bad = [o for o in outs if not (o.done and o.error and o.error.get("code") == "gateway_shutdown")]
    run.check(c, "its 3 streams: gateway_shutdown event + [DONE]", not bad, bad[:2])
    run.check(c, "Redis: no lease left by the gateway", run.leases() == 0, f"{run.leases()} leases")
    bound = REPLICA_GRACE_S + EXIT_MARGIN_S
    engines = list(run.replicas.values())
    with ThreadPoolExecutor(max(1, len(engines))) as pool:
        results = list(pool.map(lambda e: sigterm_and_wait(e, bound), engines))
    fl.engines = []
    for name, (gone, code) in zip(run.replicas, results):
        run.check(c, f"{name} exits within {bound:g} s", gone is not None and gone < bound,
                  f"{gone if gone is None else round(gone, 2)} s, exit code {code}")  # fmt: skip
    left = [p for p in pids if alive(p)]
    run.check(c, "no process of the fleet left", not left, f"{len(pids)} processes; left: {left}")


# ---- the run ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(p, default_preset="tiny")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 12 s of attacks (one round), 2,000 junk names"
    )
    p.add_argument("--duration", type=float, default=None,
                   help="seconds of attacks and background load (default 60; quick 12): rounds of the attack "
                        "list run while the next one fits, at least one")  # fmt: skip
    p.add_argument("--replicas", type=int, default=2, help="simulated replicas (>= 2: one is killed)")
    p.add_argument("--step-ms", type=float, default=20.0, help="the simulated replicas' decode step")
    p.add_argument("--junk-names", type=int, default=None,
                   help="junk model names a round (default 10,000; quick 2,000)")  # fmt: skip
    p.add_argument("--rss-bound-mib", type=float, default=64.0,
                   help="the gateway's largest allowed RSS growth over the run (default 64 MiB)")  # fmt: skip
    p.add_argument(
        "--log-dir", default=None, help="process logs (default bench/results/logs/adversarial-<time>)"
    )
    p.add_argument("--out", default=None, help="JSON output (default bench/results/adversarial.json)")
    args = p.parse_args(argv)
    if args.duration is None:
        args.duration = 12.0 if args.quick else 60.0
    if args.junk_names is None:
        args.junk_names = 2_000 if args.quick else 10_000
    if args.replicas < 2:
        p.error("--replicas must be >= 2 (one is killed, the survivors serve on)")
    if args.junk_names < 1 or args.duration <= 0 or args.step_ms <= 0:
        p.error("--junk-names, --duration and --step-ms must be positive")
    return args


Attack = Callable[[Run, str], Awaitable[Any]]


async def guarded(run: Run, name: str, step: Callable[[], Awaitable[Any]], timeout_s: float = 120) -> Any:
    """``step()``'s result; one that raises (a hang past ``timeout_s``, a refused connection) fails a check of
    ``name`` and gives None: the run goes on."""
    try:
        return await asyncio.wait_for(step(), timeout_s)
    except Exception as e:
        run.check(name, "ran to its end", False, f"{type(e).__name__}: {e}")
        return None


def rss(pid: int) -> int:
    return servers.tree_memory(pid)["rss_bytes"]


async def attack_all(fl: fleet_mod.Fleet, args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    info: dict[str, Any] = {}
    async with fleet_mod.make_client(fl.gateway_url, None, timeout_s=120) as http:
        run = Run(fl, args, http)
        run.replicas = {f"sim-{i}": e for i, e in enumerate(fl.engines)}
        for name, e in run.replicas.items():
            run.free_blocks_at_start[name] = fleet_mod.metric_sum(
                fleet_mod.scrape(e.command.base_url), "kvfleet_engine_kv_cache_free_blocks"
            )
        bystander_key, streams_key = await run.tenant("bystander"), await run.tenant("streams")
        for path, body in (("/v1/completions", completion(2)), ("/v1/chat/completions", chat("warm up"))):
            r = await http.post(path, json=body, headers=auth(bystander_key))  # the tokenizer loaded
            r.raise_for_status()
        assert fl.gateway is not None
        gateway_pid = fl.gateway.pid
        info["rss_start_bytes"] = rss(gateway_pid)

        bystander = Bystander(fl.gateway_url, bystander_key)
        bystander.start()
        stop = asyncio.Event()
        background = asyncio.create_task(background_streams(run, streams_key, stop))

        async def huge_prompts(run: Run, a: str) -> None:
            await attack_huge_prompts(run, a, bystander)

        attacks: list[tuple[str, Attack]] = [
            ("1 max_concurrent 5: 30 at once", attack_concurrency),
            ("2 tokens/min 100: 30 at once", attack_tokens_per_minute),
            ("3 10 MiB prompts", huge_prompts),
            ("4 client leaves a non-stream", attack_client_leaves),
            (f"5 {args.junk_names:,} junk model names", attack_junk_names),
            ("6-7 hostile bodies", attack_hostile_bodies),
            ("8 admin: names, create race", attack_admin),
            ("9 headers, %-paths, debug", attack_headers),
        ]
        t0 = time.monotonic()
        deadline = t0 + args.duration
        info["round_s"], info["rss_after_round_mib"] = [], []
        while True:
            t = time.monotonic()
            for name, attack in attacks:
                await guarded(run, name, lambda name=name, attack=attack: attack(run, name))
            info["round_s"].append(round(time.monotonic() - t, 1))
            info["rss_after_round_mib"].append(round(rss(gateway_pid) / (1 << 20), 1))
            run.round += 1
            common.log(f"round {run.round} done in {info['round_s'][-1]} s")
            if time.monotonic() + info["round_s"][-1] > deadline:
                break
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))  # the background load runs its course
        stop.set()
        bystander.stop.set()
        await asyncio.to_thread(bystander.join, 60)
        info["attack_s"] = round(time.monotonic() - t0, 1)
        streams = "10 slow / vanishing streams"
        outcomes = await guarded(run, streams, lambda: asyncio.wait_for(background, 60)) or []
        check_background(run, streams, outcomes)
        check_bystander(run, "bystander tenant, all along", bystander)

        await guarded(run, "leaks after the attacks", lambda: leak_checks(run, "after the attacks", 0))
        info["rss_after_attacks_bytes"] = rss(gateway_pid)
        kill = "10 replica SIGKILL, 8 streams"
        cut = info["streams_cut_by_the_kill"] = (
            await guarded(run, kill, lambda: attack_replica_kill(run, kill)) or 0
        )
        await guarded(run, "leaks after the kill", lambda: leak_checks(run, "after the kill", cut))
        info["rss_end_bytes"] = rss(gateway_pid)
        start_mib, end_mib = info["rss_start_bytes"] / (1 << 20), info["rss_end_bytes"] / (1 << 20)
        run.check("leaks after the kill", f"gateway RSS grew < {args.rss_bound_mib:g} MiB",
                  end_mib - start_mib < args.rss_bound_mib,
                  f"{start_mib:.0f} -> {end_mib:.0f} MiB ({end_mib - start_mib:+.1f})")  # fmt: skip
        await guarded(run, "shutdown", lambda: shutdown(run))
    return run, info


def render(result: dict[str, Any]) -> None:
    rows = []
    for name, att in result["attacks"].items():
        failed = [c["name"] for c in att["checks"] if not c["ok"]]
        statuses = " ".join(f"{s}:{n:,}" for s, n in att["statuses"].items())
        rows.append([name, att["requests"], statuses, "pass" if att["ok"] else "FAIL",
                     "; ".join(failed) if failed else f"{len(att['checks'])} checks"])  # fmt: skip
    x = {k: result["five_xx"].get(k, "?") for k in ("client", "gateway", "gateway_expected", "replicas")}
    common.print_table(
        f"Gateway under abuse: {result['rounds']} round(s), {result['attack_s']} s of attacks",
        ["attack", "requests", "statuses", "result", "checks"], rows,
        [f"5xx: {x['client']} answered to clients, {x['replicas']} by the surviving replicas; the gateway "
         f"counted {x['gateway']} ({x['gateway_expected']} expected: the streams the replica kill cut, each "
         "an SSE error event after its 200)"],
    )  # fmt: skip
    rows = [[c["when"].removeprefix("leaks "), c["name"], "pass" if c["ok"] else "FAIL", c["detail"][:64]]
            for c in result["leak_checks"]]  # fmt: skip
    common.print_table("Leak and shutdown checks", ["when", "check", "result", "detail"], rows)
    print(f"RESULT: {'PASS' if result['ok'] else 'FAIL'} in {result['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    # the replicas' request log lines reach their files at once
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    model_dir = common.resolve_model(args)
    log_dir = (Path(args.log_dir) if args.log_dir
               else common.RESULTS_DIR / "logs" / f"{NAME}-{time.strftime('%Y%m%d-%H%M%S')}")  # fmt: skip
    result: dict[str, Any] = {
        "benchmark": NAME, "command": common.command_line("bench/adversarial.py", argv),
        "config": vars(args) | {"gateway_grace_s": GATEWAY_GRACE_S, "replica_grace_s": REPLICA_GRACE_S,
                                "max_model_len": MAX_MODEL_LEN},
        "env": {"platform": platform.platform(), "python": platform.python_version(),
                "cpu": common._cpu_model(), "cpu_count": os.cpu_count(), "git_commit": common._git_commit(),
                "loadavg": common.loadavg()},
    }  # fmt: skip
    cost = fleet_mod.SimCost(0.0, args.step_ms, 0.0, 0.0)
    with fleet_mod.Fleet(model_dir, MODEL, log_dir, args.replicas, cost, 2048, MAX_MODEL_LEN,
                         replica_args=["--log-level", "info", "--shutdown-timeout", f"{REPLICA_GRACE_S:g}"],
                         gateway_args=["--shutdown-grace", f"{GATEWAY_GRACE_S:g}"]) as fl:  # fmt: skip
        result["boot_s"] = fl.boot("prefix-aware")
        run, info = asyncio.run(attack_all(fl, args))
    result.update(info)
    result["rounds"] = run.round
    result["attacks"], result["leak_checks"] = {}, []
    for name, checks in run.checks.items():
        if name.startswith(("leaks", "shutdown")):
            result["leak_checks"] += [{"when": name, **c} for c in checks]
        else:
            statuses = run.statuses.get(name, Counter())
            result["attacks"][name] = {
                "requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
                "checks": checks, "ok": all(c["ok"] for c in checks),
            }  # fmt: skip
    result["five_xx"] = {**run.five_xx, "client": sum(five_xx(s) for s in run.statuses.values())}
    checks = [*(c for a in result["attacks"].values() for c in a["checks"]), *result["leak_checks"]]
    result["ok"] = all(c["ok"] for c in checks)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["log_dir"] = str(log_dir)
    render(result)
    common.write_json(args.out or common.default_out(NAME), result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
