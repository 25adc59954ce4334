"""EngineCore: scheduler + executor. ``step() = schedule -> execute_model -> update_from_output``.

Requests come in as the front end's ``EngineCoreRequest`` (already validated, see
``core/messages.py``), in process (``LLM``) or decoded off the input socket (``core_process``);
:meth:`EngineCore.add_request` is the one place they become the scheduler's ``Request``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.block_pool import KVEventSink
from kvfleet_engine.core.kv_cache_manager import KVCacheManager
from kvfleet_engine.core.messages import EngineCoreOutput, EngineCoreRequest
from kvfleet_engine.core.sched_output import SchedulerOutput
from kvfleet_engine.core.scheduler import Scheduler
from kvfleet_engine.executor.selection import executor_for
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.structured_output.backend import GrammarCompiler
from kvfleet_engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepRates:
    """Measured prefill and decode throughput (tokens/s), exponentially averaged over recent steps.

    A step mixes prefill chunks and decodes; its time is split between them in proportion to
    their token counts, so a step's prefill rate is its total tokens / time. Decode throughput is
    the decoding requests / step time (each gets one token per step). The gateway divides uncached
    prompt tokens by ``prefill_tokens_per_s`` to predict time-to-first-token, so this must track the
    real engine, not a configured guess.
    """

    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    alpha: float = 0.2

    def record(self, sched: SchedulerOutput, requests: Mapping, seconds: float) -> None:
        if seconds <= 0 or sched.total_num_scheduled_tokens == 0:
            return
        decode = 0
        get = requests.get
        for rid, n in sched.num_scheduled_tokens.items():
            if n == 1:
                req = get(rid)
                if req is not None and req.num_output_tokens > 0:
                    decode += 1
        prefill = sched.total_num_scheduled_tokens - decode
        total = prefill + decode
        if prefill:
            self.prefill_tokens_per_s = self._ema(self.prefill_tokens_per_s, total / seconds)
        if decode:
            # Aggregate decode throughput: one token per decoding request per step.
            self.decode_tokens_per_s = self._ema(self.decode_tokens_per_s, decode / seconds)

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)


class EngineCore:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True, on_kv_event: KVEventSink | None = None):
        self.config = config
        self.executor = executor_for(config, use_tqdm=use_tqdm)
        num_blocks = self.executor.determine_num_kv_blocks()
        # One request at max_model_len must fit alone, or it could be preempted forever.
        capacity = (num_blocks - 1) * config.block_size
        if capacity < config.max_model_len:
            self.executor.shutdown()
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks - 1} usable blocks of {config.block_size}), "
                f"less than max_model_len={config.max_model_len}: give more KV memory/blocks or a smaller max_model_len"
            )
        self.executor.initialize_kv_cache(num_blocks)
        self.num_kv_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            num_blocks, config.block_size, num_blocks * config.kv_bytes_per_block / 2**20,
        )  # fmt: skip
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, on_kv_event)
        self.rates = StepRates()
        self.sleep_level = 0  # 0 awake; else the level it went to sleep with, until fully awake
        self._asleep_parts: set[str] = set()
        self.structured_outputs = StructuredOutputManager(
            GrammarCompiler(
                str(config.model.path), config.model.vocab_size, sorted(config.model.eos_token_ids)
            )
        )
        self.scheduler = Scheduler(
            kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.scheduling_policy,
            self.structured_outputs,
        )
        # Pipeline parallelism: steps submitted to the workers whose outputs are not applied yet.
        self._batch_queue: deque[tuple[SchedulerOutput, Future, float]] = deque()
        self.scheduler.pipeline_depth = self.executor.max_concurrent_batches
        # Async scheduling: the step launched on the device and not yet applied (sched, launched, t0).
        self.scheduler.async_scheduling = config.async_scheduling
        self._launched: tuple[SchedulerOutput, object, float] | None = None
        self._last_applied = 0.0
        self.overlapped_steps = 0  # steps launched while the one before was still in flight
        if config.async_scheduling:
            logger.info("async scheduling: each step is scheduled while the one before it runs")

    def add_request(self, request: EngineCoreRequest) -> None:
        """Admit a validated request (the prompt's block hashes are computed here)."""
        self.scheduler.add_request(Request(request, self.config.block_size))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish requests the frontend stopped (e.g. a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self) -> bool:
        """Unfinished requests, or finished ones the workers have not been told to forget yet."""
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self.scheduler.finished_req_ids)
            or bool(self._batch_queue)
            or bool(self.scheduler.deferred_outputs)
            or self._launched is not None
        )

    def step(self) -> list[EngineCoreOutput]:
        if self.config.async_scheduling:
            return self._step_async()
        if self.scheduler.pipeline_depth > 1:
            return self._step_with_batch_queue()
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids and not sched.preempted_req_ids:
            return self.scheduler.take_deferred_outputs()
        t0 = time.perf_counter()
        runner_out = self.executor.execute_model(sched)
        self.rates.record(sched, self.scheduler.requests, time.perf_counter() - t0)
        return self.scheduler.update_from_output(sched, runner_out)

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Keep up to ``pipeline_depth`` steps in flight so every pipeline stage has work.

        While the queue has room and something can be scheduled, submit a new step and return []
        (the caller steps again). Otherwise wait for the oldest step and apply its output. Requests
        in a step in flight are not scheduled again until its output is applied.
        """
        queue, scheduler = self._batch_queue, self.scheduler
        if len(queue) < scheduler.pipeline_depth:
            sched = scheduler.schedule()
            if not (sched.is_empty and not sched.finished_req_ids and not sched.preempted_req_ids):
                future = self.executor.execute_model(sched, non_block=True)
                queue.append((sched, future, time.perf_counter()))
                scheduler.in_flight.update(sched.num_scheduled_tokens)
                if not sched.is_empty and len(queue) < scheduler.pipeline_depth:
                    return []
        if not queue:
            return scheduler.take_deferred_outputs()
        sched, future, t0 = queue.popleft()
        try:
            runner_out = future.result()
        finally:
            scheduler.in_flight.difference_update(sched.num_scheduled_tokens)
        self.rates.record(sched, scheduler.requests, time.perf_counter() - t0)
        return scheduler.update_from_output(sched, runner_out)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch step n+1, then apply step n while the device runs n+1.

        The host's own work for a step (scheduling, input preparation, applying outputs) otherwise leaves
        the device idle: at 256 running requests on an H100 about 1.1 of a 3.1 ms decode step. Step n+1 is
        scheduled before step n's tokens are on the host: a request decoding in step n is scheduled for
        the token n samples, which the worker feeds from the device (``ModelRunner.launch``), unless its
        next step needs that token on the host (``Scheduler._can_run_ahead``). A request that step n
        finishes may still be in step n+1: that token is dropped (its KV went to the request's freed
        blocks in stream order, before any later step could reuse them).
        """
        scheduler = self.scheduler
        sched = scheduler.schedule()
        launched = None
        if not (sched.is_empty and not sched.finished_req_ids and not sched.preempted_req_ids):
            launched = (sched, self.executor.launch_model(sched), time.perf_counter())
            self.overlapped_steps += self._launched is not None
        outputs = self._apply_launched()
        if launched is not None:
            self._launched = launched
            scheduler.mark_in_flight(sched)
        elif not outputs:
            outputs = scheduler.take_deferred_outputs()
        return outputs

    def _apply_launched(self) -> list[EngineCoreOutput]:
        """Wait for the launched step (if any) and apply its output."""
        if self._launched is None:
            return []
        sched, launched, t0 = self._launched
        self._launched = None
        scheduler = self.scheduler
        try:
            runner_out = self.executor.finish_model(launched)
        finally:
            scheduler.in_flight.clear()
            scheduler.sampling_in_flight.clear()
        # Steps overlap: a step's time is from its launch or the last step's end, whichever is later.
        now = time.perf_counter()
        self.rates.record(sched, scheduler.requests, now - max(t0, self._last_applied))
        self._last_applied = now
        return scheduler.update_from_output(sched, runner_out)

    def reset_prefix_cache(self) -> bool:
        if self._launched is not None:  # its blocks are still being written: apply it first
            self.scheduler.deferred_outputs.extend(self._apply_launched())
        return self.scheduler.kv.reset_prefix_cache()

    # ---- sleep / wake ---------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> list[EngineCoreOutput]:
        """Free device memory: level 1 offloads weights to host memory, level 2 discards them.

        Requests still running are aborted (their final outputs are returned so callers can end
        them); the prefix cache is emptied, since the KV memory behind it goes away. Sleeping
        again while asleep is a no-op.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            return []
        applied = self._apply_launched()  # async scheduling: the step in flight, before aborting
        aborted = self.scheduler.finish_requests(
            list(self.scheduler.requests), RequestStatus.FINISHED_ABORTED
        )
        self.step()  # tell the workers to drop the aborted requests' state
        applied += self._apply_launched()
        if not self.reset_prefix_cache():
            raise RuntimeError("cannot sleep: KV blocks are still held after aborting every request")
        self.executor.sleep(level)
        self.sleep_level = level
        self._asleep_parts = {"weights", "kv_cache"}
        return applied + [
            EngineCoreOutput(
                request_id=r.request_id, new_token_ids=[], finish_reason="abort",
                num_cached_tokens=max(r.num_cached_tokens, 0),
            )
            for r in aborted
        ]  # fmt: skip

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what sleep() released: ``tags`` is a subset of {"weights", "kv_cache"} (None: both)."""
        parts = {"weights", "kv_cache"} if tags is None else set(tags)
        unknown = parts - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        parts &= self._asleep_parts
        if not parts:
            return
        self.executor.wake_up(sorted(parts))
        self._asleep_parts -= parts
        if not self._asleep_parts:
            self.sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()
