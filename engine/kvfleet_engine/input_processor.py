"""Prompt -> validated ``EngineCoreRequest``: tokenize, check limits, fill in model-dependent values.

This is the one place a request is checked against the model and completed for the core: the
``max_tokens`` clamp and the stop-token set are derived here and nowhere else, in the process that
accepted the request (the API server, or ``LLM``'s). The result is everything the engine core needs;
the core trusts it (it does not validate or derive again) and builds its ``Request`` from it.

Every rejection is a ``ValueError`` with a message fit for an API client (the server maps it to 400).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.messages import EngineCoreRequest
from kvfleet_engine.sampling_params import SamplingParams
from kvfleet_engine.structured_output import backend as structured_backend

PromptType = str | dict[str, Any]


def fan_out(request_id: str, params: SamplingParams) -> dict[str, SamplingParams]:
    """An ``n``-sample request becomes n sequences (ids ``{id}-{i}``; just ``id`` when n == 1), each
    with n=1; a seeded request gives sequence i the seed ``seed + i`` (distinct but reproducible)."""
    seqs: dict[str, SamplingParams] = {}
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if params.seed is not None:
            p.seed = params.seed + i
        seqs[request_id if params.n == 1 else f"{request_id}-{i}"] = p
    return seqs


def request_stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Every token that ends a request: its ``stop_token_ids``, plus the model's EOS ids unless
    ``ignore_eos``. The scheduler stops on these and the sampler bans them below ``min_tokens``."""
    if params.ignore_eos:
        return frozenset(params.stop_token_ids)
    return frozenset(params.stop_token_ids).union(eos_token_ids)


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = config.model.eos_token_ids

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        raise ValueError(
            f"a prompt must be a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}"
        )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` unless the prompt and parameters fit this model."""
        n = len(prompt_token_ids)
        max_len = self.config.max_model_len
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= max_len:
            raise ValueError(
                f"the prompt is {n} tokens long, but the maximum context length is {max_len} tokens "
                "(prompt plus at least one generated token)"
            )
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.logprobs is not None and params.logprobs > 20:
            raise ValueError(f"logprobs must be <= 20, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > 20:
            raise ValueError(f"prompt_logprobs must be <= 20, got {params.prompt_logprobs}")
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise ValueError(f"logit_bias token ids out of vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if params.structured_outputs is not None:
            # A grammar that does not compile is the request's fault: a 400 here, not a failed request
            # in the engine core (the core compiles it again, against the vocabulary, off its step loop).
            structured_backend.validate(params.structured_outputs)

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> EngineCoreRequest:
        """Validate one sequence (``fan_out`` made ``params.n`` 1) and complete it for the core.
        ``prompt_token_ids`` is kept, not copied: callers must not mutate it afterwards."""
        self.validate(prompt_token_ids, params)
        room = self.config.max_model_len - len(prompt_token_ids)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            max_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
            stop_token_ids=request_stop_token_ids(params, self.eos_token_ids),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
