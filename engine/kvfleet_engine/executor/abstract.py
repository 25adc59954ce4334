"""The seam between the engine core and the workers (in-process, or one process per rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @classmethod
    def for_config(cls, config: EngineConfig, use_tqdm: bool = True) -> Executor:
        if config.tensor_parallel_size * config.pipeline_parallel_size == 1:
            from kvfleet_engine.executor.uniproc import UniProcExecutor

            return UniProcExecutor(config, use_tqdm=use_tqdm)
        raise NotImplementedError("multiprocess executor (tensor/pipeline parallel) is not available yet")

    @property
    def max_concurrent_batches(self) -> int:
        """How many steps may be in flight at once (the pipeline depth); 1 means step by step."""
        return 1

    @abstractmethod
    def determine_num_kv_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step; with ``non_block`` return a future instead of waiting for the result."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Release device memory on every worker: level 1 offloads weights to host, level 2 discards them.

        The KV cache is freed at both levels. Sleeping while asleep is a no-op."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``tags`` (subset of {"weights", "kv_cache"}; None: both) on every worker."""

    @abstractmethod
    def memory_report(self) -> dict[str, int]:
        """Device bytes held for "weights" and "kv_cache", summed over workers."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and device memory."""
