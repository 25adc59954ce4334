from __future__ import annotations

from concurrent.futures import Future

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

    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        out = self.worker.execute_model(sched)
        if not non_block:
            return out
        fut: Future[ModelRunnerOutput] = Future()
        fut.set_result(out)
        return fut

    def launch_model(self, sched: SchedulerOutput):
        """Async scheduling: queue the step, collect it later with ``finish_model``."""
        return self.worker.launch_model(sched)

    def finish_model(self, launched) -> ModelRunnerOutput:
        return self.worker.finish_model(launched)

    def sleep(self, level: int = 1) -> None:
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.worker.wake_up(tags)

    def memory_report(self) -> dict[str, int]:
        return self.worker.memory_report()

    def shutdown(self) -> None:
        self.worker.runner.free_kv_cache()
