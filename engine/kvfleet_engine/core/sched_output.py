"""What the scheduler hands the workers each step: a diff, not the whole batch.

Workers keep per-request state between steps (token ids, block table, sampling state). Each step
they learn only which requests are new (full data), which running ones got more blocks, which
finished or were preempted, and how many tokens each scheduled request runs now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvfleet_engine.sampling_params import SamplingParams

# ``CachedRequestData.new_block_ids`` of the (usual) running request that needs no new block this step:
# one shared immutable empty sequence, not a new list per request and step.
NO_NEW_BLOCKS: tuple[int, ...] = ()


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption (recompute replays them as part of the prefill).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: frozenset[int]  # the request's (EOS included unless ignore_eos): banned below min_tokens
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, gc=False):
    """A running request scheduled again: the blocks it got since last step (often none:
    ``NO_NEW_BLOCKS``; readers must not mutate it) and its ``num_computed_tokens`` before this step.

    One is built per running request per step, so it is a compact struct the garbage collector does
    not track (its fields hold no references back to it): hundreds of tracked objects alive at once
    would set off a collection in the middle of every step."""

    req_id: str
    new_block_ids: Sequence[int]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the workers must forget before this step (finished, aborted or preempted since last step).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: row i of ``grammar_bitmask`` ([k, ceil(vocab / 32)] int32, bit t set = token t
    # allowed) constrains the token request ``structured_req_ids[i]`` samples this step. Only requests
    # that sample this step have a row; None when none of them is constrained.
    structured_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """Per scheduled request (in ``req_ids`` order): the sampled token, or none for a partial prefill."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Only when some request asked for logprobs: [num_reqs, 1 + max_n] arrays (column 0 = sampled).
    logprob_token_ids: list[list[int]] | None = None
    logprobs: list[list[float]] | None = None
    sampled_ranks: list[int] | None = None
    # Only when a scheduled request asked for prompt logprobs: request id -> (index of the first prompt
    # token covered, per token (ids, logprobs, rank) with the prompt token first); see worker/prompt_logprobs.py.
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int]]]] | None = None
