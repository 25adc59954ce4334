"""The gateway benchmarks' streaming client: one streamed OpenAI request, recorded as ``StreamResult``.

``stream_request`` records what the routing benchmarks need beyond ``_serve_common.stream_request``: the
replica that served it (the gateway's ``x-kvfleet-replica`` header), the cached prompt tokens the engine
reported, the gateway's prediction of them (its ``x-kvfleet-route`` debug header) and the streamed text (a
chat's next turn quotes it). It takes an httpx client (``make_client``) or the leaner ``SseClient``, which
costs the load generator a fraction of the CPU per streamed event (``bench/gateway_overhead.py`` uses it).
Neither raises for a server or transport error: it ends up in ``StreamResult.error``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from bench import _serve_common as sc
from kvfleet_gateway.upstream import Upstream, UpstreamConnectError, UpstreamReadError


@dataclass(slots=True)
class StreamResult:
    """One streamed request. ``sent`` is ``time.perf_counter()`` at send; other times are seconds after it.
    ``ttft``: first chunk with text; ``e2e``: end of the stream."""

    sent: float
    ok: bool = False
    status: int | None = None
    ttft: float | None = None
    e2e: float | None = None
    replica: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    predicted_cached: int | None = None  # the gateway's prediction for the replica it chose (debug header)
    text: str = ""
    error: str | None = None


def _delta_text(obj: dict[str, Any]) -> str:
    out = []
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.append(delta.get("content") or "")
        elif "text" in choice:
            out.append(choice.get("text") or "")
    return "".join(out)


def _predicted_cached(route: str | None, replica: str | None) -> int | None:
    """The chosen candidate's ``matched_tokens`` from the gateway's ``x-kvfleet-route`` debug header."""
    if not route or not replica:
        return None
    try:
        candidates = json.loads(route).get("candidates") or ()
    except (ValueError, AttributeError):
        return None
    for c in candidates:
        if c.get("replica") == replica:
            return int(c.get("matched_tokens") or 0)
    return None


class _StreamReader:
    """Folds one stream's SSE ``data:`` payloads into its ``StreamResult`` as they arrive."""

    __slots__ = ("over", "parts", "res")

    def __init__(self, res: StreamResult) -> None:
        self.res = res
        self.parts: list[str] = []
        self.over = False  # [DONE] or an error event came

    def event(self, data: str, now: float) -> None:
        res = self.res
        if data == "[DONE]":
            self.over = True
            res.e2e = now - res.sent
            return
        obj = json.loads(data)
        if obj.get("error"):
            self.over = True
            res.error = f"stream error: {str(obj['error'])[:300]}"
            return
        text = _delta_text(obj)
        if text:
            if res.ttft is None:
                res.ttft = now - res.sent
            self.parts.append(text)
        usage = obj.get("usage")
        if usage:
            res.prompt_tokens = usage.get("prompt_tokens")
            res.output_tokens = usage.get("completion_tokens")
            res.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def finish(self, now: float) -> StreamResult:
        res = self.res
        if res.error is not None:
            return res
        if res.e2e is None:
            res.e2e = now - res.sent
        res.text = "".join(self.parts)
        res.error = sc.stream_shortfall(res.output_tokens, res.ttft)
        res.ok = res.error is None
        return res


async def stream_request(
    client: httpx.AsyncClient | SseClient,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> StreamResult:
    """Send one streaming request (``body`` must ask for ``stream_options.include_usage``). Never raises for
    server or transport errors: they end up in ``error``."""
    if isinstance(client, SseClient):
        return await client.stream(path, body, headers)
    res = StreamResult(sent=time.perf_counter())
    reader = _StreamReader(res)
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            _take_head(res, resp.status_code, resp.headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    reader.event(line[5:].strip(), time.perf_counter())
                    if reader.over:
                        break
        return reader.finish(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _take_head(res: StreamResult, status: int, headers: Mapping[str, str]) -> None:
    res.status = status
    res.replica = headers.get("x-kvfleet-replica")
    res.predicted_cached = _predicted_cached(headers.get("x-kvfleet-route"), res.replica)


class SseClient:
    """A lean streaming client for load generation: the gateway's own HTTP/1.1 client (asyncio protocols,
    httptools' C parser, a keep-alive pool), each event parsed as it arrives in the connection's
    ``data_received`` and timed there.

    Why: the load generator shares the machine's CPUs with what it measures. httpx spends ~8 ms of CPU on a
    64-token stream (a task wake-up, anyio and h11 per chunk), more than the gateway relaying the same
    stream, so at 100 streams the bench's own client was the largest consumer of the CPUs the gateway and
    the replica compete for. ``bench/gateway_overhead.py --client httpx`` keeps the old client. Events must
    end with a blank line (``\n\n``), as kvfleet's servers write them."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s
        self._http: Upstream | None = None

    async def __aenter__(self) -> SseClient:
        self._http = Upstream(connect_timeout_s=30.0, read_timeout_s=self.timeout_s, max_connections=1 << 20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()

    async def stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> StreamResult:
        assert self._http is not None, "use SseClient in `async with`"
        res = StreamResult(sent=time.perf_counter())
        reader = _StreamReader(res)
        try:
            resp = await self._http.post(
                self.base_url + path, json.dumps(body).encode(), {**self.headers, **(headers or {})}
            )
        except (UpstreamConnectError, UpstreamReadError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        pending = bytearray()

        def on_data(data: bytes) -> None:
            now = time.perf_counter()
            pending.extend(data)
            while not reader.over and (end := pending.find(b"\n\n")) >= 0:
                event = bytes(pending[:end])
                del pending[: end + 2]
                try:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            reader.event(line[5:].strip().decode(), now)
                # A malformed event (not JSON, not UTF-8, not an object) fails the stream; raised here, in
                # the connection's callback, it would break the connection instead.
                except Exception as e:
                    reader.over = True
                    res.error = f"{type(e).__name__}: {e}"

        try:
            _take_head(res, resp.status_code, resp.headers)
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.read()).decode(errors='replace')[:300]}"
                return res
            await resp.stream(on_data)
            return reader.finish(time.perf_counter())
        except UpstreamReadError as e:
            res.error = f"{type(e).__name__}: {e}"
            return res
        finally:
            resp.close()  # back to the pool after a complete body; otherwise dropped (the replica aborts)


def make_client(base_url: str, api_key: str | None, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """No connection cap (open-loop arrivals must not queue in the client's pool); the tenant's key."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )  # fmt: skip
