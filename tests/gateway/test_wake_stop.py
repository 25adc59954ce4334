"""A request waiting for a sleeping model to wake gets a clean 503 when the gateway's shutdown grace ends
(``Waker.stop``), instead of being cancelled by the shutdown's backstop (which answered a bare 500).

The fleet here is a stand-in that never wakes: the test is about the waiter, not about waking."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from kvfleet_common.server_kit.http import ApiError
from kvfleet_gateway.metrics import GatewayMetrics
from kvfleet_gateway.replica_trust import ReplicaTrust
from kvfleet_gateway.wake import Waker


class _NeverWakes:
    """A model whose one replica sleeps forever; another gateway holds the wake lock."""

    def __init__(self) -> None:
        replica = SimpleNamespace(replica_id="r0", base_url="http://127.0.0.1:9")
        self.view = SimpleNamespace(replicas=[replica], awake=list, sleeping=lambda: [replica])

    def model(self, name: str):
        return self.view

    async def wait_changed(self, timeout: float) -> None:
        await asyncio.sleep(timeout)


async def _lock_held_elsewhere(op: str, kind: str, call) -> bool:
    return False


def _waker(timeout: float) -> Waker:
    calls = _lock_held_elsewhere
    calls.store = None  # type: ignore[attr-defined]
    return Waker(_NeverWakes(), calls, None, GatewayMetrics(), ReplicaTrust(None, "admin"), "gw-test", timeout)  # type: ignore[arg-type]


def test_stop_ends_every_waiter_with_a_503_at_once():
    async def scenario():
        waker = _waker(timeout=60)
        waiters = [asyncio.create_task(waker.ensure_awake("m")) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in waiters)  # still waiting for the wake
        t0 = time.monotonic()
        waker.stop()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert time.monotonic() - t0 < 1.0
        for err in results:
            assert isinstance(err, ApiError) and err.status == 503 and err.code == "gateway_shutdown"
            assert err.headers == {"Retry-After": "1"}
        with pytest.raises(ApiError) as late:  # a request arriving after the stop is answered at once
            await waker.ensure_awake("m")
        assert late.value.code == "gateway_shutdown"

    asyncio.run(scenario())


def test_without_a_stop_the_wait_still_ends_with_its_own_timeout():
    async def scenario():
        with pytest.raises(ApiError) as err:
            await _waker(timeout=0.3).ensure_awake("m")
        assert err.value.status == 503 and err.value.code == "model_waking"

    asyncio.run(scenario())
