"""The engine core process: input thread -> busy loop (``EngineCore.step()``) -> output thread.

The API server process spawns this with :func:`run_engine_core`. Socket I/O (and msgpack) runs in
two threads so that the busy loop only ever touches Python objects: the input thread decodes
requests into ``input_queue``, the loop drains it between steps, and the output thread encodes and
sends what each step produced. The process dies with its parent (``PR_SET_PDEATHSIG`` plus a pipe
that reaches EOF when the parent goes), so a killed API server never leaves an engine holding GPU
memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from kvfleet_common.server_kit.gc_heap import freeze_long_lived, mark_server_process
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.engine_core import EngineCore
from kvfleet_engine.core.messages import (
    ABORT_DECODER,
    ENCODER,
    REQUESTS_DECODER,
    UTILITY_DECODER,
    CoreStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestKind,
    UtilityCall,
    UtilityResult,
)
from kvfleet_engine.models.loader import use_a_thread_lock_for_progress_bars

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_S = 0.25
_WORKER_FAILED = b"F"  # internal input-queue message from the executor's monitor thread  # how often an idle loop wakes up (presence resync, stats)


@dataclass(slots=True)
class PresenceOptions:
    """Where and as whom the replica announces itself in Redis (see kvfleet_engine.presence)."""

    redis_url: str
    name: str
    model: str
    base_url: str
    replica_key: bytes | None = None  # signs the heartbeats (kvfleet_common.replica_credentials)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        input_addr: str,
        output_addr: str,
        presence: PresenceOptions | None = None,
    ) -> None:
        self.publisher = None
        if presence is not None:
            self.publisher = _make_publisher(config, presence, self._presence_stats)
        on_kv = self.publisher.push_kv_events if self.publisher is not None else None
        self.engine = EngineCore(config, use_tqdm=True, on_kv_event=on_kv)
        self.config = config
        self.input_queue: queue.Queue[tuple[bytes, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | None] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._input_addr, self._output_addr = input_addr, output_addr
        self._stats_dirty = True
        self._state = "awake"
        self._memory = self.engine.executor.memory_report()
        if hasattr(self.engine.executor, "failure_callback"):
            # A worker died: wake the (possibly idle) busy loop so the core fails at once, loudly.
            self.engine.executor.failure_callback = lambda msg: self.input_queue.put((_WORKER_FAILED, msg))

    # ---- threads ---------------------------------------------------------------------------------

    def _input_thread(self) -> None:
        sock = self._ctx.socket(zmq.PULL)
        sock.connect(self._input_addr)
        decoders = {
            RequestKind.ADD.value: REQUESTS_DECODER,
            RequestKind.ABORT.value: ABORT_DECODER,
            RequestKind.UTILITY.value: UTILITY_DECODER,
        }
        try:
            while not self._stop.is_set():
                if not sock.poll(200):
                    continue
                kind, payload = sock.recv_multipart(copy=False)
                kind = bytes(kind.buffer)
                self.input_queue.put((kind, decoders[kind].decode(payload.buffer)))
        finally:
            sock.close(linger=0)

    def _output_thread(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.connect(self._output_addr)
        try:
            while True:
                msg = self.output_queue.get()
                if msg is None:
                    break
                sock.send(ENCODER.encode(msg), copy=False)
        finally:
            sock.close(linger=2000)  # let a final fatal_error message go out

    # ---- busy loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        threads = [
            threading.Thread(target=self._input_thread, name="core-input", daemon=True),
            threading.Thread(target=self._output_thread, name="core-output", daemon=True),
        ]
        for t in threads:
            t.start()
        if self.publisher is not None:
            self.publisher.start()
            self.publisher.set_state("awake")
        try:
            while not self._stop.is_set():
                self._drain_input(block=not self.engine.has_pending_work())
                self._answer_resync()
                outputs = self.engine.step() if self.engine.has_pending_work() else []
                if outputs or self._stats_dirty:
                    self._emit(outputs)
        except Exception:
            logger.exception("engine core failed")
            self.output_queue.put(EngineCoreOutputs(fatal_error=traceback.format_exc(limit=20)))
            raise
        finally:
            self.output_queue.put(None)
            threads[1].join(timeout=3)
            self._stop.set()
            if self.publisher is not None:
                self.publisher.stop(deregister=True)
            self.engine.shutdown()

    def _emit(self, outputs: list[EngineCoreOutput], results: list[UtilityResult] | None = None) -> None:
        self._stats_dirty = False
        self.output_queue.put(
            EngineCoreOutputs(outputs=outputs, utility_results=results or [], stats=self.stats())
        )

    def _drain_input(self, block: bool) -> None:
        try:
            item = self.input_queue.get(timeout=_IDLE_POLL_S) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: bytes, payload: Any) -> None:
        self._stats_dirty = True
        if kind == _WORKER_FAILED:
            raise RuntimeError(f"a worker process failed: {payload}")
        if kind == RequestKind.ADD.value:
            self._add(payload)
        elif kind == RequestKind.ABORT.value:
            self.engine.abort_requests(payload)
        else:
            self._emit([], [self._call(payload)])

    def _add(self, reqs: list[EngineCoreRequest]) -> None:
        rejected: list[EngineCoreOutput] = []
        for r in reqs:
            if self.engine.is_sleeping:  # raced with sleep: end it at once, the frontend maps it to 503
                rejected.append(
                    EngineCoreOutput(request_id=r.request_id, new_token_ids=[], finish_reason="abort")
                )
                continue
            self.engine.add_request(r)
        if rejected:
            self._emit(rejected)

    _UTILITIES = frozenset({"sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "set_state", "stats"})

    def _call(self, call: UtilityCall) -> UtilityResult:
        if call.method not in self._UTILITIES:
            return UtilityResult(call.call_id, error=f"unknown engine core method {call.method!r}")
        try:
            if call.method == "sleep":
                aborted = self.engine.sleep(*call.args)
                self._memory = self.engine.executor.memory_report()
                if aborted:
                    self._emit(aborted)
                self._set_state("sleeping")
                result: Any = None
            elif call.method == "wake_up":
                self.engine.wake_up(*call.args)
                self._memory = self.engine.executor.memory_report()
                if not self.engine.is_sleeping:
                    self._set_state("awake")
                result = None
            elif call.method == "is_sleeping":
                result = self.engine.is_sleeping
            elif call.method == "reset_prefix_cache":
                result = self.engine.reset_prefix_cache()
            elif call.method == "set_state":
                self._set_state(*call.args)
                result = None
            else:
                result = None  # "stats": the reply carries fresh stats anyway
            return UtilityResult(call.call_id, result=result)
        except Exception as e:  # a failed utility call is the caller's error, not the core's death
            logger.exception("engine core call %s failed", call.method)
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _set_state(self, state: str) -> None:
        self._state = state
        if self.publisher is not None:
            self.publisher.set_state(state)

    def _answer_resync(self) -> None:
        pub = self.publisher
        if pub is not None and pub.resync_requested():
            pub.push_snapshot(list(self.engine.scheduler.kv.block_pool.cached_blocks))

    # ---- stats -----------------------------------------------------------------------------------

    def stats(self) -> CoreStats:
        sched = self.engine.scheduler
        kv = sched.kv
        return CoreStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.waiting_for_grammar),
            kv_cache_usage=kv.usage,
            num_kv_blocks=self.engine.num_kv_blocks,
            num_free_kv_blocks=kv.get_num_free_blocks(),
            num_preemptions=sched.num_preemptions,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            prefill_tokens_per_s=self.engine.rates.prefill_tokens_per_s,
            decode_tokens_per_s=self.engine.rates.decode_tokens_per_s,
            sleep_level=self.engine.sleep_level,
            # On CPU the oneDNN weight packs are weight memory too.
            weights_bytes=self._memory.get("weights", 0) + self._memory.get("weight_packs", 0),
            kv_cache_bytes=self._memory.get("kv_cache", 0),
        )

    def _presence_stats(self):
        from kvfleet_common.schemas import ReplicaStats

        s = self.stats()  # called from the publisher thread, which run() starts after the engine exists
        return ReplicaStats(
            running=s.num_running,
            waiting=s.num_waiting,
            kv_usage=s.kv_cache_usage,
            num_kv_blocks=s.num_kv_blocks,
            prefill_tokens_per_s=s.prefill_tokens_per_s,
            decode_tokens_per_s=s.decode_tokens_per_s,
        )

    def shutdown(self) -> None:
        self._stop.set()


def _make_publisher(config: EngineConfig, presence: PresenceOptions, stats):
    from kvfleet_engine.presence import PresencePublisher

    files = {}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        p = config.model.path / name
        if p.is_file():
            files[name] = p.read_bytes()
    return PresencePublisher(
        presence.redis_url,
        name=presence.name,
        model=presence.model,
        base_url=presence.base_url,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        stats=stats,
        tokenizer_files=files,
        replica_key=presence.replica_key,
    )


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    ready_conn,
    presence: PresenceOptions | None = None,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the spawned core process. Reports ``{"ok": ...}`` on ``ready_conn`` once
    the model and KV cache are ready (or the start-up error), then serves until told to stop."""
    die_with_parent()
    use_a_thread_lock_for_progress_bars()
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s", force=True
    )
    parent = os.getppid()
    proc: EngineCoreProc | None = None

    def watch_parent() -> None:
        # Belt and braces for PDEATHSIG: the pipe hits EOF when the parent is gone.
        with contextlib.suppress(EOFError, OSError):
            ready_conn.recv()
        if proc is not None:
            proc.shutdown()
            time.sleep(3)
        os._exit(0 if os.getppid() == parent else 1)

    signal.signal(signal.SIGTERM, lambda *_: proc.shutdown() if proc else os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the API server, which stops us
    try:
        t0 = time.perf_counter()
        proc = EngineCoreProc(config, input_addr, output_addr, presence)
        mark_server_process()
        freeze_long_lived("engine core ready")
        ready_conn.send({"ok": True, "num_kv_blocks": proc.engine.num_kv_blocks})
        logger.info("engine core ready in %.1fs", time.perf_counter() - t0)
    except Exception as e:
        logger.exception("engine core failed to start")
        ready_conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    threading.Thread(target=watch_parent, name="core-parent-watch", daemon=True).start()
    try:
        proc.run()
    except Exception:
        sys.exit(1)
