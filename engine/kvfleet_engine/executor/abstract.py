"""The seam between the engine core and the workers (in-process now; one process per rank later)."""

from __future__ import annotations

from abc import ABC, abstractmethod

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

    @abstractmethod
    def determine_num_kv_blocks(self) -> int: ...

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and device memory."""
