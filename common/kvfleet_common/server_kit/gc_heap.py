"""Short garbage collections for long-running servers: freeze the heap that start-up built.

A full (generation-2) collection walks every object the collector tracks. Once torch and transformers are
imported a process tracks ~380,000 objects that live as long as the process (modules, classes, functions,
the tokenizer), and each full collection took 100-150 ms on a 2-core machine. Under load, request objects
that outlive two young collections (a stream open for a few hundred ms does) are promoted until a full
collection runs: the gateway ran one or two per second at 100 streams, each stalling its event loop, and
with it every stream, for 40-130 ms (``bench/gateway_overhead.py``).

``gc.freeze()`` moves every object alive now into a permanent generation that collections skip, so a full
collection only walks what was allocated since. Call :func:`freeze_long_lived` once start-up is done and
after later one-off loads that add long-lived objects (the gateway's tokenizer of a new model). Garbage
already unreachable is collected first, so nothing dead is frozen; objects frozen and later released are
still freed by reference counting, only cycles among them stay until exit (start-up state rarely forms
new garbage cycles).

Freezing is a decision for the whole process, so it only happens in processes that exist to serve: the
CLI entry points and the engine's spawned core and worker processes call :func:`mark_server_process`.
An app built in someone else's process (tests, an embedding application) leaves its collector alone.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


_server_process = False


def mark_server_process() -> None:
    """This process exists to serve: later :func:`freeze_long_lived` calls take effect."""
    global _server_process
    _server_process = True


def freeze_long_lived(reason: str) -> int | None:
    """Collect, then freeze everything alive (in a server process; else nothing). Returns how many
    objects are frozen in total, or None when this is not a server process."""
    if not _server_process:
        return None
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d long-lived objects out of garbage collection (%s, %.0f ms)",
                frozen, reason, (time.perf_counter() - t0) * 1000)  # fmt: skip
    return frozen
