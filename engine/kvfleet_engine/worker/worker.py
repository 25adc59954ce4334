"""One worker = one device: owns the model runner and answers the executor's calls."""

from __future__ import annotations

import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.worker.model_runner import ModelRunner

# Default KV budget on CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given.
_CPU_DEFAULT_KV_BYTES = 4 << 30


class Worker:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True) -> None:
        self.config = config
        if config.device != "cpu":
            torch.cuda.set_device(torch.device(config.device))
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, use_tqdm=use_tqdm)

    def determine_num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = cfg.kv_bytes_per_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif cfg.device == "cpu":
            budget = _CPU_DEFAULT_KV_BYTES
        else:
            free, total = torch.cuda.mem_get_info()
            used = total - free
            budget = int(total * cfg.gpu_memory_utilization) - used
        # Never more than every sequence at full length needs (+1 for the null block).
        needed = cfg.max_num_seqs * (-(-cfg.max_model_len // cfg.block_size)) + 1
        num = min(budget // per_block, needed)
        if num < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds {num} blocks of {per_block} bytes; need at least 2"
            )
        return int(num)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)
