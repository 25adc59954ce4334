from __future__ import annotations

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.executor.abstract import Executor
from kvfleet_engine.worker.worker import Worker


class UniProcExecutor(Executor):
    """The single worker lives in the engine core's own process."""

    def __init__(self, config: EngineConfig, use_tqdm: bool = True) -> None:
        super().__init__(config)
        self.worker = Worker(config, use_tqdm=use_tqdm)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched)

    def shutdown(self) -> None:
        self.worker.runner.free_kv_cache()
