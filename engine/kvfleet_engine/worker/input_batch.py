"""The persistent batch: per-request state in fixed numpy arrays, updated incrementally.

Rows are the requests scheduled this step. Between steps only the diff is applied: new requests
are written into free rows, finished/unscheduled ones are removed (leaving holes), and
``condense()`` moves the last rows into the holes so rows ``[0, num_reqs)`` are dense. Nothing is
rebuilt from scratch each step: a decode step touches one token per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvfleet_engine.layers.sampler import SamplingMetadata, make_generator
from kvfleet_engine.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What a worker remembers about a running request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    min_tokens_stop_ids: frozenset[int] = frozenset()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, vocab_size: int, device
    ):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.num_reqs = 0  # rows in use (including holes until condense)
        self._holes: list[int] = []

        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)  # the row's request has its own generator
        self.has_logit_bias = np.zeros(max_num_reqs, dtype=bool)
        # prompt logprobs asked (top-n; -1: none): the model runner computes them for the prompt positions
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)

    # ---- diff application ---------------------------------------------------------------------

    def add_request(self, state: CachedRequestState) -> int:
        i = self._holes.pop() if self._holes else self.num_reqs
        if i == self.num_reqs:
            self.num_reqs += 1
        if i >= self.max_num_reqs:
            raise RuntimeError("input batch is full")
        self.req_ids[i] = state.req_id
        self.req_id_to_index[state.req_id] = i
        self.states[i] = state
        p, o = len(state.prompt_token_ids), len(state.output_token_ids)
        if p + o > self.max_model_len:
            raise ValueError(
                f"request {state.req_id} has {p + o} tokens > max_model_len {self.max_model_len}"
            )
        self.token_ids[i, :p] = state.prompt_token_ids
        self.token_ids[i, p : p + o] = state.output_token_ids
        self.num_tokens[i], self.num_prompt_tokens[i] = p + o, p
        self.num_computed_tokens[i] = state.num_computed_tokens
        self.num_blocks[i] = 0
        self.append_block_ids(i, state.block_ids, record=False)

        sp = state.sampling_params
        self.temperature[i] = sp.temperature
        self.top_p[i], self.top_k[i], self.min_p[i] = sp.top_p, sp.top_k, sp.min_p
        self.frequency_penalty[i] = sp.frequency_penalty
        self.presence_penalty[i] = sp.presence_penalty
        self.repetition_penalty[i] = sp.repetition_penalty
        self.has_penalty[i] = sp.has_penalties
        self.num_logprobs[i] = -1 if sp.logprobs is None else sp.logprobs
        self.min_tokens[i] = sp.min_tokens
        self.seeded[i] = state.generator is not None
        self.has_logit_bias[i] = bool(sp.logit_bias)
        self.num_prompt_logprobs[i] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        return i

    def append_block_ids(self, i: int, block_ids: list[int], record: bool = True) -> None:
        if not block_ids:
            return
        n = self.num_blocks[i]
        self.block_table[i, n : n + len(block_ids)] = block_ids
        self.num_blocks[i] = n + len(block_ids)
        if record:
            self.states[i].block_ids.extend(block_ids)

    def remove_request(self, req_id: str) -> CachedRequestState | None:
        i = self.req_id_to_index.pop(req_id, None)
        if i is None:
            return None
        state = self.states[i]
        self.req_ids[i] = None
        self.states[i] = None
        self._holes.append(i)
        return state

    def condense(self) -> None:
        """Fill holes with the last rows so that rows [0, num_reqs) are all live."""
        holes = sorted(self._holes)
        self._holes = []
        live_end = self.num_reqs
        for hole in holes:
            while live_end > 0 and self.req_ids[live_end - 1] is None:
                live_end -= 1
            if hole >= live_end:
                break
            self._move(live_end - 1, hole)
            live_end -= 1
        while live_end > 0 and self.req_ids[live_end - 1] is None:
            live_end -= 1
        self.num_reqs = live_end

    def _move(self, src: int, dst: int) -> None:
        rid = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = rid, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[rid] = dst
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        for arr in (
            self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.num_blocks,
            self.temperature, self.top_p, self.top_k, self.min_p, self.frequency_penalty,
            self.presence_penalty, self.repetition_penalty, self.num_logprobs, self.has_penalty, self.min_tokens,
            self.seeded, self.has_logit_bias, self.num_prompt_logprobs,
        ):  # fmt: skip
            arr[dst] = arr[src]

    def append_token(self, i: int, token_id: int) -> None:
        n = self.num_tokens[i]
        self.token_ids[i, n] = token_id
        self.num_tokens[i] = n + 1
        self.states[i].output_token_ids.append(token_id)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """``append_token`` for many rows at once (each row at most once)."""
        ends = self.num_tokens[rows]
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1
        states = self.states
        for i, tok in zip(rows.tolist(), token_ids.tolist()):
            states[i].output_token_ids.append(tok)

    # ---- sampling metadata --------------------------------------------------------------------

    def sampling_metadata(self, default_generator: torch.Generator | None) -> SamplingMetadata:
        n = self.num_reqs
        dev = self.device
        temp = self.temperature[:n]
        greedy = temp == 0.0
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())

        def opt(arr: np.ndarray, used: np.ndarray) -> torch.Tensor | None:
            return torch.from_numpy(arr[:n].copy()).to(dev) if used.any() else None

        random_rows = ~greedy
        top_p = opt(self.top_p, random_rows & (self.top_p[:n] < 1.0))
        top_k = opt(self.top_k, random_rows & (self.top_k[:n] > 0))
        min_p = opt(self.min_p, random_rows & (self.min_p[:n] > 0.0))
        # Per-row Python only for the rows that need it: seeded rows, rows below their min_tokens, and
        # (for penalties and min_tokens) the output lists. A plain batch builds no per-row objects.
        generators = {i: self.states[i].generator for i in np.flatnonzero(self.seeded[:n]).tolist()}
        min_tokens = {}
        for i in np.flatnonzero(
            self.min_tokens[:n] > self.num_tokens[:n] - self.num_prompt_tokens[:n]
        ).tolist():
            min_tokens[i] = (int(self.min_tokens[i]), self.states[i].min_tokens_stop_ids)
        no_penalties = not bool(self.has_penalty[:n].any())
        output_lists = []
        if min_tokens or not no_penalties:
            output_lists = [self.states[i].output_token_ids for i in range(n)]
        max_lp = int(self.num_logprobs[:n].max()) if n else -1
        prompt_ids = None
        if not no_penalties:
            width = int(self.num_prompt_tokens[:n].max())
            cols = np.arange(width)
            ids = np.where(
                cols[None, :] < self.num_prompt_tokens[:n, None], self.token_ids[:n, :width], self.vocab_size
            )
            prompt_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
        logit_bias = None
        biased = np.flatnonzero(self.has_logit_bias[:n]).tolist()
        if biased:
            rows: list[int] = []
            cols: list[int] = []
            biases: list[float] = []
            for i in biased:
                bias = self.states[i].sampling_params.logit_bias
                rows.extend([i] * len(bias))
                cols.extend(bias)
                biases.extend(bias.values())
            logit_bias = (rows, cols, biases)
        return SamplingMetadata(
            temperature=torch.from_numpy(temp.copy()).to(dev),
            all_greedy=all_greedy,
            all_random=all_random,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            generators=generators,
            max_num_logprobs=max_lp if max_lp >= 0 else None,
            no_penalties=no_penalties,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_lists,
            frequency_penalties=None
            if no_penalties
            else torch.from_numpy(self.frequency_penalty[:n].copy()).to(dev),
            presence_penalties=None
            if no_penalties
            else torch.from_numpy(self.presence_penalty[:n].copy()).to(dev),
            repetition_penalties=None
            if no_penalties
            else torch.from_numpy(self.repetition_penalty[:n].copy()).to(dev),
            min_tokens=min_tokens,
            default_generator=default_generator,
            logit_bias=logit_bias,
        )


def new_request_state(
    req_id: str,
    prompt_token_ids: list[int],
    output_token_ids: list[int],
    sampling_params: SamplingParams,
    block_ids: list[int],
    num_computed_tokens: int,
    stop_token_ids: frozenset[int],
    device,
) -> CachedRequestState:
    sp = sampling_params
    gen = make_generator(sp.seed, device) if sp.seed is not None and sp.temperature > 0 else None
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        output_token_ids=list(output_token_ids),
        sampling_params=sp,
        block_ids=list(block_ids),
        num_computed_tokens=num_computed_tokens,
        generator=gen,
        min_tokens_stop_ids=stop_token_ids,
    )
