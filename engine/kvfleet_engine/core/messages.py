"""What the API server process and the engine core process say to each other (msgpack over ZMQ).

Input socket (API server PUSH -> core PULL): one ``[kind, payload]`` pair of frames per message.
Output socket (core PUSH -> API server PULL): one ``EngineCoreOutputs`` per busy-loop iteration that
produced something (step outputs, utility results, or a stats refresh).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvfleet_engine.core.scheduler import EngineCoreOutput


class RequestKind(bytes, enum.Enum):
    ADD = b"A"  # payload: list[EngineCoreRequest] (the n sequences of one API request, added atomically)
    ABORT = b"X"  # payload: list[str] (sequence ids)
    UTILITY = b"U"  # payload: UtilityCall


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams fields (validated again in the core)
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None


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
