"""Which executor runs a configuration's steps."""

from __future__ import annotations

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.executor.abstract import Executor


def executor_for(config: EngineConfig, use_tqdm: bool = True) -> Executor:
    """Simulated (no model) when ``config.simulation`` is set; else in-process for one rank (unless
    ``distributed_executor_backend="mp"``), else one process per rank."""
    # Imported here: the process-per-rank executor pulls in what only it needs (shared memory, spawn).
    if config.simulation is not None:
        from kvfleet_engine.executor.simulated import SimulatedExecutor

        return SimulatedExecutor(config, use_tqdm=use_tqdm)
    if config.distributed_executor_backend == "uni":
        from kvfleet_engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, use_tqdm=use_tqdm)
    from kvfleet_engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, use_tqdm=use_tqdm)
