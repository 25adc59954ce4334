"""Continuous-batching scheduler: one token-budget rule for prefill, chunked prefill and decode.

Each step hands out at most ``max_num_batched_tokens`` tokens to at most ``max_num_seqs`` requests:
running requests first (in order), then waiting ones (FCFS, or by priority). A request is given
``min(num_tokens - num_computed_tokens, remaining budget)`` tokens, so a long prompt is simply
prefilled over several steps (chunked prefill) and a decoding request gets its one token; a
prefix-cache hit just starts ``num_computed_tokens`` further along.

When the KV cache runs out of blocks the lowest-priority running request is preempted: its blocks
are freed and it goes back to the front of the waiting queue to be recomputed later (recompute is
cheap with prefix caching, since its freed blocks usually remain in the cache).

Structured outputs: a constrained request waits in ``waiting_for_grammar`` (outside the queue) until
its grammar has compiled on the manager's thread; each step's output carries the allowed-token
bitmask of every constrained request that samples in it, and every accepted token advances that
request's matcher. A request whose grammar is complete finishes ("stop") without waiting for EOS.
"""

from __future__ import annotations

import concurrent.futures
import heapq
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet_engine.core.kv_cache_manager import KVCacheManager
from kvfleet_engine.core.messages import EngineCoreOutput
from kvfleet_engine.core.sched_output import (
    NO_NEW_BLOCKS,
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.structured_output.manager import StructuredOutputManager


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) when the policy is ``priority``."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, request)

    def add_front(self, request: Request) -> None:
        """A preempted request goes back first (it was admitted before anything now waiting)."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            heapq.heappush(self._heap, request)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)

    def remove(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if self.policy == "fcfs":
            self._fifo = deque(r for r in self._fifo if id(r) not in gone)
        else:
            self._heap = [r for r in self._heap if id(r) not in gone]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo if self.policy == "fcfs" else self._heap)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        policy: str = "fcfs",
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        # Requests the workers still hold state for and must drop at the next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Pipeline parallelism: requests whose step is still in flight are neither scheduled again
        # nor preempted until its output is back; each step takes about 1/depth of the running ones
        # so that `depth` steps can be in the pipeline at once. Depth 1: step by step (no effect).
        self.in_flight: set[str] = set()
        self.pipeline_depth = 1
        # Async scheduling (one step in flight, ``EngineCore``): a decoding request in the step in flight is
        # scheduled again for the token that step is sampling (``sampling_in_flight``), unless its next step
        # needs that token on the host first (``_can_run_ahead``).
        self.async_scheduling = False
        self.sampling_in_flight: set[str] = set()
        self.structured_outputs = structured_outputs
        self.waiting_for_grammar: list[Request] = []
        self.num_constrained = 0  # unfinished requests with a grammar (0: skip every bitmask step)
        # Outputs made outside a model step (a grammar that failed to compile): the next step returns them.
        self.deferred_outputs: list[EngineCoreOutput] = []

    # ---- admission and abort -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        self.requests[request.request_id] = request
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured_outputs is None:
                raise ValueError("this engine does not support structured outputs")
            request.grammar = self.structured_outputs.grammar_for(constraint)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
            self.num_constrained += 1
        else:
            self.waiting.add(request)
        # Under load a request can wait long enough for other requests' blocks to evict the prefix the
        # router sent it here for; keep that prefix at the protected end of the eviction order.
        self.kv.keep_warm(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or stop, e.g. on a stop string found by the detokenizer) requests; frees their blocks."""
        assert RequestStatus.is_finished(status)
        finished = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            finished.append(req)
        waiting = [r for r in finished if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]
        if waiting:
            self.waiting.remove(waiting)
        compiling = [r for r in finished if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if compiling:
            self.waiting_for_grammar = [r for r in self.waiting_for_grammar if r not in compiling]
            waiting += compiling
        if len(finished) > len(waiting):
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        for req in finished:
            req.status = status
            self._free(req)
        return finished

    def _free(self, request: Request) -> None:
        if request.grammar is not None:
            self.num_constrained -= 1
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_grammar)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_grammar)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """One step's batch. Runs once per step over every running request, so the loop over them
        is kept lean: a decode that fits in the blocks its request holds costs a few attribute reads,
        one ``allocate_slots`` fast path and one ``CachedRequestData``. ``num_computed_tokens``
        advances as each request is scheduled (``CachedRequestData`` carries the value from before)."""
        if self.waiting_for_grammar:
            self._admit_compiled()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_ids: set[str] = set()
        running, in_flight, kv = self.running, self.in_flight, self.kv
        max_model_len = self.max_model_len

        # 1. Running requests, in order; preempt from the back when blocks run out.
        i = 0
        share = len(running)
        if self.pipeline_depth > 1:
            share = -(-len(running) // self.pipeline_depth)
        while i < len(running) and budget > 0 and len(num_scheduled) < share:
            req = running[i]
            ahead = 0  # the token the step in flight samples for req, not on the host yet
            if in_flight and req.request_id in in_flight:
                if not self.async_scheduling or not self._can_run_ahead(req):
                    i += 1
                    continue
                ahead = 1 if req.request_id in self.sampling_in_flight else 0
            computed = req.num_computed_tokens
            n = len(req.all_token_ids) + ahead - computed
            if n > budget:
                n = budget
            if computed + n > max_model_len:  # never feed a position at or past max_model_len
                n = max_model_len - computed
            if n <= 0:
                i += 1
                continue
            while (new_blocks := kv.allocate_slots(req, n)) is None:
                victim_index = self._pick_victim_index()
                if victim_index is None:  # every other candidate is in flight: wait for its step
                    break
                victim = running.pop(victim_index)
                # Priority policy may pick one already scheduled this step: undo its schedule (its
                # blocks past the tokens computed before this step must be freed as never written).
                undone = num_scheduled.pop(victim.request_id, 0)
                victim.num_computed_tokens -= undone
                self._preempt(victim)
                preempted_ids.add(victim.request_id)
                if victim is req:
                    break
                if victim_index < i:
                    budget += undone
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    i -= 1
            if new_blocks is None:
                break  # req itself was preempted (or must wait): nothing after it can fit either
            cached_reqs.append(
                CachedRequestData(
                    req.request_id,
                    [b.block_id for b in new_blocks] if new_blocks else NO_NEW_BLOCKS,
                    computed,
                )
            )
            req.num_computed_tokens = computed + n
            num_scheduled[req.request_id] = n
            budget -= n
            i += 1

        # 2. Waiting requests, unless this step already had to preempt (no room for new work).
        while not preempted_ids and len(self.waiting) and budget > 0 and len(running) < self.max_num_seqs:
            req = self.waiting.peek()
            hit_blocks, num_hit = kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            new_blocks = kv.allocate_slots(req, n, hit_blocks, num_hit)
            if new_blocks is None:
                break
            self.waiting.pop()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                kv.record_hit(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            running.append(req)
            new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    stop_token_ids=req.stop_token_ids,
                    block_ids=kv.get_block_ids(req.request_id),
                    num_computed_tokens=num_hit,
                )
            )
            req.num_computed_tokens = num_hit + n
            num_scheduled[req.request_id] = n
            budget -= n

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_ids,
        )
        if self.num_constrained:
            self._add_grammar_bitmask(out)
        self.finished_req_ids = set()
        return out

    # ---- structured outputs --------------------------------------------------------------------

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; end those whose grammar failed. With nothing
        else to run, wait a moment for the oldest compile instead of spinning the busy loop."""
        pending = self.waiting_for_grammar
        if not self.running and not len(self.waiting) and not pending[0].grammar.ready():
            concurrent.futures.wait([pending[0].grammar.future], timeout=0.01)
        still = []
        for req in pending:
            if not req.grammar.ready():
                still.append(req)
            elif req.grammar.resolve():
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
            else:
                req.status = RequestStatus.FINISHED_ABORTED
                req.stop_reason = req.grammar.error
                self._free(req)
                self.deferred_outputs.append(
                    EngineCoreOutput(req.request_id, [], finish_reason="abort", stop_reason=req.grammar.error)
                )
        self.waiting_for_grammar = still

    def _add_grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The allowed tokens of each constrained request that samples this step (its last prompt
        token, or its last generated one, is in the step)."""
        requests = self.requests
        sampling = [
            req
            for rid in out.num_scheduled_tokens
            if (req := requests[rid]).grammar is not None
            and req.num_computed_tokens >= len(req.all_token_ids)
        ]
        if sampling:
            out.structured_req_ids = [req.request_id for req in sampling]
            out.grammar_bitmask = self.structured_outputs.fill_bitmask([req.grammar for req in sampling])

    def _advance_grammar(self, req: Request, tokens: list[int]) -> bool:
        """Feed a step's accepted tokens to the request's matcher; True if that ends the request."""
        grammar = req.grammar
        if not grammar.accept(tokens):
            # The sampler only picks allowed tokens, so this is a bug or a library fault: end the request
            # rather than let it run on unconstrained.
            req.status = RequestStatus.FINISHED_ABORTED
            req.stop_reason = f"structured output violated: {grammar.violation()}"
            return True
        if grammar.is_terminated():
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        return False

    def take_deferred_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.deferred_outputs = self.deferred_outputs, []
        return outputs

    def _can_run_ahead(self, req: Request) -> bool:
        """Whether req may be scheduled again before the step in flight for it is back.

        Its next step must not depend on the host seeing the pending token: no grammar (the mask follows
        the token), no penalties and no unmet min_tokens (the sampler reads the host's output lists), and
        the pending token must not be its last (max_tokens, max_model_len), or the step would be wasted.
        """
        if req.request_id not in self.sampling_in_flight:
            return req.grammar is None  # a prefill chunk in flight: the next chunk's tokens are known
        sp = req.sampling_params
        num_output = len(req.output_token_ids)
        return (
            req.grammar is None
            and not sp.has_penalties
            and num_output >= sp.min_tokens
            and num_output + 1 < req.max_tokens
            and len(req.all_token_ids) + 1 < self.max_model_len
        )

    def mark_in_flight(self, sched: SchedulerOutput) -> None:
        """Async scheduling: ``sched`` was launched; its requests are in flight until its output is applied."""
        requests = self.requests
        self.in_flight = set(sched.num_scheduled_tokens)
        # (A request the previous step finished may still be in this one: it is gone from ``requests``.)
        self.sampling_in_flight = {
            rid
            for rid in self.in_flight
            if (req := requests.get(rid)) is not None and req.num_computed_tokens >= len(req.all_token_ids)
        }

    def _pick_victim_index(self) -> int | None:
        """FCFS: the last admitted. Priority: the lowest priority, latest arrival. Never one in flight
        (None when every running request is)."""
        candidates = [j for j in range(len(self.running)) if self.running[j].request_id not in self.in_flight]
        if not candidates:
            return None
        if self.policy == "priority":
            return max(candidates, key=lambda j: (self.running[j].priority, self.running[j].arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)

    def update_from_output(
        self, sched: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        The outputs come in the order their streams should be written: first tokens, then the outputs
        that finish a request, then the rest (each group in batch order). A step's outputs reach the
        clients one write at a time, from the API server and again from every proxy on the way, and at
        100 streams that burst takes milliseconds to get through each of them. In batch order a new
        request's first token came last (new requests join the batch at its end), so it waited for the
        whole burst, in every process, on its time to first token; a finishing request was early only when
        it was among the oldest. A mid-stream token's place in the burst hardly matters: a stream keeps
        about the same place step after step, so its tokens stay a step apart.

        A request in ``self.requests`` is never finished (finishing frees it), so it finishes here
        exactly when a stop condition hits; finished ones leave ``running`` together after the loop.
        """
        firsts: list[EngineCoreOutput] = []
        finished: list[EngineCoreOutput] = []
        outputs: list[EngineCoreOutput] = []
        done: list[Request] = []
        requests, check_stop = self.requests, self._check_stop
        logprobs = runner_out.logprobs
        if runner_out.prompt_logprobs:  # kept on the request until its first output carries them
            for rid, (first_token, entries) in runner_out.prompt_logprobs.items():
                req = requests.get(rid)
                if req is not None:
                    req.add_prompt_logprobs(first_token, entries)
        for idx, (rid, tokens) in enumerate(zip(runner_out.req_ids, runner_out.sampled_token_ids)):
            req = requests.get(rid)
            if req is None or not tokens:
                continue  # aborted meanwhile, or a partial prefill chunk (nothing sampled)
            new_logprobs = None
            if logprobs is not None and req.sampling_params.logprobs is not None:
                k = 1 + req.sampling_params.logprobs
                new_logprobs = [
                    (runner_out.logprob_token_ids[idx][:k], logprobs[idx][:k], runner_out.sampled_ranks[idx])
                ]
            first = not req.output_token_ids
            stopped = False
            for tok in tokens:
                req.append_output_token(tok)
                if check_stop(req, tok):
                    stopped = True
                    break
            if not stopped and req.grammar is not None:
                stopped = self._advance_grammar(req, tokens)
            num_cached = req.num_cached_tokens
            out = EngineCoreOutput(
                request_id=rid,
                new_token_ids=tokens,
                new_logprobs=new_logprobs,
                num_cached_tokens=num_cached if num_cached > 0 else 0,
            )
            if first and req.prompt_logprobs is not None:
                out.prompt_logprobs = req.prompt_logprobs
            if stopped:
                out.finish_reason = RequestStatus.finish_reason(req.status)
                out.stop_reason = req.stop_reason
                if req.grammar is not None and req.status == RequestStatus.FINISHED_STOPPED:
                    out.grammar_complete = req.grammar.is_terminated()
                self._free(req)
                done.append(req)
            (firsts if first else finished if stopped else outputs).append(out)
        if done:
            self._remove_running(done)
        self.kv.block_pool.flush_events()
        if self.deferred_outputs:
            finished = self.take_deferred_outputs() + finished
        return firsts + finished + outputs

    def _remove_running(self, done: list[Request]) -> None:
        if len(done) == 1:
            self.running.remove(done[0])
        else:  # one pass, not one list.remove per request
            gone = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in gone]

    def _check_stop(self, req: Request, token: int) -> bool:
        # Length first, as vLLM does: EOS as the last allowed token still reports "length".
        num_output = len(req.output_token_ids)
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if token in req.stop_token_ids and num_output >= req.sampling_params.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            # EOS ends a request without a stop_reason (as in vLLM); a user stop id is reported.
            if token in req.sampling_params.stop_token_ids:
                req.stop_reason = token
            return True
        return False

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self.num_preemptions,
            prefix_cache_hit_rate=self.kv.stats.hit_rate,
        )
