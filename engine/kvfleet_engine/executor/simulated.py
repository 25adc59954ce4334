"""A simulated executor: the real engine around it, a timing model instead of the forward pass.

``kvfleet engine serve --simulate`` runs the API server, scheduler, KV cache manager (prefix caching,
preemption), presence publisher and metrics unchanged; only the step's compute is replaced. The
executor keeps just enough per-request state to know which scheduled tokens are prefill and which
are decodes, sleeps for what the step would cost on the modelled device, and returns one token per
request that completes its prefill or decodes. Many such replicas share a couple of CPU cores: an
idle or sleeping one costs nothing (``time.sleep`` blocks, the core's busy loop blocks when idle).

Invariants:

- Tokens are deterministic: the token at position ``p`` of a sequence is a function of the request's
  prompt (and seed, when given) and ``p`` only. Same prompt, same output, on any replica and across
  preemption/recompute. Unseeded ``n > 1`` siblings therefore produce identical sequences.
- Tokens are never special (added) tokens, never an EOS id and never one of the request's
  ``stop_token_ids``, and each decodes on its own to non-blank printable text: a request always runs
  to ``max_tokens`` (or the context limit), which is what benchmarks want. Stop *strings* may still
  match the generated text, as they would with a real model.
- Sampling parameters other than ``seed``, ``stop_token_ids`` and ``logprobs`` are ignored.
- Logprobs are synthetic but consistent: the sampled token is always rank 1 with logprob ``-ln 2``
  and the ``j``-th top candidate has logprob ``-j ln 2`` (probabilities 1/2, 1/4, ...).
- No weights are loaded and no KV tensors exist; ``memory_report`` returns what the model's weights
  and this many KV blocks would take, so sleep/wake moves the device-memory metrics as on a GPU.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvfleet_engine.config import EngineConfig, ModelConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.engine_args import SimulationCost
from kvfleet_engine.executor.abstract import Executor

logger = logging.getLogger(__name__)

SLEEP_TAGS = frozenset({"weights", "kv_cache"})
_LN2 = math.log(2.0)
_MASK64 = (1 << 64) - 1


def step_seconds(cost: SimulationCost, prefill_tokens: int, num_decodes: int) -> float:
    """Seconds one step takes: overhead + per prefill token + (per step + per sequence) if anything decodes.

    A step that computes nothing (it only tells the workers to forget finished requests) is free,
    as it is on the real engine."""
    if prefill_tokens <= 0 and num_decodes <= 0:
        return 0.0
    ms = cost.step_overhead_ms + cost.prefill_ms_per_1k_tokens * prefill_tokens / 1000.0
    if num_decodes > 0:
        ms += cost.decode_ms_per_step + cost.decode_ms_per_seq * num_decodes
    return ms / 1000.0


@dataclass(slots=True)
class StepRecord:
    """What one simulated step computed and the seconds the timing model charged for it."""

    prefill_tokens: int
    num_decodes: int
    seconds: float


@dataclass(slots=True)
class _SimRequest:
    key: int  # hash of (prompt, seed): with the position it decides every generated token
    num_prompt_tokens: int
    num_tokens: int  # prompt + generated tokens the executor knows of
    num_computed_tokens: int
    stop_token_ids: frozenset[int]
    num_logprobs: int | None


def request_key(prompt_token_ids: list[int], seed: int | None) -> int:
    """64-bit key of a sequence: its prompt, and its seed when it has one (n > 1 siblings differ)."""
    h = xxhash.xxh3_64()
    h.update(array("i", prompt_token_ids).tobytes())
    if seed is not None:
        h.update(b"seed:%d" % seed)  # any size of int
    return h.intdigest()


def _mix(key: int, position: int) -> int:
    """splitmix64 of (key, position): a well-spread 64-bit value, stable across processes."""
    z = (key + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def token_index(key: int, position: int, pool_size: int) -> int:
    """Index into the pool of ordinary tokens of the token generated at ``position``."""
    return _mix(key, position) % pool_size


def ordinary_token_ids(model: ModelConfig) -> list[int]:
    """Ids the simulator may emit: in the model's vocabulary, not special/added, not EOS, and each
    decoding alone to non-blank printable text (so the concatenation is valid, readable UTF-8)."""
    limit = model.vocab_size
    excluded = set(model.eos_token_ids)
    path = Path(model.path) / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        excluded |= set(tok.get_added_tokens_decoder())
        limit = min(limit, tok.get_vocab_size(with_added_tokens=False))
        candidates = [i for i in range(limit) if i not in excluded]
        texts = tok.decode_batch([[i] for i in candidates], skip_special_tokens=False)
        pool = [i for i, t in zip(candidates, texts) if t.strip() and t.isprintable() and "\ufffd" not in t]
    else:
        from kvfleet_engine.tokenizer import load_tokenizer

        tok = load_tokenizer(model.path)
        excluded |= set(tok.all_special_ids) | set(tok.added_tokens_decoder)
        limit = min(limit, len(tok))
        candidates = [i for i in range(limit) if i not in excluded]
        pool = [
            i for i in candidates if (t := tok.decode([i])).strip() and t.isprintable() and "\ufffd" not in t
        ]
    if len(pool) < 32:
        raise ValueError(
            f"{model.path}: the tokenizer has only {len(pool)} ordinary printable tokens to simulate with"
        )
    return pool


def simulated_weight_bytes(config: EngineConfig) -> int:
    """Bytes the model's weights would take at the configured dtype (Llama-family shapes)."""
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    per_layer = 2 * m.hidden_size * q + 2 * m.hidden_size * kv + 3 * m.hidden_size * m.intermediate_size
    per_layer += 2 * m.hidden_size + (q + 2 * kv if m.attention_bias else 0)
    embed = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    params = embed + m.num_hidden_layers * per_layer + m.hidden_size
    return params * config.dtype.itemsize


class SimulatedExecutor(Executor):
    """The executor of a simulated replica (``EngineConfig.simulation`` set): no worker, no model.

    Mirrors the worker's contract: it learns requests from the scheduler's diffs (new requests with
    their tokens, cached ones with their pre-step ``num_computed_tokens``), forgets finished and
    preempted ones, and samples only for requests whose scheduled tokens reach the end of what they
    have (a partial prefill chunk samples nothing). ``step_log`` keeps the last steps' charged costs.
    """

    def __init__(self, config: EngineConfig, use_tqdm: bool = True) -> None:
        super().__init__(config)
        if config.simulation is None:
            raise ValueError("SimulatedExecutor needs EngineConfig.simulation")
        self.cost: SimulationCost = config.simulation
        self.pool = ordinary_token_ids(config.model)
        self.requests: dict[str, _SimRequest] = {}
        self.num_blocks = 0
        self.asleep: set[str] = set()
        self._device_free_at = 0.0  # perf_counter time the modelled device finishes its last step
        self.step_log: deque[StepRecord] = deque(maxlen=4096)
        logger.info(
            "simulated replica: %s (no weights loaded), %d ordinary tokens to emit",
            self.cost, len(self.pool),
        )  # fmt: skip

    def determine_num_kv_blocks(self) -> int:
        # EngineConfig.create always sets it when simulating: there is no device memory to measure.
        assert self.config.num_kv_blocks is not None
        return self.config.num_kv_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    # ---- one step ------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(rid, None)
        for c in sched.scheduled_cached_reqs:
            self.requests[c.req_id].num_computed_tokens = c.num_computed_tokens
        for r in sched.scheduled_new_reqs:
            sp = r.sampling_params
            self.requests[r.req_id] = _SimRequest(
                key=request_key(r.prompt_token_ids, sp.seed),
                num_prompt_tokens=len(r.prompt_token_ids),
                num_tokens=len(r.prompt_token_ids) + len(r.output_token_ids),
                num_computed_tokens=r.num_computed_tokens,
                stop_token_ids=frozenset(sp.stop_token_ids or ()),
                num_logprobs=sp.logprobs,
            )

    def _token_at(self, req: _SimRequest, position: int) -> tuple[int, int]:
        """(token id, its pool index) at ``position``: the hashed pick, moved past the request's stop ids."""
        i = token_index(req.key, position, len(self.pool))
        while self.pool[i] in req.stop_token_ids:
            i = (i + 1) % len(self.pool)
        return self.pool[i], i

    def run_step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the same output the model runner would produce (without logits), and its cost."""
        return self.finish_model(self.launch_model(sched))

    def launch_model(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        """The step's output, and when the modelled device is done with it: it starts once the step
        before it is done (async scheduling launches a step while the previous one still runs)."""
        t0 = time.perf_counter()  # the executor's own bookkeeping runs while the modelled device works
        out, seconds = self._compute(sched)
        self._device_free_at = max(t0, self._device_free_at) + seconds
        return out, self._device_free_at

    def finish_model(self, launched: tuple[ModelRunnerOutput, float]) -> ModelRunnerOutput:
        out, done_at = launched
        remaining = done_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)  # blocks: an idle simulated device costs no CPU
        return out

    def _compute(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, float]:
        if self.asleep:
            raise RuntimeError(
                f"executor is asleep ({', '.join(sorted(self.asleep))} released): wake it first"
            )
        self._update_states(sched)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        pool_index: list[int | None] = []
        prefill_tokens = num_decodes = 0
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests[rid]
            end = req.num_computed_tokens + n
            # A decode is the one token after a generated one (the scheduler's StepRates uses the same rule).
            if n == 1 and end == req.num_tokens and req.num_tokens > req.num_prompt_tokens:
                num_decodes += 1
            else:
                prefill_tokens += n
            req.num_computed_tokens = end
            req_ids.append(rid)
            if end >= req.num_tokens:
                tok, idx = self._token_at(req, req.num_tokens)
                req.num_tokens += 1
                sampled.append([tok])
                pool_index.append(idx)
            else:
                sampled.append([])  # partial prefill chunk: nothing sampled yet
                pool_index.append(None)
        out = ModelRunnerOutput(req_ids, sampled)
        self._add_logprobs(out, pool_index)
        seconds = step_seconds(self.cost, prefill_tokens, num_decodes)
        self.step_log.append(StepRecord(prefill_tokens, num_decodes, seconds))
        return out, seconds

    def _add_logprobs(self, out: ModelRunnerOutput, pool_index: list[int | None]) -> None:
        """Synthetic logprobs (see the module docstring), laid out as the sampler's: [rows, 1 + max_n],
        column 0 the sampled token, then the top-n; rank of the sampled token always 1."""
        wanted = [self.requests[rid].num_logprobs for rid in out.req_ids]
        asked = [k for k in wanted if k is not None]
        if not asked:
            return
        max_n = max(asked)
        pool = self.pool
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = [], [], []
        for tokens, idx in zip(out.sampled_token_ids, pool_index):
            if idx is None:  # nothing sampled: a placeholder row the scheduler never reads
                out.logprob_token_ids.append([0] * (1 + max_n))
                out.logprobs.append([0.0] * (1 + max_n))
                out.sampled_ranks.append(1)
                continue
            top = [pool[(idx + j) % len(pool)] for j in range(max_n)]  # top-1 is the sampled token
            out.logprob_token_ids.append([tokens[0], *top])
            out.logprobs.append([-_LN2, *(-(j + 1) * _LN2 for j in range(max_n))])
            out.sampled_ranks.append(1)

    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        out = self.run_step(sched)
        if not non_block:
            return out
        fut: Future[ModelRunnerOutput] = Future()
        fut.set_result(out)
        return fut

    # ---- sleep / wake / memory -----------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Both levels release the (simulated) weights and KV cache, as on a GPU; nothing is lost,
        since there is nothing to lose. Sleeping while asleep is a no-op."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if not self.asleep:
            self.asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        parts = set(SLEEP_TAGS) if tags is None else set(tags)
        unknown = parts - SLEEP_TAGS
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        self.asleep -= parts

    def memory_report(self) -> dict[str, int]:
        """What a GPU replica of this model would hold: weights at the dtype, ``num_blocks`` KV blocks."""
        return {
            "weights": 0 if "weights" in self.asleep else simulated_weight_bytes(self.config),
            "kv_cache": 0 if "kv_cache" in self.asleep else self.num_blocks * self.config.kv_bytes_per_block,
        }

    def shutdown(self) -> None:
        self.requests.clear()
