"""What the front end and the engine core say to each other: one request in, step outputs out.

Who builds what:

- The front end's ``InputProcessor`` builds every :class:`EngineCoreRequest`: all user-facing
  validation, the ``max_tokens`` clamp and the stop-token set happen there, once. Nothing else
  constructs one outside tests.
- The engine core turns it into its ``Request`` in one place (``EngineCore.add_request``); the
  prompt's block hashes are computed there, in the core, never in the API server process.
- The scheduler builds :class:`EngineCoreOutput` (one per request per step); the front end's
  ``OutputProcessor`` reads them. This module is all the front end needs of the core's types: it
  never imports the scheduler.

The same objects cross the process boundary as-is: ``AsyncLLM`` sends them msgpack-encoded over ZMQ
(``ENCODER`` / ``REQUESTS_DECODER`` / ``OUTPUTS_DECODER``), ``LLM`` hands them to an in-process
``EngineCore`` unencoded.

Input socket (API server PUSH -> core PULL): one ``[kind, payload]`` pair of frames per message.
Output socket (core PUSH -> API server PULL): one ``EngineCoreOutputs`` per busy-loop iteration that
produced something (step outputs, utility results, or a stats refresh).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvfleet_engine.sampling_params import SamplingParams


class RequestKind(bytes, enum.Enum):
    ADD = b"A"  # payload: list[EngineCoreRequest] (the n sequences of one API request, added atomically)
    ABORT = b"X"  # payload: list[str] (sequence ids)
    UTILITY = b"U"  # payload: UtilityCall


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence (``n > 1`` fans out before this), validated and complete: the core checks nothing
    user-facing again and derives nothing from the model's config for it.

    ``prompt_token_ids`` is the caller's list, not a copy (the n sequences of a request share it);
    nobody mutates it. ``sampling_params`` is a SamplingParams dataclass, which msgspec encodes as a
    map and rebuilds (its ``__post_init__`` runs again on decode; it is idempotent).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # min(sampling_params.max_tokens, what max_model_len leaves after the prompt).
    max_tokens: int
    # Every token that ends the request: the user's stop_token_ids, plus EOS unless ignore_eos.
    stop_token_ids: frozenset[int]
    arrival_time: float  # time.monotonic() in the process that accepted it (one clock per host)
    priority: int = 0
    cache_salt: str | None = None  # seeds the prefix-cache hash chain (tenant isolation)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one step produced for one request (new tokens since the last output).

    ``finish_reason`` is "stop", "length" or "abort" once the request is finished (else None).

    Not tracked by the garbage collector (``gc=False``: its fields never refer back to it): a step
    builds one per running request, and hundreds of tracked objects alive at once would set off a
    collection in the middle of every step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # [len(new_token_ids)] rows of (token ids, logprobs) with the sampled token first, and its rank.
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # The request's first output only, when it asked for prompt logprobs: one (token ids, logprobs, rank)
    # per prompt token after the first, the prompt token first in ids and logprobs, then the top-n.
    prompt_logprobs: list[tuple[list[int], list[float], int]] | None = None
    # "stop" because the request's structured output is complete: its last token is content, not a stop
    # token (whose text is never shown), so the front end keeps its text.
    grammar_complete: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class CoreStats(msgspec.Struct, array_like=True):
    """The core's live figures: Prometheus gauges in the API server, heartbeats in Redis."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0  # usable blocks with no request holding them (cached ones included)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # of those, served from the cache (cumulative)
    prefill_tokens_per_s: float = 0.0  # measured on recent steps
    decode_tokens_per_s: float = 0.0
    sleep_level: int = 0  # 0 = awake
    weights_bytes: int = 0  # device memory held by the workers (refreshed at start, sleep, wake)
    kv_cache_bytes: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    utility_results: list[UtilityResult] = []
    stats: CoreStats | None = None
    # Set once, just before the core exits because of an error: the API server reports it.
    fatal_error: str | None = None


ENCODER = msgspec.msgpack.Encoder()
REQUESTS_DECODER = msgspec.msgpack.Decoder(list[EngineCoreRequest])
ABORT_DECODER = msgspec.msgpack.Decoder(list[str])
UTILITY_DECODER = msgspec.msgpack.Decoder(UtilityCall)
OUTPUTS_DECODER = msgspec.msgpack.Decoder(EngineCoreOutputs)
