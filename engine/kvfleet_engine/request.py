"""The engine core's view of one request (one sequence: ``n > 1`` fans out before it gets here).

A ``Request`` exists only in the engine core: ``EngineCore.add_request`` builds it from the
front end's :class:`~kvfleet_engine.core.messages.EngineCoreRequest`, which is already validated and
carries the clamped ``max_tokens`` and the stop-token set. Building it hashes the prompt's full
blocks, so that cost is paid once, in the core process.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvfleet_common.hashing import BlockHash, hash_block, hash_blocks, root_hash
from kvfleet_engine.core.messages import EngineCoreRequest

if TYPE_CHECKING:
    from kvfleet_engine.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # structured outputs: its grammar is still compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > _LAST_UNFINISHED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_LAST_UNFINISHED = RequestStatus.PREEMPTED  # a module constant: enum attribute lookups are slow
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token state, scheduling state and prefix-cache hashes of one sequence.

    ``num_computed_tokens`` is the one number the scheduler reasons with: tokens
    ``[0, num_computed_tokens)`` have KV in the cache; everything after still has to run through the
    model. A prefix-cache hit, a prefill chunk and a decode step all just advance it.
    """

    def __init__(self, request: EngineCoreRequest, block_size: int) -> None:
        self.request_id = request.request_id
        self.prompt_token_ids = prompt_token_ids = request.prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = request.sampling_params
        self.max_tokens = request.max_tokens
        self.stop_token_ids = request.stop_token_ids
        self.arrival_time = request.arrival_time
        self.priority = request.priority
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        # Prompt logprobs collected so far (entry j: prompt token j + 1), when asked for; they leave with
        # the request's first output. Each token's entry is kept once, whatever recomputes it.
        self.prompt_logprobs: list | None = None if request.sampling_params.prompt_logprobs is None else []
        self.num_preemptions = 0
        # Structured outputs: the request's grammar (set by the scheduler on admission).
        self.grammar: RequestGrammar | None = None

        self.block_size = block_size
        self._hash_root = root_hash(request.cache_salt or b"")
        self.block_hashes: list[BlockHash] = hash_blocks(prompt_token_ids, block_size, parent=self._hash_root)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        """Called once per generated token of every running request: kept lean (no property calls)."""
        self.output_token_ids.append(token_id)
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        # Keep full-block hashes current: the next block is hashed the moment it fills up.
        hashes, block_size = self.block_hashes, self.block_size
        n = len(hashes)
        if len(all_ids) >= (n + 1) * block_size:
            parent = hashes[-1] if n else self._hash_root
            start = n * block_size
            hashes.append(hash_block(parent, all_ids[start : start + block_size]))

    @property
    def needs_prompt_hidden_states(self) -> bool:
        """Prompt logprobs still missing: the prompt must run through the model, not come from the
        prefix cache (a cache hit has KV but no hidden states to score)."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, first_token: int, entries: list) -> None:
        """Keep a step's prompt-logprob entries (``entries[0]`` is for prompt token ``first_token``),
        skipping tokens already kept (a recompute after preemption scores them again)."""
        pl = self.prompt_logprobs
        if pl is None:
            return
        skip = len(pl) + 1 - first_token
        if skip < 0:
            raise AssertionError(
                f"{self.request_id}: prompt logprobs skip from token {len(pl) + 1} to {first_token}"
            )
        pl.extend(entries[skip:])

    def is_finished(self) -> bool:
        return self.status > _LAST_UNFINISHED

    def __lt__(self, other: Request) -> bool:
        # Priority policy: lower value first, then earlier arrival (heap order).
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
