"""One routing run's requests (``bench/routing.py``): every session played through the gateway, open loop over
sessions (a chat's turns wait for their answers), each request kept as a ``Record``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from typing import Any

from bench import _fleet as fleet_mod
from bench import _fleet_client as fleet_client
from bench._routing_workloads import Session, Workload, chat_messages

MODEL = "sim"


@dataclass(slots=True)
class Record:
    """One request of a run, for the JSON (times in seconds; ``sent`` from the run's start)."""

    session: int
    turn: int
    group: int | None
    sent: float
    ok: bool
    ttft: float | None
    e2e: float | None
    replica: str | None
    prompt_tokens: int | None
    cached_tokens: int | None
    predicted_cached: int | None
    output_tokens: int | None
    error: str | None


async def run_sessions(
    base_url: str, api_key: str | None, workload: Workload, timeout_s: float
) -> tuple[list[Record], float]:
    """Play every session (open loop over sessions; a chat's turns wait for their answers) through the
    kvfleet gateway, or through a peer router (``api_key`` None: no tenant, and no kvfleet debug header).
    Returns the records and the makespan (first send -> last completion)."""
    records: list[Record] = []
    # the routing decision, for operators only (the gateway's)
    headers = {"x-kvfleet-debug": fleet_mod.ADMIN_TOKEN} if api_key is not None else {}

    async with fleet_client.make_client(base_url, api_key, timeout_s) as client:
        t0 = time.perf_counter()
        last_done = t0

        async def play(s: Session) -> None:
            nonlocal last_done
            await asyncio.sleep(max(0.0, t0 + s.start - time.perf_counter()))
            answers: list[str] = []
            for k in range(len(s.messages)):
                if k:
                    await asyncio.sleep(s.think_s[k - 1])
                body = {
                    "model": MODEL, "messages": chat_messages(s.system, s.messages[: k + 1], answers),
                    "max_tokens": workload.output_len, "stream": True, "stream_options": {"include_usage": True},
                }  # fmt: skip
                res = await fleet_client.stream_request(client, "/v1/chat/completions", body, headers)
                done = time.perf_counter()
                last_done = max(last_done, done)
                records.append(Record(
                    s.sid, k, s.group, res.sent - t0, res.ok, res.ttft, res.e2e,
                    res.replica.split("#")[0] if res.replica else None, res.prompt_tokens, res.cached_tokens,
                    res.predicted_cached, res.output_tokens, res.error,
                ))  # fmt: skip
                if not res.ok:
                    return  # a chat cannot go on without its answer
                answers.append(res.text)

        await asyncio.gather(*(play(s) for s in workload.sessions))
    records.sort(key=lambda r: r.sent)
    return records, last_done - t0


async def warm_up(base_url: str, api_key: str | None, n: int, output_len: int) -> int:
    """``n`` short, unique requests through the gateway (it loads the tokenizer on its first request) or the
    peer router."""
    ok = 0
    async with fleet_client.make_client(base_url, api_key, 120.0) as client:
        for i in range(n):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"warm up {i}"}],
                    "max_tokens": min(4, output_len), "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            res = await fleet_client.stream_request(client, "/v1/chat/completions", body)
            ok += res.ok
    return ok


def request_table(records: Sequence[Record]) -> dict[str, Any]:
    """Per-request records as one row each (times in ms, rounded) for a compact JSON."""
    fields = [f.name for f in dataclass_fields(Record)]
    rows = []
    for r in records:
        row = asdict(r)
        for k in ("sent", "ttft", "e2e"):
            row[k] = None if row[k] is None else round(1e3 * row[k], 1)
        rows.append([row[f] for f in fields])
    return {"fields": [f"{f}_ms" if f in ("sent", "ttft", "e2e") else f for f in fields], "rows": rows}
