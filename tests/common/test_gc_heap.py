"""freeze_long_lived: what is alive is moved out of the collector's reach, what is garbage is collected first."""

from __future__ import annotations

import gc
import weakref

from kvfleet_common.server_kit import gc_heap
from kvfleet_common.server_kit.gc_heap import freeze_long_lived


class Node:
    other: Node | None = None


def test_freeze_collects_garbage_then_moves_live_objects_out_of_collection(monkeypatch):
    live = [Node() for _ in range(1000)]
    a, b = Node(), Node()
    a.other, b.other = b, a  # a reference cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    before = gc.get_freeze_count()
    assert freeze_long_lived("not a server process") is None and gc.get_freeze_count() == before
    monkeypatch.setattr(gc_heap, "_server_process", True)
    try:
        frozen = freeze_long_lived("test")
        assert dead() is None  # collected, not frozen forever
        assert frozen == gc.get_freeze_count() >= before + len(live)
        tracked = {id(o) for o in gc.get_objects()}  # every generation a collection walks
        assert id(live[0]) not in tracked and id(live[-1]) not in tracked
    finally:
        gc.unfreeze()
    assert id(live[0]) in {id(o) for o in gc.get_objects()}
