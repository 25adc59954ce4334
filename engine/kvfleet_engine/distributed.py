"""Process-group state of this worker: its tensor-parallel (TP) and pipeline-parallel (PP) place.

Single-process by default (rank 0 of 1 in both, collectives are no-ops). The multiprocess executor's
workers call :func:`init_distributed` once before building the model; layers ask here instead of
taking ranks through their constructors, so models are written once for any TP/PP size.

Rank layout: ``global_rank = pp_rank * tp_size + tp_rank``. A TP group is one pipeline stage's ranks;
hidden states travel from ``(stage s, tp t)`` to ``(stage s + 1, tp t)``. The output rank (the one
that replies to the engine) is TP rank 0 of the last stage.

Time spent inside TP collectives and PP transfers is accumulated in :data:`tp_comm` and
:data:`pp_comm`, for the parallel benchmark.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


@dataclass(slots=True)
class CommStats:
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def add(self, t0: float, nbytes: int) -> None:
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += nbytes


_state = ParallelState()
# TP collectives; PP transfers (a receive also waits for the previous stage to finish its part).
tp_comm = CommStats()
pp_comm = CommStats()


def reset_comm_stats() -> None:
    for c in (tp_comm, pp_comm):
        c.seconds, c.calls, c.bytes = 0.0, 0, 0


def output_rank(tp_size: int, pp_size: int) -> int:
    return (pp_size - 1) * tp_size


def stage_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split, earlier stages taking the remainder."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def init_distributed(
    rank: int, tp_size: int, pp_size: int, init_method: str, backend: str, timeout_s: float = 600.0
) -> None:
    """Join the world process group and create the TP groups (every rank creates every group)."""
    import datetime

    world = tp_size * pp_size
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    my_group = None
    for stage in range(pp_size):
        group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
        if stage == pp_rank:
            my_group = group
    set_parallel_state(ParallelState(tp_rank, tp_size, pp_rank, pp_size, my_group))


def set_parallel_state(state: ParallelState) -> None:
    global _state
    _state = state


def get_parallel_state() -> ParallelState:
    return _state


def set_tensor_parallel_group(rank: int, size: int, group=None) -> None:
    set_parallel_state(ParallelState(rank, size, _state.pp_rank, _state.pp_size, group))


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_size() -> int:
    return _state.pp_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    t0 = time.perf_counter()
    dist.all_reduce(x, group=_state.tp_group)
    tp_comm.add(t0, x.numel() * x.element_size())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _state.tp_size == 1:
        return x
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    tp_comm.add(t0, x.numel() * x.element_size() * _state.tp_size)
    return torch.cat(parts, dim=dim)


class StageLink:
    """Hidden states to the next pipeline stage and from the previous one (same TP rank).

    Sends are asynchronous so a stage can start its next batch while the previous one is still
    on the wire; a send's buffer is kept alive until the send completes.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[object, torch.Tensor]] = []

    def send(self, x: torch.Tensor) -> None:
        s = _state
        self.wait_sends()
        t0 = time.perf_counter()
        x = x.contiguous()
        work = dist.isend(x, dst=(s.pp_rank + 1) * s.tp_size + s.tp_rank)
        self._pending.append((work, x))
        pp_comm.add(t0, x.numel() * x.element_size())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        s = _state
        t0 = time.perf_counter()
        x = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(x, src=(s.pp_rank - 1) * s.tp_size + s.tp_rank)
        pp_comm.add(t0, x.numel() * x.element_size())
        return x

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
