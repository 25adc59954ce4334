"""One worker process per TP × PP rank, driven through a shared-memory broadcast ring.

The engine core writes each step's ``SchedulerOutput`` (a diff: workers keep request state) into the
ring once; every rank reads it. Only the output rank (TP rank 0 of the last stage) replies to a step,
through its pipe; calls that need every rank's answer (KV sizing, sleep, memory reports) get one
from each. Replies arrive in the order the calls were sent, so up to ``pipeline_parallel_size``
steps can be in flight (futures resolved in order).

Failure handling, the invariants:

- a monitor thread watches every worker's process sentinel; the first unexpected death marks the
  executor failed (``is_failed``, ``failure``), calls ``failure_callback(message)``, and kills and
  reaps every other worker. A caller blocked on a reply wakes up and gets :class:`WorkerFailure`.
- each worker holds the read end of a pipe whose write end only this process holds: when this
  process dies, however abruptly, the worker reads EOF and exits at once. No orphans.
- ``shutdown`` asks workers to exit, then terminates and kills whatever is still alive.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection, wait
from typing import Any

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.distributed import output_rank
from kvfleet_engine.executor.abstract import Executor
from kvfleet_engine.executor.shm_broadcast import BroadcastClosed, BroadcastWriter
from kvfleet_engine.worker.worker_process import REPLY_ALL, REPLY_OUTPUT, WorkerSpec, run_worker

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = float(os.environ.get("KVFLEET_WORKER_START_TIMEOUT", "600"))
_SHUTDOWN_GRACE_S = 5.0


class WorkerFailure(RuntimeError):
    """A worker process died or a step failed: the engine cannot continue."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _StepFuture(Future):
    """A step's result; waiting on it reads replies (in order) until this one has arrived."""

    def __init__(self, executor: MultiprocExecutor) -> None:
        super().__init__()
        self._executor = executor

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        self._executor._resolve_until(self)
        return super().result(timeout)


def _release_at_exit(closing: threading.Event, procs: list[mp.Process], ring: BroadcastWriter) -> None:
    """The executor was never shut down: kill its workers quietly and remove the ring."""
    closing.set()
    _kill_all(procs)
    ring.close()


def _kill_all(procs: list[mp.Process], grace_s: float = 0.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate() if grace_s else p.kill()
    for p in procs:
        p.join(grace_s or 2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: EngineConfig,
        use_tqdm: bool = True,
        failure_callback: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(config)
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size = tp * pp
        self.output_rank = output_rank(tp, pp)
        if failure_callback is not None:
            self.failure_callback = failure_callback
        self.failure: str | None = None
        self._closing = threading.Event()  # set once workers are being stopped on purpose
        self._pending: deque[_StepFuture] = deque()
        # Tokens sampled since the last broadcast; pipeline stages other than the last learn them here.
        self._new_tokens: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.num_steps = 0  # execute_model calls so far (benchmarks divide per-step costs by it)

        ctx = mp.get_context("spawn")
        self._ring = BroadcastWriter(self.world_size)
        backend = "nccl" if config.device.startswith("cuda") else "gloo"
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single host: stay on loopback
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        # Ranks share the machine's cores; KVFLEET_WORKER_THREADS overrides the even split.
        threads = int(os.environ.get("KVFLEET_WORKER_THREADS") or 0) or max(
            1, (os.cpu_count() or 1) // self.world_size
        )
        self._procs: list[mp.Process] = []
        self._conns: list[Connection] = []
        self._death_writers: list[Connection] = []
        try:
            for rank in range(self.world_size):
                parent_conn, child_conn = ctx.Pipe(duplex=True)
                death_reader, death_writer = ctx.Pipe(duplex=False)
                spec = WorkerSpec(config, rank, init_method, backend, self._ring.handle, threads)
                proc = ctx.Process(
                    target=run_worker,
                    args=(spec, child_conn, death_reader),
                    name=f"kvfleet-worker-{rank}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                death_reader.close()
                self._procs.append(proc)
                self._conns.append(parent_conn)
                self._death_writers.append(death_writer)
            self._ring.set_overflow_sockets(self._conns)
            self.worker_pids = self._wait_ready()
        except BaseException:
            self._teardown()
            raise
        # Workers die with this process anyway (death pipe); this also covers a forgotten shutdown().
        self._finalizer = weakref.finalize(self, _release_at_exit, self._closing, self._procs, self._ring)
        self._stop_r, self._stop_w = os.pipe()
        self._monitor = threading.Thread(
            target=self._watch_workers, name="kvfleet-worker-monitor", daemon=True
        )
        self._monitor.start()

    # ---- start-up and failure ------------------------------------------------------------------

    def _wait_ready(self) -> list[int]:
        pids: dict[int, int] = {}
        waiting = dict(enumerate(self._conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while waiting:
            ready = wait([*waiting.values(), *sentinels], timeout=_START_TIMEOUT_S)
            if not ready:
                raise WorkerFailure(f"workers {sorted(waiting)} did not start within {_START_TIMEOUT_S:.0f}s")
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in waiting and not self._conns[rank].poll():
                        code = self._procs[rank].exitcode
                        raise WorkerFailure(f"worker rank {rank} died while starting (exit code {code})")
                    continue
                rank = next(r for r, c in waiting.items() if c is obj)
                kind, payload = obj.recv()
                if kind == "error":
                    raise WorkerFailure(f"worker rank {rank} failed to start:\n{payload}")
                pids[rank] = payload
                del waiting[rank]
        return [pids[r] for r in range(self.world_size)]

    def _watch_workers(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        ready = wait([*sentinels, self._stop_r])
        if self._stop_r in ready or self._closing.is_set():
            return
        dead = [sentinels[s] for s in ready if s in sentinels]
        details = ", ".join(
            f"rank {r} (pid {self._procs[r].pid}, exit code {self._procs[r].exitcode})" for r in dead
        )
        self._fail(f"worker process died: {details}; the engine shut down its other workers")

    def _fail(self, message: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing.is_set():
                return
            self.failure = message
        logger.error("%s", message)
        _kill_all(self._procs)
        if self.failure_callback is not None:
            try:
                self.failure_callback(message)
            except Exception:
                logger.exception("failure callback raised")

    @property
    def is_failed(self) -> bool:
        return self.failure is not None

    def _check_alive(self) -> None:
        if self.failure is not None:
            raise WorkerFailure(self.failure)
        if self._closing.is_set():
            raise WorkerFailure("the executor is shut down")

    # ---- messaging -------------------------------------------------------------------------------

    def _broadcast(self, method: str, args: tuple, reply: str) -> None:
        self._check_alive()
        try:
            self._ring.enqueue((method, args, reply), should_abort=lambda: self.failure is not None)
        except BroadcastClosed:
            raise WorkerFailure(self.failure or "broadcast aborted") from None

    def _recv(self, rank: int) -> Any:
        conn = self._conns[rank]
        sentinels = [p.sentinel for p in self._procs]
        while True:
            if conn.poll():
                break
            self._check_alive()
            if any(s in sentinels for s in wait([conn, *sentinels], timeout=1.0)) and not conn.poll():
                self._watch_dead_now()
        try:
            ok, result = conn.recv()
        except (EOFError, OSError):
            self._watch_dead_now()
            raise WorkerFailure(self.failure or f"lost the connection to worker rank {rank}") from None
        return ok, result

    def _watch_dead_now(self) -> None:
        """A sentinel fired in the caller's thread before the monitor reported it: report now."""
        dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
        if dead and not self._closing.is_set():
            details = ", ".join(
                f"rank {r} (pid {self._procs[r].pid}, exit code {self._procs[r].exitcode})" for r in dead
            )
            self._fail(f"worker process died: {details}; the engine shut down its other workers")
        self._check_alive()

    def _resolve_until(self, target: _StepFuture | None) -> None:
        """Read step replies in order until ``target`` (or, with None, every pending one) is done."""
        while self._pending and (target is None or not target.done()):
            fut = self._pending[0]
            try:
                ok, result = self._recv(self.output_rank)
            except WorkerFailure as e:
                while self._pending:
                    self._pending.popleft().set_exception(WorkerFailure(str(e)))
                raise
            self._pending.popleft()
            if not ok:
                self._fail(f"a step failed on worker rank {self.output_rank}:\n{result}")
                fut.set_exception(WorkerFailure(self.failure or result))
                continue
            if self.config.pipeline_parallel_size > 1:
                for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
                    if tokens:
                        self._new_tokens.setdefault(rid, []).extend(tokens)
            fut.set_result(result)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every worker (after the steps in flight); their results by rank."""
        self._resolve_until(None)
        self._broadcast(method, args, REPLY_ALL)
        results = []
        errors = []
        for rank in range(self.world_size):
            ok, result = self._recv(rank)
            results.append(result)
            if not ok:
                errors.append(f"rank {rank}:\n{result}")
        if errors:
            raise RuntimeError(f"{method} failed on worker(s): " + "\n".join(errors))
        return results

    # ---- the Executor interface ------------------------------------------------------------------

    @property
    def max_concurrent_batches(self) -> int:
        return self.config.pipeline_parallel_size

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", num_blocks)

    def execute_model(
        self, sched: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        new_tokens, self._new_tokens = self._new_tokens, {}
        self.num_steps += 1
        self._broadcast("execute_model", (sched, new_tokens or None), REPLY_OUTPUT)
        fut = _StepFuture(self)
        self._pending.append(fut)
        return fut if non_block else fut.result()

    def sleep(self, level: int = 1) -> None:
        self.collective_rpc("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.collective_rpc("wake_up", tags)

    def memory_report(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for report in self.collective_rpc("memory_report"):
            for key, value in report.items():
                total[key] = total.get(key, 0) + value
        return total

    def shutdown(self) -> None:
        if self._closing.is_set():
            return
        if self.failure is None:
            try:
                self._resolve_until(None)
                self._ring.enqueue(("shutdown", (), REPLY_ALL), timeout_s=_SHUTDOWN_GRACE_S)
            except Exception:  # whatever went wrong, the workers are killed below
                logger.debug("workers did not take the shutdown message", exc_info=True)
        self._closing.set()
        self._finalizer.detach()
        os.write(self._stop_w, b"x")
        for p in self._procs:
            p.join(_SHUTDOWN_GRACE_S)
        self._teardown()
        self._monitor.join(2.0)
        os.close(self._stop_r)
        os.close(self._stop_w)

    def _teardown(self) -> None:
        self._closing.set()
        _kill_all(self._procs, grace_s=1.0)
        for conn in [*self._conns, *self._death_writers]:
            conn.close()
        self._ring.close()
