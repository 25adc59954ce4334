"""OpenAI completions and chat completions on top of AsyncLLM (streaming and not).

One HTTP request may hold several prompts (completions with a list of prompts) and several
samples per prompt (``n``): choice ``i`` of prompt ``p`` is choice ``p * n + i`` of the response.
All prompts are validated before any reaches the engine, so a bad one leaves nothing behind.

The event loop serves every client, so the work a request can put on it is bounded: every prompt's size
is checked against what the context can hold before anything is tokenized, long texts are tokenized in a
worker thread, and ``max_tokens`` must fit the context with the prompt (``kvfleet_common.server_kit.request_limits``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvfleet_common.chat_rendering import ChatTemplateError, render_chat_prompt
from kvfleet_common.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatPrompt,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
    error_body,
)
from kvfleet_common.server_kit.http import ApiError, client_request_id
from kvfleet_common.server_kit.request_limits import TextBound, clip, context_problem, encode_off_loop
from kvfleet_common.server_kit.tracing import start_request_span
from kvfleet_engine.async_llm import AsyncLLM, EngineSleepingError, RequestAbortedError
from kvfleet_engine.core_client import EngineDeadError
from kvfleet_engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvfleet_engine.sampling_params import SamplingParams
from kvfleet_engine.server import completion_logprobs as echo_lp
from kvfleet_engine.server.chat_output import ChatShaper
from kvfleet_engine.server.chat_structure import output_constraint, plan_chat_output
from kvfleet_engine.server.metrics import EngineMetrics
from kvfleet_engine.structured_output import backend as structured_backend
from kvfleet_engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger("kvfleet_engine.server")
tracer = trace.get_tracer("kvfleet.engine")

RETRY_AFTER_S = "5"
# a 503 from a sleeping replica says so in a header, so a gateway can wake the model instead of failing
SLEEPING_HEADERS = {"Retry-After": RETRY_AFTER_S, "x-kvfleet-replica-state": "sleeping"}


@dataclass(slots=True)
class PreparedPrompt:
    text: str | None
    token_ids: list[int]
    prompt_logprobs: list | None = None  # from the engine's first output, when the request asked


@dataclass(slots=True)
class RequestRecord:
    """Timing and token counts of one HTTP request: metrics, span attributes and the log line.

    ``request_id`` is the id the client sees (the response's ``id``, ``X-Request-Id``, the log line, the
    span): the client's own ``X-Request-Id`` when it sent a usable one (``client_request_id``). ``engine_id``
    names the request inside the engine, where ids must be unique: a client's id gets a random suffix there,
    since two live requests may carry the same one (two tenants behind a gateway, a client reusing its ids)
    and neither may fail or abort the other."""

    request_id: str
    endpoint: str
    engine_id: str
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def on_delta(self, metrics: EngineMetrics, num_new_tokens: int) -> None:
        now = time.perf_counter()
        if num_new_tokens:
            if self.first_token is None:
                self.first_token = now
                metrics.ttft.labels(metrics.model_name).observe(now - self.arrival)
            elif self.last_token is not None:
                metrics.itl.labels(metrics.model_name).observe(now - self.last_token)
            self.last_token = now
            self.completion_tokens += num_new_tokens


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: EngineMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.max_model_len
        self.text_bound = TextBound.of(self.tokenizer)

    # ---- checks ----------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                404, f"the model {clip(name)} does not exist (this server serves {self.model_name!r})",
                param="model", code="model_not_found",
            )  # fmt: skip

    def check_available(self) -> None:
        if self.engine.dead_reason is not None:
            raise ApiError(503, f"the engine is not available: {self.engine.dead_reason}", code="engine_dead")
        if self.engine.sleep_level:
            raise ApiError(
                503, "the model is sleeping; wake it up or retry later", code="model_sleeping",
                headers=SLEEPING_HEADERS,
            )  # fmt: skip

    def check_alive_for_admin(self) -> None:
        if self.engine.dead_reason is not None:
            raise ApiError(503, f"the engine is not available: {self.engine.dead_reason}", code="engine_dead")

    def _params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        kwargs: dict,
        structured: StructuredOutputsParams | None,
    ) -> SamplingParams:
        try:
            params = SamplingParams(**kwargs, structured_outputs=structured)
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_request") from None
        if structured is not None:
            try:  # before the prompt is rendered and tokenized: a bad grammar costs nothing more
                structured_backend.validate(structured)
            except structured_backend.GrammarError as e:
                raise ApiError(
                    400, str(e), param=_constraint_source(req), code="invalid_structured_output"
                ) from None
        return params

    def _validate_prompt(self, prompt: PreparedPrompt, params: SamplingParams) -> None:
        n = len(prompt.token_ids)
        problem = context_problem(n, params.max_tokens, params.min_tokens, self.max_model_len) if n else None
        if problem is not None:
            raise ApiError(400, problem[0], param=problem[1], code="context_length_exceeded")
        try:
            self.engine.input_processor.validate(prompt.token_ids, params)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt", code="invalid_prompt") from None

    def check_size(self, texts: list[str], param: str) -> None:
        """400 for text that cannot fit the context whatever it tokenizes to (before tokenizing it)."""
        problem = self.text_bound.problem(texts, self.max_model_len)
        if problem is not None:
            raise ApiError(400, problem, param=param, code="context_length_exceeded")

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids; long texts are tokenized in a worker thread (the loop serves others)."""
        self.check_size([text], "prompt")
        return await encode_off_loop(self.tokenizer, text, add_special_tokens)

    def render_chat(self, req: ChatPrompt) -> str:
        """The chat prompt's text, as a gateway renders it to route the request; size-bounded before and
        after rendering (a template can multiply its inputs)."""
        self.check_size(req.template_texts(), "messages")
        try:
            text = render_chat_prompt(self.tokenizer, req)
        except ChatTemplateError as e:
            raise ApiError(400, e.message, param=e.param) from None
        self.check_size([text], "messages")
        return text

    # ---- completions -------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        self.check_available()
        kwargs = echo_lp.engine_kwargs(req, req.sampling_kwargs(req.max_tokens, req.logprobs))
        params = self._params(req, kwargs, output_constraint(req))
        for p in req.prompts():  # every one, before any is tokenized
            if isinstance(p, str):
                self.check_size([p], "prompt")
        prompts = []
        for p in req.prompts():
            if isinstance(p, str):
                prompts.append(PreparedPrompt(p, await self.tokenize_text(p)))
            else:
                prompts.append(PreparedPrompt(None, list(p)))
        for p in prompts:
            self._validate_prompt(p, params)
        rec = _record(raw, "completions", "cmpl")
        rec.prompt_tokens = sum(len(p.token_ids) for p in prompts)
        if req.stream:
            return self._stream(rec, raw, prompts, params, req, self._completion_chunks)
        return await self._complete(rec, raw, prompts, params, req, self._completion_response)

    # ---- chat --------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        self.check_available()
        plan = plan_chat_output(req)
        kwargs = req.sampling_kwargs(req.effective_max_tokens, req.num_logprobs)
        params = self._params(req, kwargs, plan.constraint)
        text = self.render_chat(req)
        prompt = PreparedPrompt(text, await self.tokenize_text(text, add_special_tokens=False))
        self._validate_prompt(prompt, params)
        rec = _record(raw, "chat", "chatcmpl")
        rec.prompt_tokens = len(prompt.token_ids)
        shaper = ChatShaper(plan, self.model_name, req.top_logprobs or 0)
        if req.stream:
            return self._stream(rec, raw, [prompt], params, req, shaper.chunks)
        build = functools.partial(self._chat_response, shaper)
        return await self._complete(rec, raw, [prompt], params, req, build)

    # ---- the shared machinery ----------------------------------------------------------------------

    async def _merged(
        self, rec: RequestRecord, prompts: list[PreparedPrompt], params: SamplingParams, req
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of every prompt's generation, interleaved as they come: (prompt index, delta)."""
        gens = [
            self.engine.generate(
                p.token_ids, params, prompt=p.text,
                request_id=rec.engine_id if len(prompts) == 1 else f"{rec.engine_id}-p{i}",
                priority=req.priority, cache_salt=req.cache_salt,
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        if len(gens) == 1:
            async for out in gens[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, gen) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            except BaseException as e:
                await queue.put((i, e))
                raise
            finally:
                await queue.put((i, done))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _start_span(self, rec: RequestRecord, raw: Request):
        # FastAPI's built-in telemetry may already run an HTTP server span for this request: then ours is
        # its child; otherwise ours is the server span, continuing the caller's trace.
        span = start_request_span(
            tracer, f"engine {rec.endpoint}", raw.headers,
            {"kvfleet.request_id": rec.request_id, "gen_ai.request.model": self.model_name},
        )  # fmt: skip
        span.add_event("queued")
        return span

    def _finish(self, rec: RequestRecord, span, status: int, reasons: list[str | None]) -> None:
        m, name = self.metrics, self.model_name
        m.requests.labels(name, rec.endpoint, str(status)).inc()
        if status == 200:
            m.prompt_tokens.labels(name).inc(rec.prompt_tokens)
            m.cached_prompt_tokens.labels(name).inc(rec.cached_tokens)
            m.e2e.labels(name).observe(time.perf_counter() - rec.arrival)
            for r in reasons:
                m.finish_reasons.labels(name, r or "unknown").inc()
        m.generation_tokens.labels(name).inc(rec.completion_tokens)
        span.set_attribute("gen_ai.usage.input_tokens", rec.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", rec.completion_tokens)
        span.set_attribute("kvfleet.cached_tokens", rec.cached_tokens)
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.add_event("finished")
        span.end()
        # a tenth of a millisecond: the gateway-overhead bench subtracts these from what its clients saw
        ttft = f"{(rec.first_token - rec.arrival) * 1e3:.1f}ms" if rec.first_token else "-"
        logger.info(
            "%s %s model=%s status=%d prompt=%d cached=%d completion=%d ttft=%s e2e=%.1fms",
            rec.endpoint, rec.request_id, name, status, rec.prompt_tokens, rec.cached_tokens,
            rec.completion_tokens, ttft, (time.perf_counter() - rec.arrival) * 1e3,
        )  # fmt: skip

    def _observe(self, rec: RequestRecord, span, prompt_idx: int, out: RequestOutput, cached: dict) -> None:
        new = sum(len(c.token_ids) for c in out.outputs)
        first = rec.first_token is None and new > 0
        rec.on_delta(self.metrics, new)
        if first:
            span.add_event("first_token")
        cached[prompt_idx] = out.num_cached_tokens
        rec.cached_tokens = sum(cached.values())

    @staticmethod
    def _error_for(exc: BaseException) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, EngineSleepingError | RequestAbortedError):
            return ApiError(503, str(exc), code="model_sleeping", headers=SLEEPING_HEADERS)
        if isinstance(exc, EngineDeadError):
            return ApiError(503, f"the engine is not available: {exc}", code="engine_dead")
        if isinstance(exc, ValueError):
            return ApiError(400, str(exc), code="invalid_request")
        logger.error("generation failed", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}")

    async def _complete(self, rec, raw: Request, prompts, params, req, build) -> JSONResponse:
        span = self._start_span(rec, raw)
        n = params.n
        choices: dict[int, CompletionOutput] = {}
        cached: dict[int, int] = {}

        async def run() -> None:
            async for i, out in self._merged(rec, prompts, params, req):
                self._observe(rec, span, i, out, cached)
                if out.prompt_logprobs is not None:
                    prompts[i].prompt_logprobs = out.prompt_logprobs
                for c in out.outputs:
                    idx = i * n + c.index
                    acc = choices.get(idx)
                    if acc is None:
                        choices[idx] = CompletionOutput(
                            idx, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason,
                        )  # fmt: skip
                    else:
                        acc.text += c.text
                        acc.token_ids.extend(c.token_ids)
                        if c.logprobs:
                            acc.logprobs.extend(c.logprobs)
                        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(_wait_disconnect(raw))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():  # the client left: cancelling aborts every sequence in the core
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                self._finish(rec, span, 499, [])
                return JSONResponse(error_body(400, "client disconnected"), status_code=499)
            task.result()
        except Exception as e:
            err = self._error_for(e)
            self._finish(rec, span, err.status, [])
            return err.response()
        finally:
            watcher.cancel()
        usage = self._usage(rec)
        body = build(rec, prompts, req, [choices[k] for k in sorted(choices)], usage)
        self._finish(rec, span, 200, [c.finish_reason for c in choices.values()])
        return JSONResponse(body, headers={"X-Request-Id": rec.request_id})

    def _usage(self, rec: RequestRecord) -> Usage:
        return Usage(
            prompt_tokens=rec.prompt_tokens,
            completion_tokens=rec.completion_tokens,
            total_tokens=rec.prompt_tokens + rec.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=rec.cached_tokens),
        )

    def _stream(self, rec, raw: Request, prompts, params, req, chunker) -> StreamingResponse:
        span = self._start_span(rec, raw)
        include_usage = req.include_usage
        created = int(time.time())

        async def body() -> AsyncIterator[bytes]:
            """One part (one write, one TCP segment) per engine delta: a delta's events go together (the
            role event with the first token), and the last delta's with the usage and ``[DONE]``. A part
            per event cost a syscall each, here and in every proxy the stream passes."""
            status = 200
            reasons: list[str | None] = []
            cached: dict[int, int] = {}
            state: dict = {}
            unfinished = len(prompts)
            last = b""  # the events of the delta that finished the request, sent with the stream's end
            try:
                async for i, out in self._merged(rec, prompts, params, req):
                    self._observe(rec, span, i, out, cached)
                    reasons += [c.finish_reason for c in out.outputs if c.finish_reason is not None]
                    events = b"".join(map(_sse, chunker(rec, created, prompts, req, params.n, i, out, state)))
                    if out.finished:
                        unfinished -= 1
                    if unfinished > 0:
                        if events:
                            yield events
                    else:
                        last += events
                if include_usage:
                    last += _sse(self._usage_chunk(rec, created, req))
                yield last + b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                status = 499  # client disconnected: the generator's cleanup aborted the request
                raise
            except Exception as e:
                err = self._error_for(e)
                status = err.status
                yield last + _sse(err.body()) + b"data: [DONE]\n\n"
            finally:
                self._finish(rec, span, status, reasons)

        return StreamingResponse(
            body(), media_type="text/event-stream",
            headers={"X-Request-Id": rec.request_id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )  # fmt: skip

    def _usage_chunk(self, rec: RequestRecord, created: int, req) -> dict:
        obj = "chat.completion.chunk" if isinstance(req, ChatCompletionRequest) else "text_completion"
        return {
            "id": rec.request_id, "object": obj, "created": created, "model": self.model_name,
            "choices": [], "usage": self._usage(rec).model_dump(),
        }  # fmt: skip

    # ---- response shapes ---------------------------------------------------------------------------

    def _completion_logprobs(self, c: CompletionOutput, text_start: int) -> CompletionLogprobs | None:
        if c.logprobs is None:
            return None
        lp = CompletionLogprobs()
        offset = text_start
        for pos, tid in zip(c.logprobs, c.token_ids):
            sampled = pos.get(tid) or next(iter(pos.values()))
            token = sampled.decoded_token or ""
            lp.tokens.append(token)
            lp.token_logprobs.append(echo_lp.finite_logprob(sampled.logprob))
            lp.top_logprobs.append(_top_dict(pos))
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    def _completion_response(self, rec, prompts, req: CompletionRequest, outs, usage) -> dict:
        n = req.n
        choices = []
        for c in outs:
            prompt = prompts[c.index // n]
            prefix = self._prompt_text(prompt) if req.echo else ""
            logprobs = self._completion_logprobs(c, len(prefix))
            if req.echo and req.logprobs is not None:
                logprobs = echo_lp.echoed(prompt, req.logprobs, self.engine.output_processor, logprobs)
            choices.append(
                CompletionChoice(
                    index=c.index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, prompt_logprobs=echo_lp.asked_prompt_logprobs(req, prompt),
                )
            )  # fmt: skip
        return CompletionResponse(
            id=rec.request_id, model=self.model_name, choices=choices, usage=usage
        ).model_dump()

    def _prompt_text(self, prompt: PreparedPrompt) -> str:
        if prompt.text is None:
            prompt.text = self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def _completion_chunks(self, rec, created, prompts, req: CompletionRequest, n, i, out, state):
        for c in out.outputs:
            idx = i * n + c.index
            text = c.text
            echoed = req.echo and idx not in state
            if echoed:
                text = self._prompt_text(prompts[i]) + text
            offset = state.get(idx, 0)
            state[idx] = offset + len(text)
            if not text and c.finish_reason is None and not c.token_ids:
                continue
            gen_offset = offset + len(text) - len(c.text)  # the generated text starts after the echo
            lp = self._completion_logprobs(c, gen_offset) if c.logprobs is not None else None
            if echoed and req.logprobs is not None:  # the prompt's part arrives with the first chunk
                prompts[i].prompt_logprobs = out.prompt_logprobs
                lp = echo_lp.echoed(prompts[i], req.logprobs, self.engine.output_processor, lp)
            yield {
                "id": rec.request_id, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": [{
                    "index": idx, "text": text, "logprobs": lp.model_dump() if lp else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                }],
            }  # fmt: skip

    def _chat_response(self, shaper: ChatShaper, rec, prompts, req, outs, usage) -> dict:
        return ChatCompletionResponse(
            id=rec.request_id, model=self.model_name, choices=shaper.choices(outs), usage=usage,
            prompt_logprobs=echo_lp.prompt_logprobs_json(prompts[0].prompt_logprobs),
        ).model_dump()  # fmt: skip


def _record(raw: Request, endpoint: str, id_prefix: str) -> RequestRecord:
    client_id = client_request_id(raw)
    if client_id is None:
        own = f"{id_prefix}-{uuid.uuid4().hex}"
        return RequestRecord(own, endpoint, own)
    return RequestRecord(client_id, endpoint, f"{client_id}~{uuid.uuid4().hex[:12]}")


def _top_dict(pos: dict[int, Logprob]) -> dict[str, float]:
    out: dict[str, float] = {}
    for lp in sorted(pos.values(), key=lambda lp: lp.rank or 0):
        out.setdefault(lp.decoded_token or "", echo_lp.finite_logprob(lp.logprob))
    return out


def _constraint_source(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field an output constraint came from (the ``param`` of its 400)."""
    if req.structured_outputs is not None:
        return "structured_outputs"
    if req.response_format_constrains:
        return "response_format"
    return "tools"


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _wait_disconnect(raw: Request) -> None:
    while not await raw.is_disconnected():
        await asyncio.sleep(0.5)
