"""Entry point of one worker process of the multiprocess executor (one TP × PP rank).

Lifecycle: watch the parent (exit at once if it dies), join ``torch.distributed``, load this rank's
shard of the model, attach to the broadcast ring, report ready, then execute what the ring brings
until told to shut down. Only ranks that owe a reply send one on their pipe to the parent.

A failure while starting is sent to the parent as ``("error", traceback)``. A failure of a call the
parent expects no reply to from this rank ends the process: the executor's monitor notices the death
and reports it (the other ranks would otherwise hang in a collective).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from kvfleet_common.server_kit.gc_heap import freeze_long_lived, mark_server_process
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.executor.shm_broadcast import BroadcastReader, RingHandle

logger = logging.getLogger(__name__)

# What a broadcast message asks of which ranks.
REPLY_ALL, REPLY_OUTPUT = "all", "output"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    config: EngineConfig
    rank: int
    init_method: str
    backend: str
    ring: RingHandle
    threads: int
    use_tqdm: bool = False


def _exit_when_parent_dies(death_pipe: Connection) -> None:
    """The parent holds the write end and never writes: EOF means it is gone (even after SIGKILL)."""
    with contextlib.suppress(EOFError, OSError):
        death_pipe.recv()
    os._exit(1)


class _Handler:
    """The calls a broadcast message can name (on top of the worker's own)."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def comm_stats(self, reset: bool = False) -> dict[str, float]:
        from kvfleet_engine import distributed

        stats = {
            "tp_seconds": distributed.tp_comm.seconds,
            "tp_calls": distributed.tp_comm.calls,
            "tp_bytes": distributed.tp_comm.bytes,
            "pp_seconds": distributed.pp_comm.seconds,
            "pp_calls": distributed.pp_comm.calls,
            "pp_bytes": distributed.pp_comm.bytes,
        }
        if reset:
            distributed.reset_comm_stats()
        return stats

    def busy_intervals(self, clear: bool = False) -> list[tuple[float, float]]:
        out = list(self.worker.runner.busy_intervals)
        if clear:
            self.worker.runner.busy_intervals.clear()
        return out

    def pid(self) -> int:
        return os.getpid()

    def request_states(self) -> dict[str, tuple[list[int], int, list[int]]]:
        """Each request's (tokens, num_computed_tokens, block ids) as this rank sees them."""
        return {
            rid: (st.prompt_token_ids + st.output_token_ids, st.num_computed_tokens, list(st.block_ids))
            for rid, st in self.worker.runner.requests.items()
        }

    def num_request_states(self) -> int:
        """Requests this rank still keeps state for (0 when the engine is idle: nothing leaked)."""
        return len(self.worker.runner.requests)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.worker, name)


def run_worker(spec: WorkerSpec, conn: Connection, death_pipe: Connection) -> None:
    threading.Thread(target=_exit_when_parent_dies, args=(death_pipe,), daemon=True).start()
    try:
        import torch

        from kvfleet_engine.models.loader import use_a_thread_lock_for_progress_bars

        use_a_thread_lock_for_progress_bars()

        from kvfleet_engine.device import bind_device, rank_device
        from kvfleet_engine.distributed import get_parallel_state, init_distributed, output_rank
        from kvfleet_engine.worker.worker import Worker

        torch.set_num_threads(spec.threads)
        cfg = spec.config
        device = rank_device(cfg.device, spec.rank)
        bind_device(device)  # before NCCL picks a device itself
        init_distributed(
            spec.rank, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, spec.init_method, spec.backend
        )
        worker = Worker(dataclasses.replace(cfg, device=device), use_tqdm=spec.use_tqdm)
        reader = BroadcastReader(spec.ring, spec.rank, conn)
        is_output = spec.rank == output_rank(cfg.tensor_parallel_size, cfg.pipeline_parallel_size)
        assert get_parallel_state().rank == spec.rank
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    mark_server_process()
    freeze_long_lived(f"worker rank {spec.rank} loaded")
    conn.send(("ready", os.getpid()))
    handler = _Handler(worker)
    while True:
        method, args, reply = reader.dequeue()
        if method == "shutdown":
            break
        try:
            result, ok = getattr(handler, method)(*args), True
        except Exception:
            result, ok = traceback.format_exc(), False
        if reply == REPLY_ALL or (reply == REPLY_OUTPUT and is_output):
            conn.send((ok, result))
        elif not ok:
            sys.stderr.write(f"kvfleet worker rank {spec.rank}: {method} failed\n{result}")
            sys.stderr.flush()
            os._exit(1)
    reader.close()
    if worker.runner.stage_link is not None:
        worker.runner.stage_link.wait_sends()
    import torch.distributed as dist

    dist.destroy_process_group()
    conn.send((True, "bye"))
