"""One worker = one device: owns the model runner and answers the executor's calls."""

from __future__ import annotations

import gc

import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.device import bind_device
from kvfleet_engine.layers import prepack
from kvfleet_engine.layers.rotary import RotaryEmbedding
from kvfleet_engine.models.loader import load_weights
from kvfleet_engine.worker.host_allocator import tune_host_allocator
from kvfleet_engine.worker.model_runner import ModelRunner, PendingStep

# Default KV budget on CPU when neither num_kv_blocks nor kv_cache_memory_bytes is given.
_CPU_DEFAULT_KV_BYTES = 4 << 30

SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class Worker:
    """Answers the executor; also owns sleep/wake of its device memory.

    Sleep invariants: after ``sleep(level)`` the KV cache storage is released (its contents are
    lost; the engine core has emptied its prefix cache). Weights at level 1 are moved to host
    memory (pinned on CUDA; on CPU they already are host memory and stay put); at level 2 they are
    discarded and re-read from the model directory on wake. ``wake_up`` restores the same shapes and
    block count, so the scheduler's view of the cache stays valid. Repeated sleeps/wakes are no-ops.
    Decode graphs (CUDA) are released with the KV cache and captured again once both parts are awake.
    """

    def __init__(self, config: EngineConfig, use_tqdm: bool = True) -> None:
        self.config = config
        if config.device == "cpu":
            tune_host_allocator()
        else:
            bind_device(config.device)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, use_tqdm=use_tqdm)
        self.use_tqdm = use_tqdm
        self.asleep: set[str] = set()
        self.sleep_level = 0
        # Level-1 host copies of every parameter/buffer, keyed by the tensor's owning module + name.
        self._host_weights: dict[tuple[int, str], torch.Tensor] = {}
        # Shapes/dtypes to re-create the discarded tensors with at level 2.
        self._discarded: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}

    def determine_num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block
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
        self.runner.warm_up()
        self.runner.capture_graphs()

    def execute_model(
        self, sched: SchedulerOutput, new_token_ids: dict[str, list[int]] | None = None
    ) -> ModelRunnerOutput | None:
        if self.asleep:
            raise RuntimeError(f"worker is asleep ({', '.join(sorted(self.asleep))} released): wake it first")
        return self.runner.execute_model(sched, new_token_ids)

    def launch_model(self, sched: SchedulerOutput):
        """Queue a step on the device (``ModelRunner.launch``); ``finish_model`` collects it."""
        if self.asleep:
            raise RuntimeError(f"worker is asleep ({', '.join(sorted(self.asleep))} released): wake it first")
        return self.runner.launch(sched)

    def finish_model(self, launched) -> ModelRunnerOutput:
        return self.runner.finish(launched) if isinstance(launched, PendingStep) else launched

    # ---- sleep / wake ---------------------------------------------------------------------------

    def _named_tensors(self):
        """(key, module, attribute name, tensor) for every parameter and buffer, tied ones once."""
        seen: set[int] = set()
        for module in self.runner.model.modules():
            for name, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (id(module), name), module, name, t

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.asleep:
            return
        self.runner.free_kv_cache()
        for module in self.runner.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.clear_cache()
        on_device = self.runner.device.type != "cpu"
        if level == 1 and on_device:
            for key, _, _, t in self._named_tensors():
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t.data)
                self._host_weights[key] = host
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        elif level == 2:
            prepack.drop_packs(self.runner.model)
            for key, _, _, t in self._named_tensors():
                self._discarded[key] = (t.shape, t.dtype)
                # Buffers (rotary tables) are not in the checkpoint: keep a host copy of those.
                if not isinstance(t, torch.nn.Parameter):
                    self._host_weights[key] = t.data.to("cpu", copy=True)
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._release_cached_memory()
        self.asleep = set(SLEEP_TAGS)
        self.sleep_level = level

    def wake_up(self, tags: list[str] | None = None) -> None:
        parts = set(SLEEP_TAGS) if tags is None else set(tags)
        unknown = parts - SLEEP_TAGS
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights' and/or 'kv_cache'")
        parts &= self.asleep
        if "weights" in parts:
            self._restore_weights()
            self.asleep.discard("weights")
        if "kv_cache" in parts:
            self.runner.initialize_kv_cache(self.runner.num_blocks)
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.sleep_level = 0
            if parts:
                # The decode graphs pointed at the released weights and KV cache: capture them anew.
                self.runner.capture_graphs()

    def _restore_weights(self) -> None:
        device = self.runner.device
        reload = bool(self._discarded)
        for key, _, _, t in self._named_tensors():
            host = self._host_weights.pop(key, None)
            if host is not None:
                t.data = host.to(device, non_blocking=device.type == "cuda")
            elif key in self._discarded:
                shape, dtype = self._discarded[key]
                t.data = torch.empty(shape, dtype=dtype, device=device)
        self._discarded.clear()
        if reload:
            load_weights(self.runner.model, self.config.model.path, use_tqdm=self.use_tqdm)
            self.runner.prepack_weights()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            # The level-1 host copies were pinned: once copied back, hand their page-locked memory back
            # to the OS instead of keeping a weights-sized block in torch's pinned-memory cache.
            gc.collect()
            empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None)
            if empty_host_cache is not None:
                empty_host_cache()

    def _release_cached_memory(self) -> None:
        gc.collect()
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()

    def memory_report(self) -> dict[str, int]:
        """Bytes of storage this worker holds on its device for weights and KV cache.

        Storages are counted once (tied weights, views). On CUDA ``torch_allocated`` adds what the
        caching allocator has handed out in total; on CPU ``weight_packs`` the oneDNN copies of the
        matmul weights (layers/prepack.py).
        """
        device = self.runner.device

        def storage_bytes(tensors) -> int:
            seen: set[int] = set()
            total = 0
            for t in tensors:
                if t.device.type != device.type or t.numel() == 0:
                    continue
                s = t.untyped_storage()
                if s.data_ptr() in seen:
                    continue
                seen.add(s.data_ptr())
                total += s.nbytes()
            return total

        report = {
            "weights": storage_bytes(t for *_, t in self._named_tensors()),
            "kv_cache": storage_bytes(t for kv in self.runner.kv_caches for t in kv),
        }
        if device.type == "cuda":
            report["torch_allocated"] = int(torch.cuda.memory_allocated(device))
        else:
            report["weight_packs"] = prepack.packed_bytes(self.runner.model)
        return report
