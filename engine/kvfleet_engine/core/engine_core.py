"""EngineCore: scheduler + executor. ``step() = schedule -> execute_model -> update_from_output``."""

from __future__ import annotations

import logging

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.block_pool import KVEventSink
from kvfleet_engine.core.kv_cache_manager import KVCacheManager
from kvfleet_engine.core.scheduler import EngineCoreOutput, Scheduler
from kvfleet_engine.executor.abstract import Executor
from kvfleet_engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True, on_kv_event: KVEventSink | None = None):
        self.config = config
        self.executor = Executor.for_config(config, use_tqdm=use_tqdm)
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
        self.scheduler = Scheduler(
            kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.max_model_len,
            config.scheduling_policy,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def stop_requests(self, request_ids: list[str]) -> None:
        """Finish requests the frontend stopped (e.g. a stop string matched)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self) -> bool:
        """Unfinished requests, or finished ones the workers have not been told to forget yet."""
        return self.scheduler.has_unfinished_requests() or bool(self.scheduler.finished_req_ids)

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty and not sched.finished_req_ids and not sched.preempted_req_ids:
            return []
        runner_out = self.executor.execute_model(sched)
        return self.scheduler.update_from_output(sched, runner_out)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
