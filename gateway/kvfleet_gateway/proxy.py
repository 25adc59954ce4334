"""One client request, end to end: model checks, routing, the upstream call, streaming, metering.

Order of checks (each a clear OpenAI-shaped error): the tenant's key (401, done by the auth
dependency) -> the model exists (404) -> the tenant may use it (403) -> a replica can serve it
(wake a sleeping model and wait, bounded; else 503) -> admission in Redis (429 with Retry-After).

The request is forwarded as the client sent it, with three changes: ``priority`` becomes the tenant's
(engine priority: lower runs first; a client may only lower its own), ``cache_salt`` becomes the
tenant's salt (so tenants never share KV blocks or learn about each other's prompts through timing)
and, when streaming, ``stream_options.include_usage`` is switched on to meter tokens; the usage chunk
is dropped again if the client did not ask for it.

Retries: a connection refused/reset, or a 5xx from a replica before anything reached the client,
moves on to the next-ranked candidate. Once a byte of a stream was sent, a failure becomes an SSE
error event followed by ``[DONE]``: the client always sees the stream end.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from opentelemetry import trace

from kvfleet_common import redis_keys
from kvfleet_common.fleet_store.admission import (
    Admission,
    AdmitResult,
    Reservation,
    UsageRecord,
    rate_retry_after,
)
from kvfleet_common.hashing import hash_blocks
from kvfleet_common.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body
from kvfleet_common.schemas import Heartbeat, TenantRecord
from kvfleet_common.server_kit.http import ApiError, client_request_id
from kvfleet_common.server_kit.request_limits import clip, context_problem
from kvfleet_common.server_kit.tracing import inject_headers, start_request_span
from kvfleet_gateway.config import GatewayConfig
from kvfleet_gateway.fleet import FleetView
from kvfleet_gateway.load import Lease, LoadTracker, Ticket
from kvfleet_gateway.metrics import UNKNOWN_MODEL, GatewayMetrics
from kvfleet_gateway.recent_routes import RecentRoutes
from kvfleet_gateway.relay import SseRelay, unless_client_leaves
from kvfleet_gateway.routing import Candidate, Decision, choose
from kvfleet_gateway.store_calls import REDIS_ERRORS, RedisUnavailable, StoreCalls, store_unavailable_error
from kvfleet_gateway.tokenization import PromptTooLarge, TokenizerCache, bounded_prompt_token_ids
from kvfleet_gateway.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamCut,
    UpstreamReadError,
    UpstreamResponse,
    UpstreamTimeout,
)
from kvfleet_gateway.upstream_request import cache_salt, reservation_estimate, upstream_payload
from kvfleet_gateway.wake import Waker

logger = logging.getLogger("kvfleet_gateway.requests")
tracer = trace.get_tracer("kvfleet.gateway")

MAX_ATTEMPTS = 3
SLEEPING_HEADER = "x-kvfleet-replica-state"  # the engine's 503 while asleep (engine server SLEEPING_HEADERS)
DOWN_AFTER_CONNECT_ERROR_S = redis_keys.HEARTBEAT_TTL_S + 1.0
# ASGI scope key: perf_counter when the request arrived (set by the fast path, ahead of body parsing)
RECEIVED_AT = "kvfleet.received_at"
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


@dataclass(slots=True)
class Routed:
    """Everything known about one proxied request (for the response, metrics, logs and the span)."""

    request_id: str
    endpoint: str
    tenant: TenantRecord
    model: str
    started: float  # perf_counter at arrival (the fast path's entry, else the handler's)
    prompt_tokens: int | None = None
    # the model's metric label and log name: the client's string only once the fleet knows it
    model_label: str = UNKNOWN_MODEL
    block_hashes: list[bytes] = field(default_factory=list)
    decision: Decision | None = None
    replica: Candidate | None = None
    predicted_cached: int = 0
    attempts: int = 0
    status: int = 0
    first_byte_at: float | None = None
    overhead: float | None = None  # arrival -> the upstream request sent (first attempt)
    ttft: float | None = None  # arrival -> the stream's first event handed to the client
    usage: dict[str, Any] | None = None
    fallbacks: list[str] = field(default_factory=list)
    relayed_to_end: bool = False  # a stream's last event (or its error event) was handed to the client
    lease: Lease | None = None  # the admission: concurrency slot and tokens/min reservation


def _ms(seconds: float | None, digits: int) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f}ms"


class Proxy:
    def __init__(
        self,
        config: GatewayConfig,
        fleet: FleetView,
        redis_calls: StoreCalls,
        load: LoadTracker,
        tokenizers: TokenizerCache,
        waker: Waker,
        metrics: GatewayMetrics,
        client: Upstream,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.redis = redis_calls
        self.load = load
        self.tokenizers = tokenizers
        self.waker = waker
        self.metrics = metrics
        self.client = client
        self.recent = RecentRoutes(config.recent_routes_ttl_s)
        self._counter = 0

    # ---- entry point ---------------------------------------------------------------------------------

    async def handle(
        self,
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: TenantRecord,
        raw: Request,
        sent: bytes,  # the body as the client sent it (``body`` is its validation): forwarded as it is
    ) -> Response:
        r = Routed(
            request_id=client_request_id(raw) or f"gw-{uuid.uuid4().hex}",
            endpoint=endpoint, tenant=tenant, model=body.model,
            started=raw.scope.get(RECEIVED_AT) or time.perf_counter(),
        )  # fmt: skip
        # The span covers the whole proxied request: for a stream it is ended by the relay (_StreamRelay),
        # after the last event, so the stream's outcome and usage land on it. It is the gateway's server
        # span, continuing the client's trace (the HTTP instrumentation skips the proxied endpoints: a
        # second span per request, and a wrapper around every relayed event, cost ~10 % of the gateway's
        # CPU); under an HTTP server span of some other instrumentation it is that span's child.
        span = start_request_span(tracer, "kvfleet.gateway.route", raw.headers, {
            "kvfleet.tenant": tenant.name, "gen_ai.request.model": body.model[:256],  # clipped: any string
            "kvfleet.endpoint": endpoint,
            "kvfleet.request_id": r.request_id, "http.request.method": "POST", "http.route": raw.scope["path"],
        })  # fmt: skip
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self._route_and_send(r, body, sent, raw, span)
        except ApiError as e:
            r.status = e.status
            self._end_admission(r)
            self._finish(r, span)
            raise
        except BaseException:  # cancelled (the client left) or a bug: the span still ends
            self._end_admission(r)
            span.end()
            raise
        if not isinstance(response, _StreamRelay):
            self._finish(r, span)
        return response

    # ---- routing -------------------------------------------------------------------------------------

    def _check_model(self, r: Routed):
        view = self.fleet.model(r.model)
        if view is not None:  # a label only for a model the fleet knows (the metrics module's docstring)
            r.model_label = r.model
        try:
            self.fleet.check_fresh()
        except RedisUnavailable as e:
            raise store_unavailable_error(e) from None
        if view is None:  # any string a client sends: echoed clipped, counted under one label
            self.metrics.rejected.labels("unknown_model").inc()
            raise ApiError(
                404, f"the model {clip(r.model)} does not exist", param="model", code="model_not_found"
            )
        if not r.tenant.allows_model(r.model) or (
            view.policy is not None and not view.policy.allows_tenant(r.tenant.name)
        ):
            self.metrics.rejected.labels("forbidden").inc()
            raise ApiError(403, f"tenant {r.tenant.name!r} may not use the model {r.model!r}",
                           param="model", code="model_not_allowed")  # fmt: skip
        return view

    async def _awake_replicas(self, r: Routed) -> list[Heartbeat]:
        view = self._check_model(r)
        awake = [hb for hb in view.awake() if not self.fleet.is_down(hb.replica_id)]
        if awake:
            return awake
        if not self.waker.can_hold(view):  # nothing asleep to wake, no cold start to wait for
            self.metrics.rejected.labels("no_replica").inc()
            raise ApiError(503, f"no replica of {r.model!r} is available right now; retry shortly",
                           code="no_replica", headers={"Retry-After": "5"})  # fmt: skip
        await self.waker.ensure_awake(r.model)  # held (wake or cold start), bounded; a 503 on timeout
        view = self._check_model(r)
        awake = [hb for hb in view.awake() if not self.fleet.is_down(hb.replica_id)]
        if not awake:
            raise ApiError(503, f"no replica of {r.model!r} is awake; retry shortly", code="no_replica",
                           headers={"Retry-After": "5"})  # fmt: skip
        return awake

    async def _block_hashes(self, r: Routed, body, replicas: list[Heartbeat]) -> list[bytes]:
        """The prompt's block hashes, once it is known to fit the context: its text's size is checked
        before it is tokenized, its tokens (and max_tokens) before they are hashed; 400s as the engine's.
        Token ids are within [0, 2^31) already (the request model), as the hashes need."""
        revision = replicas[0].tokenizer_revision
        tok = self.tokenizers.cached(r.model, revision) or await self.tokenizers.get(r.model, revision)
        if tok is None:
            r.fallbacks.append("no_tokenizer")
            return []
        max_len = max(hb.max_model_len for hb in replicas)  # refused only if no replica could take it
        try:
            ids = await bounded_prompt_token_ids(tok, self.tokenizers.bound(r.model, revision), body, max_len)
        except PromptTooLarge as e:
            raise ApiError(400, e.message, param=e.param, code="context_length_exceeded") from None
        if ids is None:
            return []
        r.prompt_tokens = len(ids)
        problem = context_problem(len(ids), body.effective_max_tokens, body.min_tokens, max_len)
        if problem is not None:
            raise ApiError(400, problem[0], param=problem[1], code="context_length_exceeded")
        return hash_blocks(ids, replicas[0].block_size, cache_salt(r.tenant, body.cache_salt))

    async def _admit(
        self, r: Routed, body, replicas: list[Heartbeat], hashes: list[bytes]
    ) -> AdmitResult | None:
        """The one Redis round trip on the request path. Admitted: the tenant's concurrency slot is taken
        (its lease) and its token estimate reserved, in the same atomic call as the limit checks. None:
        Redis is down; admitted on this gateway's own count and routed on local facts."""
        t = r.tenant
        lease = r.lease = self.load.new_lease(t.name, shared=t.max_concurrent is not None)
        reserve = 0
        if t.tokens_per_minute:
            reserve = reservation_estimate(body, r.prompt_tokens, replicas[0].max_model_len)
        released = self.load.released_leases(t.name)
        admission = Admission(self.load.gateway_id, t, r.model, [hb.replica_id for hb in replicas], hashes,
                              lease.id if lease.shared else "", reserve, released)  # fmt: skip
        store = self.redis.store
        try:
            result = await self.redis("admit", "request", lambda: store.admit(admission))
        except REDIS_ERRORS:  # (any other exception: handle() releases the lease)
            r.fallbacks.append("redis_unavailable")
            if self.load.admit_locally(lease, t.max_concurrent):
                return None
            self.load.release_lease(lease, refund=False)  # the call may have taken the slot: removed later
            result = AdmitResult("concurrency", t.max_concurrent or 0)  # the local share of the limit holds
        else:
            self.load.removed(t.name, released)
            if result.refused is None:
                lease.admitted = True
                lease.reservation = Reservation(t.name, result.minute, reserve) if reserve else None
            else:
                self.load.release_lease(lease, refund=False, in_redis=False)  # nothing was taken
        if result.refused is not None:
            self.metrics.rejected.labels(result.refused).inc()
            what = {"concurrency": ("concurrent requests", t.max_concurrent, "1"),
                    "requests": ("requests per minute", t.requests_per_minute, None),
                    "tokens": ("tokens per minute", t.tokens_per_minute, None)}[result.refused]  # fmt: skip
            retry = what[2] or str(max(1, math.ceil(rate_retry_after(what[1], result.window, time.time()))))
            raise ApiError(429, f"rate limit reached for tenant {t.name!r}: {what[0]} limit {what[1]}",
                           code="rate_limit_exceeded", headers={"Retry-After": retry})  # fmt: skip
        return result

    def _decide(
        self, r: Routed, replicas: list[Heartbeat], admitted: AdmitResult | None, n_hashes: int
    ) -> Decision:
        view = self.fleet.model(r.model)
        policy = view.policy.routing_policy if view and view.policy else self.config.default_policy
        block_size = replicas[0].block_size
        max_hit = (r.prompt_tokens - 1) // block_size if r.prompt_tokens else 0
        now = time.monotonic()
        candidates = []
        for i, hb in enumerate(replicas):
            inflight, queued = self.load.local_replica_load(hb.replica_id)
            indexed = 0
            if admitted is not None:
                indexed = min(admitted.matched_blocks[i], max_hit)
                inflight += admitted.inflight[i]
                queued += admitted.pending_tokens[i]
            recent = min(self.recent.matched_blocks(hb.replica_id, r.block_hashes, now), max_hit)
            candidates.append(Candidate(
                hb.replica_id, hb.base_url, max(indexed, recent) * block_size, indexed * block_size, inflight,
                queued, hb.running, hb.waiting, hb.kv_usage, hb.prefill_tokens_per_s, hb.decode_tokens_per_s,
            ))  # fmt: skip
        self._counter += 1
        return choose(policy, candidates, r.prompt_tokens or 0, self._counter)

    async def _route_and_send(self, r: Routed, body, sent: bytes, raw: Request, span) -> Response:
        replicas = await self._awake_replicas(r)
        hashes = r.block_hashes = await self._block_hashes(r, body, replicas)
        admitted = await self._admit(r, body, replicas, hashes)
        r.decision = self._decide(r, replicas, admitted, len(hashes))
        for reason in r.fallbacks:
            self.metrics.fallbacks.labels(r.model, reason).inc()
        chosen = r.decision.chosen
        r.predicted_cached = chosen.matched_tokens
        self.metrics.decisions.labels(
            r.model, r.decision.policy, str(chosen.matched_tokens > 0).lower()
        ).inc()
        self.metrics.predicted_cached.labels(r.model).inc(chosen.matched_tokens)
        if span.is_recording():  # not sampled: no decision explained into a JSON nobody keeps
            span.set_attributes({
                "kvfleet.policy": r.decision.policy, "kvfleet.replica": chosen.replica_id,
                "kvfleet.prompt_tokens": r.prompt_tokens or 0,
                "kvfleet.predicted_cached_tokens": chosen.matched_tokens,
                "kvfleet.candidates": json.dumps(r.decision.explain(), separators=(",", ":")),
                "kvfleet.fallbacks": ",".join(r.fallbacks),
            })  # fmt: skip
        payload = upstream_payload(sent, body, r.tenant)
        ticket = self.load.start(
            chosen.replica_id, r.tenant.name, max(0, (r.prompt_tokens or 0) - chosen.matched_tokens), r.model
        )
        self.metrics.inflight.labels(r.model).inc()
        try:
            if body.stream:  # the replica answers at once (its head goes before the first token)
                upstream = await self._send(r, payload, raw, span)
                if upstream.status_code == 200:
                    r.status = 200
                    return _StreamRelay(self, r, upstream, ticket, span, self._response_headers(r, raw, upstream),
                                        keep_usage=body.include_usage)  # fmt: skip
                answer = await self._read_answer(r, upstream)
            else:  # answered whole, when done: if the client leaves first, the replica's request is aborted
                answer = await unless_client_leaves(raw.receive, self._send_and_read(r, payload, raw, span))
        except BaseException:
            self._release(r, ticket, None)
            raise
        if answer is None:
            r.status = 499
            self._release(r, ticket, None, accepted=r.attempts > 0)  # sent: the reservation stands
            return Response(status_code=499)
        upstream, content = answer
        headers = self._response_headers(r, raw, upstream)
        r.status = upstream.status_code
        if upstream.status_code == 200:
            try:
                r.usage = json.loads(content).get("usage")
            except ValueError:
                r.usage = None
        self._release(r, ticket, self._usage_record(r), accepted=upstream.status_code == 200)
        return Response(content, status_code=upstream.status_code, headers=headers,
                        media_type=upstream.headers.get("content-type", "application/json"))  # fmt: skip

    # ---- upstream ------------------------------------------------------------------------------------

    async def _send(
        self, r: Routed, payload: bytes, raw: Request, span, may_wake: bool = True
    ) -> UpstreamResponse:
        """Send to the best candidate; if no connection to it could be made, or it answered a 5xx, try the
        next. A request written to a replica that gave no answer is not sent again (``_failed_after_send``).

        Replicas that answer "sleeping" (put to sleep since the snapshot) are marked so; if that left no
        candidate, the model is woken (as for a request that found it asleep) and routed once more."""
        assert r.decision is not None
        headers = {"content-type": "application/json", "x-request-id": r.request_id}
        inject_headers(headers)
        last_error = "no candidate"
        asleep = 0
        if may_wake:  # once per request (not again after a wake)
            r.overhead = time.perf_counter() - r.started
            self.metrics.overhead.labels(r.model).observe(r.overhead)
        for cand in r.decision.ranked[:MAX_ATTEMPTS]:
            if r.attempts and self.fleet.is_down(cand.replica_id):
                continue
            r.attempts += 1
            r.replica = cand
            url = f"{cand.base_url.rstrip('/')}{'/v1/chat/completions' if r.endpoint == 'chat' else '/v1/completions'}"
            # remembered before the await: requests of the same group arriving meanwhile follow this one
            self.recent.record(cand.replica_id, r.block_hashes, time.monotonic())
            try:
                resp = await self.client.post(url, payload, headers)
            except UpstreamConnectError as e:
                if e.refused:  # nothing listens there: avoid it until its heartbeat would have expired
                    self.fleet.mark_down(cand.replica_id, DOWN_AFTER_CONNECT_ERROR_S)
                    self.recent.forget(cand.replica_id)
                else:
                    self.recent.forget(cand.replica_id, r.block_hashes)
                self.metrics.upstream_errors.labels(r.model, "connect").inc()
                self.metrics.fallbacks.labels(r.model, "retry_connect").inc()
                last_error = f"{cand.replica_id}: {e}"
                logger.warning("replica %s unreachable (%s); trying the next candidate", cand.replica_id, e)
                continue
            except UpstreamReadError as e:  # sent: the replica may be running it, so it goes nowhere else
                raise self._failed_after_send(r, e) from None
            if resp.status_code == 503 and resp.headers.get(SLEEPING_HEADER) == "sleeping":
                resp.close(abort=True)
                self.fleet.mark_sleeping(r.model, cand.replica_id)
                self.recent.forget(cand.replica_id)  # a sleeping engine dropped its KV cache
                self.metrics.fallbacks.labels(r.model, "replica_asleep").inc()
                asleep += 1
                last_error = f"{cand.replica_id}: asleep"
                continue
            if resp.status_code >= 500 and r.attempts < MAX_ATTEMPTS and cand is not r.decision.ranked[-1]:
                resp.close(abort=True)
                self.recent.forget(cand.replica_id, r.block_hashes)
                self.metrics.upstream_errors.labels(r.model, "status").inc()
                self.metrics.fallbacks.labels(r.model, "retry_status").inc()
                last_error = f"{cand.replica_id}: HTTP {resp.status_code}"
                continue
            r.first_byte_at = time.perf_counter() - r.started  # time to the upstream's response head
            span.set_attributes({"kvfleet.replica": cand.replica_id, "kvfleet.attempts": r.attempts})
            return resp
        if asleep and may_wake:
            r.decision = self._decide(r, await self._awake_replicas(r), None, len(r.block_hashes))
            return await self._send(r, payload, raw, span, may_wake=False)
        raise ApiError(503, f"no replica of {r.model!r} could take the request ({last_error}); retry shortly",
                       code="upstream_unavailable", headers={"Retry-After": "2"})  # fmt: skip

    async def _send_and_read(
        self, r: Routed, payload: bytes, raw: Request, span
    ) -> tuple[UpstreamResponse, bytes]:
        return await self._read_answer(r, await self._send(r, payload, raw, span))

    async def _read_answer(self, r: Routed, upstream: UpstreamResponse) -> tuple[UpstreamResponse, bytes]:
        """The whole body of a replica's answer (the connection is dropped unless it was read to the end)."""
        try:
            return upstream, await upstream.read()
        except UpstreamReadError as e:
            raise self._failed_after_send(r, e) from None
        finally:
            upstream.close()

    def _failed_after_send(self, r: Routed, e: UpstreamReadError) -> ApiError:
        """The client's error when the request reached a replica and no (whole) answer came back. It is not
        sent anywhere else: the replica may have run it, or still be running it (its connection is dropped,
        so its engine aborts it if it still can)."""
        if isinstance(e, UpstreamCut):
            return ApiError(503, "the gateway is shutting down; retry", code="gateway_shutdown",
                            headers={"Retry-After": "1"})  # fmt: skip
        replica = r.replica.replica_id if r.replica is not None else "?"
        self.metrics.upstream_errors.labels(r.model, "midstream").inc()
        logger.warning("replica %s had request %s: no answer (%s); not re-sent", replica, r.request_id, e)
        if isinstance(e, UpstreamTimeout):
            return ApiError(504, f"the replica {replica} did not answer in time ({e}); the request was not sent to "
                            "another replica, since it may have run", code="upstream_timeout")  # fmt: skip
        if r.replica is not None:
            self.fleet.mark_down(r.replica.replica_id, DOWN_AFTER_CONNECT_ERROR_S)
        return ApiError(502, f"the replica {replica} failed while it had the request ({e}); it was not sent to "
                        "another replica, since it may have run", code="upstream_failed")  # fmt: skip

    def _first_event(self, r: Routed, ticket: Ticket) -> None:
        self.load.prefilled(ticket)
        r.ttft = time.perf_counter() - r.started
        self.metrics.ttft.labels(r.model).observe(r.ttft)

    def _stream_failed(self, r: Routed, error: BaseException | None) -> bytes:
        """The replica broke off mid-stream: mark it down; the SSE error event and end the client gets. Or
        the gateway cut the stream (shutting down): only the event and the end."""
        r.status = 503
        if isinstance(error, UpstreamCut):
            err = error_body(503, f"the gateway is shutting down and ended this stream ({error}); retry",
                             code="gateway_shutdown")  # fmt: skip
            return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        self.metrics.upstream_errors.labels(r.model, "midstream").inc()
        logger.warning("replica %s failed mid-stream (%s)", r.replica.replica_id if r.replica else "?", error)
        if r.replica is not None:
            self.fleet.mark_down(r.replica.replica_id, DOWN_AFTER_CONNECT_ERROR_S)
        err = error_body(503, f"the replica serving this stream failed: {error}", code="upstream_failed")
        return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"

    def _stream_closed(self, r: Routed, upstream: UpstreamResponse, ticket: Ticket, span) -> None:
        if not r.relayed_to_end and r.status == 200:
            r.status = 499  # the client left before the stream ended (or before it started)
        upstream.close()  # drops the connection unless the body was read to the end: aborts the engine's request
        self._release(r, ticket, self._usage_record(r), accepted=True)
        self._finish(r, span)

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _release(self, r: Routed, ticket: Ticket, usage: UsageRecord | None, accepted: bool = False) -> None:
        """The request is over: its load and its admission are released (once, whatever the path) and its
        tokens settled: real usage is charged; the reservation is handed back, except when a replica
        ``accepted`` the request (a 200, or sent when its client left) and its usage never came (a stream
        cut short): then the reservation stands as the charge, so leaving early costs no less than finishing."""
        if not ticket.released:
            self.metrics.inflight.labels(r.model).dec()
        self.load.release(ticket, usage)
        if r.lease is not None:
            self.load.release_lease(r.lease, refund=usage is not None or not accepted)

    def _end_admission(self, r: Routed) -> None:
        """Release the admission of a request that ended before (or without) its load ticket; a no-op if
        ``_release`` did already."""
        if r.lease is not None:
            self.load.release_lease(r.lease, refund=True)

    def _debug_allowed(self, raw: Request) -> bool:
        """``x-kvfleet-debug: <admin token>``: the routing decision shows the fleet's load (operators only)."""
        token, sent = self.config.admin_token, raw.headers.get("x-kvfleet-debug")
        return bool(token and sent) and hmac.compare_digest(sent.encode(), token.encode())

    def _response_headers(self, r: Routed, raw: Request, upstream: UpstreamResponse) -> dict[str, str]:
        headers = {"x-request-id": r.request_id}
        if r.replica is not None:
            headers["x-kvfleet-replica"] = r.replica.replica_id
        if r.decision is not None and self._debug_allowed(raw):
            headers["x-kvfleet-route"] = json.dumps(
                {"policy": r.decision.policy, "prompt_tokens": r.prompt_tokens, "attempts": r.attempts,
                 "fallbacks": r.fallbacks, "candidates": r.decision.explain()},
                separators=(",", ":"),
            )  # fmt: skip
        for k in ("retry-after",):
            if k in upstream.headers:
                headers[k] = upstream.headers[k]
        return headers

    def _usage_record(self, r: Routed) -> UsageRecord | None:
        u = r.usage
        if not u:
            return None
        cached = int(((u.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
        prompt, completion = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
        m = self.metrics
        m.tenant_tokens.labels(r.tenant.name, r.model, "prompt").inc(prompt)
        m.tenant_tokens.labels(r.tenant.name, r.model, "completion").inc(completion)
        m.tenant_tokens.labels(r.tenant.name, r.model, "cached").inc(cached)
        m.actual_cached.labels(r.model).inc(cached)
        if r.prompt_tokens is not None and prompt == r.prompt_tokens:  # one prompt, one sequence: comparable
            m.prediction_error.labels(r.model).observe(abs(r.predicted_cached - cached))
        return UsageRecord(r.tenant.name, r.model, prompt, completion, cached)

    def _finish(self, r: Routed, span) -> None:
        """The request is over: its metrics, its log line, the end of its span."""
        duration = time.perf_counter() - r.started
        self.metrics.requests.labels(r.model_label, r.tenant.name, r.endpoint, str(r.status)).inc()
        self.metrics.duration.labels(r.model_label, r.endpoint).observe(duration)
        u = r.usage or {}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        span.set_attribute("http.response.status_code", r.status)
        if u:
            span.set_attributes({"gen_ai.usage.input_tokens": u.get("prompt_tokens") or 0,
                                 "gen_ai.usage.output_tokens": u.get("completion_tokens") or 0,
                                 "kvfleet.cached_tokens": cached or 0})  # fmt: skip
        span.end()
        logger.info(
            "%s tenant=%s model=%s %s status=%d replica=%s policy=%s prompt=%s cached(pred/actual)=%d/%s "
            "completion=%s attempts=%d overhead=%s ttft=%s %.1fms%s",
            r.request_id, r.tenant.name, r.model if r.model_label == r.model else clip(r.model),
            r.endpoint, r.status,
            r.replica.replica_id if r.replica else "-", r.decision.policy if r.decision else "-",
            u.get("prompt_tokens", r.prompt_tokens), r.predicted_cached, cached, u.get("completion_tokens"),
            r.attempts, _ms(r.overhead, 2), _ms(r.ttft, 1), duration * 1000,
            f" fallbacks={','.join(r.fallbacks)}" if r.fallbacks else "",
        )  # fmt: skip


class _StreamRelay(Response):
    """The SSE response of a proxied stream (relayed by ``SseRelay``). ``Proxy._stream_closed`` runs
    exactly once when the response is over, however it ended (last event sent, client gone, replica
    failed, cancelled), and after the relay stopped reading the replica."""

    def __init__(
        self, proxy: Proxy, r: Routed, upstream: UpstreamResponse, ticket: Ticket, span, headers: dict[str, str],
        keep_usage: bool,
    ) -> None:  # fmt: skip
        # no super().__init__: that renders a body and sets content-length; the body here is a stream
        self.status_code = 200
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers(headers)
        self._args = (proxy, r, upstream, ticket, span, keep_usage)

    async def __call__(self, scope, receive, send) -> None:
        proxy, r, upstream, ticket, span, keep_usage = self._args
        relay = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            relay = SseRelay(upstream, send, keep_usage, lambda: proxy._first_event(r, ticket))
            outcome = await relay.run(receive)
            if outcome == "client_gone":
                r.relayed_to_end = relay.ended_stream  # left after [DONE]: a complete request, not a 499
                return
            if relay.ended_response:  # with the body's last events (the usual end)
                r.relayed_to_end = True
                return
            last = relay.tail if outcome == "complete" else proxy._stream_failed(r, relay.error)
            await send({"type": "http.response.body", "body": last, "more_body": False})
            r.relayed_to_end = True
        finally:
            if relay is not None:
                relay.stop()
                r.usage = relay.usage  # metered however the stream ended, once the usage event came
            proxy._stream_closed(r, upstream, ticket, span)


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, code=code), status_code=status)
