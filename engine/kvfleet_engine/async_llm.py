"""AsyncLLM: the API server's engine. Tokenize and validate here, generate in the core process.

Each sequence of a request is validated and built into its ``EngineCoreRequest`` here, once, by the
``InputProcessor``, and sent to the core as it is; the core builds its own ``Request`` from it (the
prompt's block hashes are computed there, never in this process).

``generate()`` is an async iterator of *delta* RequestOutputs (only what is new since the previous
one). Each request has a :class:`RequestOutputCollector`: the output task puts deltas into it
without ever blocking, and a slow consumer simply finds several deltas merged into one when it
next looks (so a slow client never slows the engine down). Cancelling the iterator (a client
disconnect) aborts the request in the core, which frees its KV blocks.

A step's outputs are detokenized and handed over in slices of :data:`OUTPUT_SLICE`, with the event
loop let run between slices: the handlers of the first slice write their tokens while the rest is
still to be detokenized. The scheduler lists a step's first tokens first, so a new stream's first
token waits for a slice, not for the whole batch; and a large batch never holds the loop (health
checks, new requests, writes) for the whole of its detokenization.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.core_process import PresenceOptions
from kvfleet_engine.core.messages import CoreStats, EngineCoreOutput, EngineCoreOutputs
from kvfleet_engine.core_client import EngineCoreClient, EngineDeadError
from kvfleet_engine.input_processor import InputProcessor, fan_out
from kvfleet_engine.output_processor import OutputProcessor
from kvfleet_engine.outputs import RequestOutput
from kvfleet_engine.sampling_params import SamplingParams
from kvfleet_engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Outputs detokenized between two turns of the event loop: 7-12 us each on this project's CPUs, so a
# slice is 0.2-0.4 ms. Slices of 8 put first tokens out sooner still but every other token later
# (more loop turns per step); docs/ARCHITECTURE.md has the measurements.
OUTPUT_SLICE = 32


class EngineSleepingError(RuntimeError):
    """Generation was asked of a sleeping engine (HTTP 503 with Retry-After)."""


class RequestAbortedError(RuntimeError):
    """The engine ended the request without finishing it (e.g. it was put to sleep)."""


class RequestOutputCollector:
    """One request's mailbox between the output task (producer) and its handler (consumer)."""

    __slots__ = ("_output", "_ready")

    def __init__(self) -> None:
        self._output: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._output is None or isinstance(item, BaseException):
            self._output = item
        elif isinstance(self._output, RequestOutput):
            _merge_delta(self._output, item)
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        out = self._output
        if out is None:
            return None
        self._output = None
        self._ready.clear()
        if isinstance(out, BaseException):
            raise out
        return out

    async def get(self) -> RequestOutput:
        # The fast path first: no await (no task switch) when a delta is already waiting.
        out = self.get_nowait()
        while out is None:
            await self._ready.wait()
            out = self.get_nowait()
        return out


def _merge_delta(acc: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            acc.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    acc.outputs.sort(key=lambda c: c.index)
    acc.finished = new.finished
    acc.num_cached_tokens = new.num_cached_tokens


@dataclass(slots=True)
class _Live:
    collector: RequestOutputCollector
    seq_ids: list[str]


class AsyncLLM:
    def __init__(self, config: EngineConfig, presence: PresenceOptions | None = None) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.path)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = EngineCoreClient(config, self._on_outputs, self._on_dead, presence)
        self.stats = CoreStats()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self.sleep_level = 0
        self._background: set[asyncio.Task] = set()  # fire-and-forget aborts, kept until done

    async def start(self) -> None:
        await self.client.start()

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._live)

    # ---- generation ------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs until the request finishes. Raises ValueError for an invalid
        request (before anything reaches the core), EngineSleepingError, EngineDeadError."""
        if self.client.dead:
            raise EngineDeadError(self.client.dead_reason)
        if self.sleep_level:
            raise EngineSleepingError("the engine is sleeping")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = fan_out(request_id, params)
        core_requests = [
            self.input_processor.process(seq_id, prompt_token_ids, p, priority, cache_salt)
            for seq_id, p in seqs.items()
        ]
        collector = RequestOutputCollector()
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, seqs)
        self._live[request_id] = _Live(collector, list(seqs))
        finished = False
        try:
            await self.client.add_requests(core_requests)
            while True:
                out = await collector.get()
                finished = out.finished
                if finished and any(c.finish_reason == "abort" for c in out.outputs):
                    raise RequestAbortedError("the request was aborted by the engine (it went to sleep)")
                yield out
                if finished:
                    break
        finally:
            self._live.pop(request_id, None)
            if not finished:  # cancelled (client gone), or failed: free its KV blocks in the core
                seq_ids = self.output_processor.abort_request(request_id)
                if seq_ids:
                    try:
                        await asyncio.shield(self.client.abort(seq_ids))
                    except Exception:
                        logger.debug("abort of %s not delivered", request_id, exc_info=True)

    async def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        seq_ids = self.output_processor.abort_request(request_id)
        if live is not None:
            live.collector.put(RequestAbortedError(f"request {request_id} was aborted"))
        await self.client.abort(seq_ids)

    async def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        if outs.stats is not None:
            self.stats = outs.stats
            self.sleep_level = outs.stats.sleep_level
        outputs = outs.outputs
        for start in range(0, len(outputs), OUTPUT_SLICE):
            if start:
                await asyncio.sleep(0)  # the handlers woken by the previous slice write first
            self._deliver(outputs[start : start + OUTPUT_SLICE])

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        deltas, to_stop = self.output_processor.process_outputs_delta(outputs)
        for d in deltas:
            live = self._live.get(d.request_id)
            if live is not None:
                live.collector.put(d)
        if to_stop:  # a stop string matched: the core must stop generating for these sequences
            task = asyncio.get_running_loop().create_task(self.client.abort(to_stop))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _on_dead(self, reason: str) -> None:
        err = EngineDeadError(reason)
        for live in self._live.values():
            live.collector.put(err)

    def fail_requests(self, error: Callable[[], BaseException]) -> int:
        """End every request in progress: its ``generate`` raises ``error()`` (the server's shutdown
        deadline passed), and aborts its sequences in the core. Returns how many."""
        for live in self._live.values():
            live.collector.put(error())
        return len(self._live)

    # ---- sleep / wake and friends ------------------------------------------------------------------

    async def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        await self.client.call("sleep", level)
        self.sleep_level = level

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.client.call("wake_up", tags)
        self.sleep_level = 1 if await self.client.call("is_sleeping") else 0

    async def is_sleeping(self) -> bool:
        return bool(await self.client.call("is_sleeping"))

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call("reset_prefix_cache"))

    async def set_state(self, state: str) -> None:
        await self.client.call("set_state", state)

    async def refresh_stats(self) -> CoreStats:
        await self.client.call("stats", timeout=5)
        return self.stats

    def shutdown(self) -> None:
        self.client.shutdown()
