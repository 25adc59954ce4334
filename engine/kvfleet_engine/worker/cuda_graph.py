"""Decode steps replayed from captured CUDA graphs, one graph per batch-size bucket.

A decode step of a small model is launch-bound: hundreds of small kernels whose launch costs more than
their work. Capturing the forward pass once per batch size and replaying it launches it all at once.

How a step runs (``DecodeGraphs.run``):

1. The step's ``n`` decode rows are copied into the first ``n`` rows of static buffers (token ids,
   positions, KV slots, context lengths, block tables) that every graph reads.
2. Rows ``n .. bucket`` are padding: token 0 at position 0, writing its K/V into slot 0 (the null
   block, never handed to a request), attending over a context of 1 through block 0. Their hidden
   states are computed and thrown away.
3. The smallest captured bucket ``>= n`` is replayed; its output buffer's first ``n`` rows are the
   step's hidden states (the LM head and sampler run eagerly on them).

Invariants:

- Only pure-decode steps with ``n <= max bucket`` take this path (``can_run``); prefills, mixed steps
  and larger batches run eagerly.
- A captured graph holds the addresses of the weights, the KV cache and the static buffers. Anything
  that moves them (sleep, waking the KV cache, reloading weights) must ``release()`` the graphs first
  and ``capture()`` again once everything is back.
- The captured function derives everything from the static buffers' *contents* on device; no Python
  decision in the model may depend on a value that changes between replays.

The capture mechanism is a parameter (``capture_fn``) so that everything but the CUDA calls runs on
the CPU in tests: there, "capturing" keeps the function and "replay" calls it again on the static
buffers, which exercises the bucketing, padding and static-buffer bookkeeping end to end.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from kvfleet_engine.forward_context import AttentionMetadata, set_attn_metadata
from kvfleet_engine.ops.attention_torch import TorchAttentionPlan

# capture_fn(fn) -> replay: runs ``fn`` under capture and returns a callable that replays it and
# returns what ``fn`` returned (the same output tensor on CUDA, whose contents each replay rewrites).
CaptureFn = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, and ``max_num_seqs`` itself.

    Padding a batch to its bucket wastes at most 15 rows (< 7 % at 256) while keeping the number of
    graphs (and the capture time and memory) small.
    """
    sizes = {s for s in (1, 2, 4, 8) if s <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def eager_capture(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The CPU stand-in for capture: replaying is calling ``fn`` again on the static buffers."""
    fn()  # run it once, as a capture would
    return fn


class CudaGraphCapture:
    """Captures with ``torch.cuda.CUDAGraph`` into one memory pool shared by every bucket (captured
    largest first, so smaller graphs reuse the largest one's activation memory)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Warm-up outside the graph: lazy initialisation (Triton autotuning and compilation, cuBLAS
        # handles and workspaces) must not happen during capture.
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    def release(self) -> None:
        self.graphs.clear()
        self.pool = None


class DecodeGraphs:
    """Static buffers and one replayable forward per bucket (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attention_backend: str,
        max_num_seqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        capture_fn: CaptureFn,
        release_fn: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size = block_size
        self.capture_fn = capture_fn
        self.release_fn = release_fn
        b, m = self.sizes[-1], max_blocks_per_req
        # Host staging (pinned on CUDA so one non-blocking copy per buffer feeds the device).
        pin = device.type == "cuda"
        self.host_ids = torch.zeros(b, dtype=torch.int64, pin_memory=pin)
        self.host_positions = torch.zeros(b, dtype=torch.int64, pin_memory=pin)
        self.host_slots = torch.zeros(b, dtype=torch.int64, pin_memory=pin)
        self.host_seq_lens = torch.ones(b, dtype=torch.int32, pin_memory=pin)
        self.host_block_tables = torch.zeros((b, m), dtype=torch.int32, pin_memory=pin)
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(b, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((b, m), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        # Host rows holding a request's values (from the last step); every row after them is padding.
        self._live_rows = 0

    @property
    def captured(self) -> bool:
        return bool(self._replays)

    def can_run(self, num_reqs: int, num_tokens: int) -> bool:
        """A pure-decode step (one token per request) that fits the largest bucket, once captured."""
        return self.captured and num_reqs == num_tokens and 0 < num_reqs <= self.sizes[-1]

    def bucket(self, num_reqs: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    # ---- capture ---------------------------------------------------------------------------------

    def _forward(self, size: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            seq_lens = self.seq_lens[:size]
            block_tables = self.block_tables[:size]
            plan = None
            if self.attention_backend == "torch":
                # The torch backend's decode plan, built on device from the static buffers.
                width = block_tables.shape[1] * self.block_size
                mask = torch.arange(width, device=seq_lens.device)[None, :] < seq_lens[:, None]
                plan = TorchAttentionPlan(size, block_tables.long(), mask[:, None, None, :], [])
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=seq_lens,
                block_tables=block_tables,
                max_query_len=1,
                max_seq_len=block_tables.shape[1] * self.block_size,
                num_decodes=size,
                plan=plan,
            )
            with set_attn_metadata(meta):
                return self.model(self.input_ids[:size], self.positions[:size])

        return run

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the static buffers hold padding: a valid no-op step)."""
        self.release()
        self._reset_static_rows(0, self.sizes[-1])
        self._live_rows = 0
        self._copy_to_device(self.sizes[-1], self.block_tables.shape[1])
        for size in reversed(self.sizes):
            self._replays[size] = self.capture_fn(self._forward(size))

    def release(self) -> None:
        """Forget every graph (before the weights or KV cache they point into move or go away)."""
        self._replays.clear()
        if self.release_fn is not None:
            self.release_fn()

    # ---- replay ----------------------------------------------------------------------------------

    def _reset_static_rows(self, start: int, end: int) -> None:
        self.host_ids[start:end] = 0
        self.host_positions[start:end] = 0
        self.host_slots[start:end] = 0
        self.host_seq_lens[start:end] = 1
        self.host_block_tables[start:end, 0] = 0

    def _copy_to_device(self, rows: int, cols: int) -> None:
        for src, dst in (
            (self.host_ids, self.input_ids),
            (self.host_positions, self.positions),
            (self.host_slots, self.slot_mapping),
            (self.host_seq_lens, self.seq_lens),
        ):
            dst[:rows].copy_(src[:rows], non_blocking=True)
        self.block_tables[:rows, :cols].copy_(self.host_block_tables[:rows, :cols], non_blocking=True)

    def run(
        self,
        token_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        feed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of one decode step of ``n = len(token_ids)`` rows.

        ``feed`` (rows, token ids on the device) overrides those rows' input ids after the host copy: the
        tokens the previous step is still sampling (async scheduling).

        ``block_tables`` is ``[n, w]``: the columns the step's longest context needs. Columns past a
        row's context are never read, so stale ones from earlier steps may stay; a padding row reads
        column 0 only. The host staging buffers are rewritten only after the previous step's sampled
        tokens were read back, which waited for its copies, so a non-blocking copy never races.
        """
        n = len(token_ids)
        size = self.bucket(n)
        w = block_tables.shape[1]
        self.host_ids[:n] = torch.from_numpy(token_ids)
        self.host_positions[:n] = torch.from_numpy(positions)
        self.host_slots[:n] = torch.from_numpy(slots)
        self.host_seq_lens[:n] = torch.from_numpy(seq_lens)
        self.host_block_tables[:n, :w] = torch.from_numpy(block_tables)
        # Invariant: host rows from _live_rows on are padding. Rows a larger earlier step used go back.
        if self._live_rows > n:
            self._reset_static_rows(n, self._live_rows)
        self._live_rows = n
        self._copy_to_device(size, w)
        if feed is not None:
            self.input_ids[feed[0]] = feed[1]
        return self._replays[size]()[:n]
