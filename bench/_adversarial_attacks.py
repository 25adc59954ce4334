"""The attacks of the gateway-under-abuse run (``bench/adversarial.py``; numbered as in its docstring): each
sends its hostile inputs to the live fleet under a tenant of its own and records its statuses and checks in
the ``Run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from typing import Any

import httpx

from bench import _servers as servers
from bench._adversarial_http import StreamOutcome, connect, pipelined, raw_request, sse_stream
from bench._adversarial_load import Bystander
from bench._adversarial_run import (
    MAX_MODEL_LEN,
    MODEL,
    PROMPT,
    Run,
    admin_auth,
    auth,
    chat,
    completion,
    count,
    json_or_none,
    openai_error,
    rate_limited,
    wait_for,
)

HUGE_FAST_S = 5.0  # a 10 MiB prompt's 400 (upload included), on a busy 2-core machine
HUGE_PRESS_S = 1.0  # 10 MiB prompts are sent for at least this long (16 at most)
BYSTANDER_MAX_DURING_HUGE_S = 2.0
ABORT_WITHIN_S = 3.0  # a client left: the replica's abort and the freed lease


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
