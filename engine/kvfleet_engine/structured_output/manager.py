"""Structured outputs in the engine core: compiles grammars off the step loop, fills each step's bitmask.

Lifecycle of a constrained request (all on the core's thread except the compile itself):

1. ``Scheduler.add_request`` asks ``grammar_for(params)``: the compile is queued on a worker thread
   (llguidance releases the GIL while it builds a grammar) or found in the cache. The request waits
   outside the scheduling queue until its grammar is ready, so a slow compile never stalls a step.
2. Once ready, the request gets its own matcher: a copy of the cached, never-advanced template
   (``RequestGrammar.resolve``). A grammar that failed to compile ends the request with the error.
3. Each step, ``fill_bitmask`` writes one row of allowed tokens per constrained request that samples in
   that step; the model runner sets every other logit to ``-inf`` before the sampler.
4. Every accepted token advances the matcher (``RequestGrammar.accept``). Preemption discards no
   token (recompute replays them as prompt), so the matcher needs no rollback there; ``rollback`` is
   for callers that discard accepted tokens.

Invariant: a matcher has consumed exactly the request's output tokens.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from kvfleet_engine.structured_output.backend import GrammarCompiler, GrammarError
from kvfleet_engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Rows filled one after another below this; with more, llguidance's thread pool fills them in parallel.
_PARALLEL_FILL_MIN_ROWS = 8


class RequestGrammar:
    """One request's constraint: its compile future, then its own matcher."""

    __slots__ = ("error", "future", "matcher", "num_accepted", "params")

    def __init__(self, params: StructuredOutputsParams, future: Future) -> None:
        self.params = params
        self.future = future
        self.matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None
        self.num_accepted = 0

    def ready(self) -> bool:
        return self.future.done()

    def resolve(self) -> bool:
        """Take the compiled grammar (call once ``ready``). False if it failed (``error`` says why)."""
        try:
            self.matcher = self.future.result().deep_copy()
        except GrammarError as e:
            self.error = str(e)
        except Exception as e:  # a library failure: still the request's end, not the engine's
            logger.exception("grammar compile failed")
            self.error = f"structured_outputs could not be compiled: {type(e).__name__}: {e}"
        return self.error is None

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over tokens the request accepted. False if the grammar refuses them."""
        ok = self.matcher.consume_tokens(token_ids)
        if ok:
            self.num_accepted += len(token_ids)
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def is_terminated(self) -> bool:
        """The grammar is complete: nothing but EOS could follow, so the request is done."""
        return self.matcher.is_stopped()

    def violation(self) -> str:
        return self.matcher.get_error() or "the token is not allowed by the grammar"


class StructuredOutputManager:
    def __init__(self, compiler: GrammarCompiler, cache_size: int = 256) -> None:
        self.compiler = compiler
        self.bitmask_width = (compiler.vocab_size + 31) // 32
        self.cache_size = cache_size
        # cache key -> future of a template matcher (never advanced); failures are cached too.
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.num_compiles = 0  # distinct grammars compiled (cache misses)
        self.compile_seconds = 0.0  # total time the compile thread spent on them

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        key = params.cache_key
        future = self._compiled.get(key)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-grammar")
            future = self._pool.submit(self._compile, params)
            self._compiled[key] = future
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return RequestGrammar(params, future)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        t0 = time.perf_counter()
        try:
            return self.compiler.compile(params)
        finally:
            self.num_compiles += 1
            self.compile_seconds += time.perf_counter() - t0

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """[len(grammars), ceil(vocab / 32)] int32: bit t of row i set iff token t is allowed next."""
        bitmask = np.empty((len(grammars), self.bitmask_width), dtype=np.int32)
        row_bytes = self.bitmask_width * 4
        if len(grammars) < _PARALLEL_FILL_MIN_ROWS:
            base = bitmask.ctypes.data
            for i, g in enumerate(grammars):
                g.matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(g.matcher, i) for i, g in enumerate(grammars)],
                bitmask.ctypes.data,
                row_bytes,
                len(grammars),
            )
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
