"""The seam between the engine core and the workers (in-process, or one process per rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    # Called (from a monitor thread) with a message when the workers fail for good; set by the owner.
    failure_callback: Callable[[str], None] | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @property
    def is_failed(self) -> bool:
        """True once the workers are gone for good (the engine must stop)."""
        return False

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
