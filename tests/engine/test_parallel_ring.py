"""The shared-memory broadcast ring: every reader gets every message, in order, whatever its size."""

from __future__ import annotations

import threading
from multiprocessing import Pipe

import pytest

from kvfleet_engine.executor.shm_broadcast import BroadcastClosed, BroadcastReader, BroadcastWriter


def _messages(n: int) -> list[object]:
    # Mostly small; every 7th is larger than a slot and must take the socket path.
    return [{"i": i, "blob": bytes([i % 256]) * (3000 if i % 7 == 0 else 10)} for i in range(n)]


def test_readers_get_every_message_in_order_across_wraparound_and_overflow():
    num_readers, sent = 3, _messages(100)
    writer = BroadcastWriter(num_readers, num_slots=4, slot_bytes=1024)
    pairs = [Pipe(duplex=True) for _ in range(num_readers)]
    writer.set_overflow_sockets([a for a, _ in pairs])
    received: list[list[object]] = [[] for _ in range(num_readers)]

    def read(index: int) -> None:
        reader = BroadcastReader(writer.handle, index, pairs[index][1])
        for _ in sent:
            received[index].append(reader.dequeue())
        reader.close()

    threads = [threading.Thread(target=read, args=(r,)) for r in range(num_readers)]
    for t in threads:
        t.start()
    for msg in sent:  # 100 messages through 4 slots: the writer waits for the slowest reader
        writer.enqueue(msg)
    for t in threads:
        t.join(30)
    writer.close()
    assert all(r == sent for r in received)


def test_writer_gives_up_when_a_reader_stops_consuming():
    writer = BroadcastWriter(2, num_slots=2, slot_bytes=256)
    reader = BroadcastReader(writer.handle, 0, None)
    try:
        for i in range(2):
            writer.enqueue(i)
        assert reader.dequeue() == 0
        # Reader 1 never reads: the ring is full, so the third message cannot be written.
        with pytest.raises(BroadcastClosed):
            writer.enqueue(2, timeout_s=0.2)
    finally:
        reader.close()
        writer.close()


def test_oversized_message_without_sockets_is_a_clear_error():
    writer = BroadcastWriter(1, num_slots=2, slot_bytes=64)
    try:
        with pytest.raises(ValueError, match="exceeds the slot size"):
            writer.enqueue(b"x" * 500)
    finally:
        writer.close()
