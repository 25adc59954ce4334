"""SIGTERM to a gateway whose streams outlive its ``--shutdown-grace``. Real processes: Redis, two simulated
replicas decoding a token every 100 ms (``engine serve --simulate``), the gateway."""

from __future__ import annotations

import pytest

from kvfleet_common import redis_keys
from tests.gateway.gateway_harness import MODEL, Fleet, wait_until
from tests.server.slow_requests import SLOW_DECODE, SseStream, running, sigterm_exits_within

GRACE_S = 2.0
GATEWAY_ID = "gw-under-sigterm"


@pytest.fixture
def slow_fleet(demo_model, tmp_path):
    with Fleet(demo_model("llama", "tiny"), tmp_path) as f:
        f.start_engines(2, *SLOW_DECODE)
        yield f


def stream(gateway, key: str, max_tokens: int) -> SseStream:
    return SseStream(f"{gateway.url}/v1/completions",
                     {"model": MODEL, "prompt": [100, 101, 102], "max_tokens": max_tokens, "ignore_eos": True},
                     {"Authorization": f"Bearer {key}"})  # fmt: skip


def test_sigterm_ends_the_streams_left_after_the_grace_and_leaves_nothing_in_redis(slow_fleet):
    g = slow_fleet.start_gateway("--shutdown-grace", str(GRACE_S), "--gateway-id", GATEWAY_ID)
    key = g.create_tenant("drained", max_concurrent=100)  # its requests hold concurrency leases in Redis
    redis = slow_fleet.store().client
    long = [stream(g, key, 400) for _ in range(20)]
    for s in long:
        s.wait_started()
    short = stream(g, key, 6)  # ends within the grace: finished, not cut
    short.wait_started()
    assert redis.zscore(redis_keys.gateways(), GATEWAY_ID) is not None
    assert redis.zcard(redis_keys.inflight("drained")) > 0

    sigterm_exits_within(g.proc, GRACE_S + 2)

    short.assert_finished()
    for s in long:
        err = s.cut_error()
        assert err["code"] == "gateway_shutdown" and "grace period of 2 s" in err["message"]

    # the gateway flushed its last report and deregistered: Redis holds nothing of it
    assert redis.zscore(redis_keys.gateways(), GATEWAY_ID) is None
    assert not redis.exists(redis_keys.gateway_load(GATEWAY_ID))
    assert redis.zcard(redis_keys.inflight("drained")) == 0
    for k in redis.scan_iter():
        assert GATEWAY_ID.encode() not in k
        if redis.type(k) == b"zset":
            assert not [m for m in redis.zrange(k, 0, -1) if GATEWAY_ID.encode() in m], k
    # the cut dropped the replicas' connections: the engines aborted the requests
    for e in slow_fleet.engines:
        wait_until(lambda e=e: running(e) == 0, 10, 0.1, "the engines to abort the cut requests")
    log = g.log()
    assert "Exception in ASGI application" not in log and "Cancel" not in log, log[-3000:]
