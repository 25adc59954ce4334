"""How a fleet-store operation runs: round trips, the two runners, Lua scripts, client policy, errors.

An operation is a generator (``Op``) that yields round trips (``Eval`` or ``Batch``), receives each
reply and returns its result; ``run_sync`` and ``run_async`` drive it over a sync or an asyncio client,
so every operation is written once for both front ends (``store``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.exceptions
import redis.retry
from redis.backoff import ExponentialBackoff


class FleetStoreError(Exception):
    """An operation was refused by the contract (e.g. unknown tenant, key owned by another tenant)."""


class SupersededError(FleetStoreError):
    """A newer boot epoch of the same replica name holds the name; this replica must stop publishing."""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA-1 (what EVALSHA names it by)."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

    @classmethod
    def load(cls, name: str) -> Script:
        """The script ``lua/<name>.lua`` of this package."""
        return cls(resources.files(__package__).joinpath("lua", f"{name}.lua").read_text(encoding="utf-8"))


@dataclass(slots=True)
class Eval:
    """One round trip: a Lua script (EVALSHA, falling back to EVAL once if Redis lacks it)."""

    script: Script
    keys: list[str]
    args: list[Any]


@dataclass(slots=True)
class Batch:
    """One round trip: commands sent as one pipeline (MULTI/EXEC when ``transaction``)."""

    commands: list[tuple[Any, ...]]
    transaction: bool = False


Round = Eval | Batch
Op = Generator[Round, Any, Any]  # yields round trips, receives each reply, returns the result


def run_sync(client: redis.Redis, op: Op) -> Any:
    """Run ``op`` to completion over a sync client; returns its result."""
    reply: Any = None
    try:
        while True:
            step = op.send(reply)
            if isinstance(step, Eval):
                try:
                    reply = client.evalsha(step.script.sha, len(step.keys), *step.keys, *step.args)
                except redis.exceptions.NoScriptError:
                    reply = client.eval(step.script.source, len(step.keys), *step.keys, *step.args)
            elif len(step.commands) == 1 and not step.transaction:
                reply = [client.execute_command(*step.commands[0])]
            else:
                pipe = client.pipeline(transaction=step.transaction)
                for cmd in step.commands:
                    pipe.execute_command(*cmd)
                reply = pipe.execute()
    except StopIteration as stop:
        return stop.value


async def run_async(client: redis.asyncio.Redis, op: Op) -> Any:
    """Run ``op`` to completion over an asyncio client; returns its result."""
    reply: Any = None
    try:
        while True:
            step = op.send(reply)
            if isinstance(step, Eval):
                try:
                    reply = await client.evalsha(step.script.sha, len(step.keys), *step.keys, *step.args)
                except redis.exceptions.NoScriptError:
                    reply = await client.eval(step.script.source, len(step.keys), *step.keys, *step.args)
            elif len(step.commands) == 1 and not step.transaction:
                reply = [await client.execute_command(*step.commands[0])]
            else:
                pipe = client.pipeline(transaction=step.transaction)
                for cmd in step.commands:
                    pipe.execute_command(*cmd)
                reply = await pipe.execute()
    except StopIteration as stop:
        return stop.value


def check_binary_client(client: Any) -> None:
    """ValueError unless the client returns bytes: block hashes and tokenizer files are binary."""
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError(
            "the fleet store needs a Redis client with decode_responses=False (hashes are binary)"
        )


def reconnect_policy(sync: bool) -> dict[str, Any]:
    """Client options: retry a command (pipelines and transactions included) twice, quickly, when its
    connection turns out to be dead.

    After Redis restarts, every pooled connection is stale; redis-py's default policy does not retry a
    MULTI/EXEC on one, so the first transaction per connection would fail. Only ConnectionError is retried:
    a dead connection means the command never reached a live server (a crash in the middle of one is the
    rare exception, accepted). Timeouts are not retried: the command may have run (HINCRBY twice)."""
    retry_cls = redis.retry.Retry if sync else redis.asyncio.retry.Retry
    return {"retry": retry_cls(ExponentialBackoff(cap=0.25, base=0.01), 2),
            "retry_on_error": [redis.exceptions.ConnectionError]}  # fmt: skip


def as_text(v: bytes | str | None) -> str | None:
    """A reply element as text (the client returns bytes)."""
    return v.decode() if isinstance(v, bytes) else v


def ttl_ms(ttl: float) -> int:
    """A positive TTL in seconds as whole milliseconds (at least 1); ValueError otherwise."""
    if not ttl > 0:
        raise ValueError(f"TTL must be positive, got {ttl}")
    return max(1, round(ttl * 1000))
