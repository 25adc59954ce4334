"""Broadcast from one writer to many readers through a ring of slots in shared memory.

The engine core sends every step's ``SchedulerOutput`` to all workers: one pickle, written once,
read in place by every worker (no per-worker copy through a pipe). Messages larger than a slot go
through each reader's socket instead; the slot then carries only a marker saying so.

Layout of the shared block (all counters are 8-byte aligned uint64, each on its own cache line):

- ``read[r]`` for each reader ``r``: how many messages reader ``r`` has consumed;
- ``seq[s], length[s]`` for each slot ``s``: the number (1-based) of the message last written there
  and its byte length (high bit set: the bytes went through the socket);
- the slot payloads.

Invariants: message ``m`` lives in slot ``(m - 1) % num_slots``. The writer writes message ``m`` only
once every reader has consumed message ``m - num_slots`` (so it never overwrites an unread slot);
it stores the payload, then ``length``, then ``seq`` last. A reader waits for ``seq == m``, reads,
then bumps its ``read`` counter. A full memory barrier separates payload and counter accesses on
both sides, so the protocol does not rely on the CPU's store ordering.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

_LINE = 64  # bytes: one cache line per counter, so readers never share one
_U64_PER_LINE = _LINE // 8
_OVERFLOW = np.uint64(1 << 63)
_fence_lock = threading.Lock()


def _fence() -> None:
    # Acquiring and releasing a lock executes atomic read-modify-writes: a full barrier.
    _fence_lock.acquire()
    _fence_lock.release()


class BroadcastClosed(RuntimeError):
    """The writer gave up waiting (its abort check fired)."""


@dataclass(frozen=True, slots=True)
class RingHandle:
    """What a reader process needs to attach (picklable)."""

    shm_name: str
    num_slots: int
    slot_bytes: int
    num_readers: int


class _Ring:
    def __init__(self, handle: RingHandle, shm: shared_memory.SharedMemory) -> None:
        self.handle = handle
        self.shm = shm
        n, r = handle.num_slots, handle.num_readers
        buf = shm.buf
        self.read = np.ndarray((r, _U64_PER_LINE), np.uint64, buffer=buf, offset=0)[:, 0]
        off = r * _LINE
        header = np.ndarray((n, _U64_PER_LINE), np.uint64, buffer=buf, offset=off)
        self.seq, self.length = header[:, 0], header[:, 1]
        self.data_offset = off + n * _LINE

    @staticmethod
    def size(num_slots: int, slot_bytes: int, num_readers: int) -> int:
        return (num_readers + num_slots) * _LINE + num_slots * slot_bytes

    def payload(self, slot: int) -> memoryview:
        start = self.data_offset + slot * self.handle.slot_bytes
        return self.shm.buf[start : start + self.handle.slot_bytes]

    def release(self) -> None:
        # numpy views pin the buffer: drop them before closing the mapping.
        self.read = self.seq = self.length = None  # type: ignore[assignment]
        self.shm.close()


def _backoff(spins: int) -> None:
    """Yield first (messages usually come quickly), then sleep up to 1 ms so idle waiters cost little."""
    if spins < 50:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 1e-5 * (1 << min(spins - 50, 7))))


class BroadcastWriter:
    def __init__(self, num_readers: int, num_slots: int = 8, slot_bytes: int = 1 << 20) -> None:
        size = _Ring.size(num_slots, slot_bytes, num_readers)
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[: (num_readers + num_slots) * _LINE] = bytes((num_readers + num_slots) * _LINE)
        self.handle = RingHandle(shm.name, num_slots, slot_bytes, num_readers)
        self._ring = _Ring(self.handle, shm)
        self._written = 0
        self._sockets: list[Connection] = []

    def set_overflow_sockets(self, sockets: list[Connection]) -> None:
        """One connection per reader, in reader order: where messages bigger than a slot go."""
        if len(sockets) != self.handle.num_readers:
            raise ValueError(f"need {self.handle.num_readers} overflow sockets, got {len(sockets)}")
        self._sockets = list(sockets)

    def enqueue(
        self, obj: Any, should_abort: Callable[[], bool] | None = None, timeout_s: float | None = None
    ) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        ring, h = self._ring, self.handle
        m = self._written + 1
        slot = (m - 1) % h.num_slots
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        spins = 0
        while int(ring.read.min()) < m - h.num_slots:  # some reader has not consumed this slot yet
            spins += 1
            if spins % 64 == 0 and (
                (should_abort is not None and should_abort())
                or (deadline is not None and time.monotonic() > deadline)
            ):
                raise BroadcastClosed("broadcast aborted: a reader stopped consuming messages")
            _backoff(spins)
        _fence()
        overflow = len(data) > h.slot_bytes
        if overflow:
            if not self._sockets:
                raise ValueError(f"message of {len(data)} bytes exceeds the slot size {h.slot_bytes}")
            ring.length[slot] = _OVERFLOW | np.uint64(len(data))
        else:
            ring.payload(slot)[: len(data)] = data
            ring.length[slot] = len(data)
        _fence()
        ring.seq[slot] = m
        self._written = m
        if overflow:
            for sock in self._sockets:
                sock.send_bytes(data)

    def close(self) -> None:
        """Release and remove the shared block (readers keep their mapping until they close). Idempotent."""
        if self._ring.read is None:
            return
        shm = self._ring.shm
        self._ring.release()
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


class BroadcastReader:
    def __init__(self, handle: RingHandle, reader_index: int, overflow_socket: Connection | None) -> None:
        self.handle = handle
        self.index = reader_index
        self._ring = _Ring(handle, shared_memory.SharedMemory(name=handle.shm_name))
        self._socket = overflow_socket
        self._consumed = int(self._ring.read[reader_index])

    def dequeue(self) -> Any:
        ring, h = self._ring, self.handle
        m = self._consumed + 1
        slot = (m - 1) % h.num_slots
        spins = 0
        while int(ring.seq[slot]) != m:
            spins += 1
            _backoff(spins)
        _fence()
        length = ring.length[slot]
        if length & _OVERFLOW:
            if self._socket is None:
                raise RuntimeError("a large message came through the socket, but this reader has none")
            data: bytes | memoryview = self._socket.recv_bytes()
            obj = pickle.loads(data)
        else:
            obj = pickle.loads(ring.payload(slot)[: int(length)])
        _fence()
        ring.read[self.index] = m
        self._consumed = m
        return obj

    def close(self) -> None:
        self._ring.release()
