"""Turns a SchedulerOutput into one forward pass and one sampled token per finished-prefill request."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from kvfleet_engine.distributed import StageLink, get_parallel_state
from kvfleet_engine.forward_context import AttentionMetadata, set_attn_metadata
from kvfleet_engine.layers import prepack
from kvfleet_engine.layers.attention import Attention
from kvfleet_engine.layers.sampler import Sampler
from kvfleet_engine.models.architectures import get_model_class
from kvfleet_engine.models.loader import load_weights
from kvfleet_engine.ops import attention_cpu
from kvfleet_engine.ops.attention_torch import make_plan
from kvfleet_engine.structured_output.bitmask import apply_token_bitmask
from kvfleet_engine.worker.cuda_graph import CaptureFn, CudaGraphCapture, DecodeGraphs
from kvfleet_engine.worker.input_batch import CachedRequestState, InputBatch, new_request_state
from kvfleet_engine.worker.prompt_logprobs import compute_prompt_logprobs, plan_prompt_logprobs

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepArrays:
    """One step's model inputs on the host, rows ordered decodes first."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64 KV cache slot of each new token
    query_start_loc: np.ndarray  # [B+1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, blocks the longest context needs] int32, contiguous
    logits_idx: np.ndarray  # [B] int64: the token whose logits row b samples from, in batch-row order
    num_decodes: int
    max_query_len: int


@dataclass(slots=True)
class PendingStep:
    """A launched step (``ModelRunner.launch``) whose sampled tokens ``finish`` has not read yet."""

    req_ids: list[str]  # the batch's rows at launch
    rows: np.ndarray  # the rows that sample (the others ran a partial prefill chunk)
    host: (
        torch.Tensor
    )  # [B] sampled ids on the host (async on CUDA: a pinned copy, valid once ``copied`` is done)
    copied: torch.cuda.Event | None
    logprobs: object  # the sampler's LogprobsTensors, or None
    launch: int  # the runner's launch count when it was launched
    prompt_logprobs: dict | None = None
    started: float = 0.0


def zeroed_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it comes from ``calloc`` (through numpy), which hands large
    allocations over as fresh zero pages without writing them: gigabytes of KV cache are ready at
    once (waking from sleep stays fast) and pages are touched only as blocks are first used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    raw = np.zeros(math.prod(shape) * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, use_tqdm: bool = True) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_blocks_per_req = -(-config.max_model_len // config.block_size)
        self.model = self._load_model(use_tqdm)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in self.attn_layers:
            layer.backend = config.attention_backend
        self.sampler = Sampler()
        self.use_c_decode = (
            config.attention_backend == "torch"
            and self.device.type == "cpu"
            and config.dtype == torch.float32
            and attention_cpu.available()
        )
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.batch = InputBatch(
            config.max_num_seqs,
            config.max_model_len,
            self.max_blocks_per_req,
            config.model.vocab_size,
            self.device,
        )
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        # Every running request's state, including ones not scheduled (so not in the batch) this step.
        self.requests: dict[str, CachedRequestState] = {}
        self.parallel = get_parallel_state()
        # Under pipeline parallelism only the last stage samples: every stage instead learns the
        # sampled tokens from the executor (``new_token_ids``) before the request's next step.
        self.append_sampled = self.parallel.pp_size == 1
        self.stage_link = StageLink() if self.parallel.pp_size > 1 else None
        # (start, end) perf_counter times of this worker's compute per step (not waiting for input).
        self.busy_intervals: deque[tuple[float, float]] = deque(maxlen=4096)
        # Decode steps replayed from CUDA graphs (None: every step runs eagerly). Captured once the KV
        # cache exists (``capture_graphs``). TP/PP steps stay eager: capturing their collectives and
        # stage transfers has not been verified on a multi-GPU machine yet.
        self.graphs: DecodeGraphs | None = None
        self.graph_steps = 0  # decode steps that replayed a graph (tests and benchmarks read it)
        # Async scheduling: the last launched step's sampled ids on the device and each request's row in
        # them (the next launch may decode them before the host has them); pinned host buffers for the
        # sampled ids of the two steps that can be in flight at once.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._launches = 0
        self._pinned: list[torch.Tensor] = []
        if (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.parallel.tp_size == 1
            and self.parallel.pp_size == 1
        ):
            self.use_decode_graphs(CudaGraphCapture(self.device))

    def use_decode_graphs(self, capture_fn: CaptureFn) -> None:
        """Replay decode steps from graphs captured with ``capture_fn`` (captured with the KV cache).

        On CUDA that is ``CudaGraphCapture``; tests on the CPU pass ``cuda_graph.eager_capture``."""
        release = capture_fn.release if isinstance(capture_fn, CudaGraphCapture) else None
        self.graphs = DecodeGraphs(
            self.model, self.config.attention_backend, self.config.max_num_seqs, self.max_blocks_per_req,
            self.block_size, self.device, capture_fn, release,
        )  # fmt: skip
        if self.kv_caches:
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """(Re)capture the decode graphs over the current weights and KV cache."""
        if self.graphs is None:
            return
        t0 = time.perf_counter()
        self.graphs.capture()
        logger.info(
            "captured decode graphs for %d batch sizes (up to %d) in %.2fs",
            len(self.graphs.sizes), self.graphs.sizes[-1], time.perf_counter() - t0,
        )  # fmt: skip

    @torch.inference_mode()
    def warm_up(self, force: bool = False) -> None:
        """Run every kernel variant a step can need once, before the first request.

        Triton compiles a kernel variant the first time it is launched (about a second each, on the engine's
        thread): left to the first requests, it stalls their steps by seconds. On CUDA only (``force`` runs
        it on any device, for tests): a mixed step (one decode row, two prefills) through the whole model,
        single-GPU only (a TP/PP forward needs its peers in step), then the decode kernel with every split
        count it can choose. Every K/V write goes to slot 0 of the null block, which no request owns.
        """
        if self.device.type != "cuda" and not force:
            return
        t0 = time.perf_counter()
        if self.parallel.tp_size == 1 and self.parallel.pp_size == 1:
            q_lens = np.array([1, 2, 3], dtype=np.int32)
            cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            step = StepArrays(
                token_ids=np.zeros(int(cu[-1]), dtype=np.int64),
                positions=np.concatenate([np.arange(q) for q in q_lens]).astype(np.int64),
                slots=np.zeros(int(cu[-1]), dtype=np.int64),
                query_start_loc=cu,
                seq_lens=q_lens.copy(),
                block_tables=np.zeros((len(q_lens), 1), dtype=np.int32),
                logits_idx=(cu[1:] - 1).astype(np.int64),
                num_decodes=1,
                max_query_len=int(q_lens.max()),
            )
            input_ids, positions, meta, logits_idx = self._device_inputs(step)
            with set_attn_metadata(meta):
                hidden = self.model(input_ids, positions, None)
            self.model.compute_logits(hidden[logits_idx]).argmax(dim=-1)
        if self.config.attention_backend == "triton":
            from kvfleet_engine.ops import attention_triton

            layer = self.attn_layers[0]
            q = torch.zeros((1, layer.num_heads, layer.head_dim), dtype=self.config.dtype, device=self.device)
            seq_lens = torch.ones(1, dtype=torch.int32, device=self.device)
            tables = torch.zeros((1, self.max_blocks_per_req), dtype=torch.int32, device=self.device)
            for splits in attention_triton.decode_split_counts(self.max_blocks_per_req * self.block_size):
                attention_triton.decode_attention(
                    q, layer.k_cache, layer.v_cache, seq_lens, tables, layer.scale, num_splits=splits
                )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("warmed up the step's kernels in %.2fs", time.perf_counter() - t0)

    def release_graphs(self) -> None:
        """Drop the graphs (they point into the weights and KV cache, which are about to move)."""
        if self.graphs is not None:
            self.graphs.release()

    def _load_model(self, use_tqdm: bool) -> torch.nn.Module:
        cfg = self.config
        t0 = time.perf_counter()
        cls = get_model_class(cfg.model)
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(cfg.dtype)
        try:
            with torch.device(self.device):
                model = cls(cfg.model)
        finally:
            torch.set_default_dtype(prev_dtype)
        load_weights(model, cfg.model.path, use_tqdm=use_tqdm)
        model.eval()
        packed = self.prepack_weights(model)
        logger.info(
            "loaded %s (%s) in %.2fs%s",
            cfg.model.path,
            cfg.model.architecture,
            time.perf_counter() - t0,
            f", {packed} matmul weights prepacked for oneDNN" if packed else "",
        )
        return model

    def prepack_weights(self, model: torch.nn.Module | None = None) -> int:
        """(Re)build the CPU matmul packs from the current weights (see layers/prepack.py)."""
        model = self.model if model is None else model
        if not prepack.prepack_supported(self.device, self.config.dtype):
            return 0
        return prepack.prepack(model)

    # ---- KV cache ------------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        layer0 = self.attn_layers[0]
        shape = (num_blocks, self.block_size, layer0.num_kv_heads, m.head_dim)
        self.kv_caches = []
        for layer in self.attn_layers:
            # Zeroed, not empty: masked-out slots must never hold NaN/Inf that 0 * x would spread.
            k = zeroed_tensor(shape, self.config.dtype, self.device)
            v = zeroed_tensor(shape, self.config.dtype, self.device)
            layer.k_cache, layer.v_cache = k, v
            self.kv_caches.append((k, v))
        self.num_blocks = num_blocks

    @property
    def kv_bytes_per_block(self) -> int:
        """KV bytes one block takes on this worker (its own layers and KV heads only)."""
        elem = torch.tensor([], dtype=self.config.dtype).element_size()
        per_layer = sum(layer.num_kv_heads for layer in self.attn_layers) * self.config.model.head_dim
        return 2 * self.block_size * per_layer * elem

    def free_kv_cache(self) -> None:
        """Drop every reference to the cache tensors so their storage is released."""
        self.release_graphs()
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_caches = []

    # ---- one step ------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        batch = self.batch
        # Sorted: set order differs between processes (string hashing is salted per process), and
        # the removal order decides which rows later requests take. Tensor-parallel ranks must lay
        # out their batches identically, or their all-reduces would add up different requests.
        for rid in sorted(sched.finished_req_ids | sched.preempted_req_ids):
            batch.remove_request(rid)
            self.requests.pop(rid, None)
        # Running requests that got no tokens this step leave the batch but keep their state.
        for rid in list(batch.req_id_to_index):
            if rid not in sched.num_scheduled_tokens:
                batch.remove_request(rid)
        for c in sched.scheduled_cached_reqs:
            i = batch.req_id_to_index.get(c.req_id)
            if i is None:
                state = self.requests[c.req_id]
                state.block_ids.extend(c.new_block_ids)
                state.num_computed_tokens = c.num_computed_tokens
                batch.add_request(state)
            else:
                batch.append_block_ids(i, c.new_block_ids)
                batch.num_computed_tokens[i] = c.num_computed_tokens
                batch.states[i].num_computed_tokens = c.num_computed_tokens
        for r in sched.scheduled_new_reqs:
            state = new_request_state(
                r.req_id, r.prompt_token_ids, r.output_token_ids, r.sampling_params, r.block_ids,
                r.num_computed_tokens, r.stop_token_ids, self.device,
            )  # fmt: skip
            self.requests[r.req_id] = state
            batch.add_request(state)
        batch.condense()

    def _append_new_tokens(self, new_token_ids: dict[str, list[int]]) -> None:
        """Tokens sampled since this worker last heard of the request (by the last pipeline stage, or by an
        earlier step whose rows a later launch has moved), appended wherever the request's state now is."""
        for rid, tokens in new_token_ids.items():
            state = self.requests.get(rid)
            if state is None:
                continue  # finished or preempted meanwhile
            i = self.batch.req_id_to_index.get(rid)
            for tok in tokens:
                if i is None:
                    state.output_token_ids.append(tok)
                else:
                    self.batch.append_token(i, tok)

    @torch.inference_mode()
    def execute_model(
        self, sched: SchedulerOutput, new_token_ids: dict[str, list[int]] | None = None
    ) -> ModelRunnerOutput | None:
        """One step; returns None on a pipeline stage that is not the last (it sends, not samples)."""
        launched = self.launch(sched, new_token_ids)
        return self.finish(launched) if isinstance(launched, PendingStep) else launched

    @torch.inference_mode()
    def launch(
        self, sched: SchedulerOutput, new_token_ids: dict[str, list[int]] | None = None
    ) -> PendingStep | ModelRunnerOutput | None:
        """Queue one step's forward pass and sampling on the device; ``finish`` waits for its tokens.

        Under async scheduling the step may run decode rows whose input token is the one the previous
        launched step samples (the scheduler ran ahead of it): that token is not on the host yet, so the
        row's input id is taken on the device from the previous step's sampled ids. The host learns it in
        ``finish`` of that step, which comes after this launch."""
        if new_token_ids:
            self._append_new_tokens(new_token_ids)
        self._update_states(sched)
        self._launches += 1
        batch, n = self.batch, self.batch.num_reqs
        if n == 0:
            return ModelRunnerOutput([], [])
        q_lens = np.array([sched.num_scheduled_tokens[batch.req_ids[i]] for i in range(n)], dtype=np.int32)
        step = self._step_arrays(q_lens)
        feed = self._feed_pending_tokens(step)
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(n, len(step.token_ids)):
            # Pure decode: rows are in batch order, so the hidden states are the logits' rows as-is.
            hidden = self.graphs.run(
                step.token_ids, step.positions, step.slots, step.seq_lens, step.block_tables, feed
            )
            self.graph_steps += 1
            logits = self.model.compute_logits(hidden)
        else:
            input_ids, positions, meta, logits_idx = self._device_inputs(step)
            if feed is not None:
                input_ids[feed[0]] = feed[1]
            intermediate = None
            if not self.parallel.is_first_stage:
                shape = (2, int(input_ids.shape[0]), self.config.model.hidden_size)
                intermediate = self.stage_link.recv(shape, self.config.dtype, self.device)
                t0 = time.perf_counter()
            with set_attn_metadata(meta):
                hidden = self.model(input_ids, positions, intermediate)
            if not self.parallel.is_last_stage:
                self.stage_link.send(hidden)
                self.busy_intervals.append((t0, time.perf_counter()))
                return None
            logits = self.model.compute_logits(hidden[logits_idx])
        # Prompt logprobs of the prompt positions this step ran (only rows that asked; a graph step's
        # rows are single tokens in batch order, which the plan's row arithmetic covers too).
        plan = plan_prompt_logprobs(self.batch, q_lens, step.logits_idx)
        prompt_logprobs = None
        if plan is not None:
            prompt_logprobs = compute_prompt_logprobs(self.model, hidden, plan, self.config.model.vocab_size)
        pending = self._sample(logits, q_lens, sched)
        pending.prompt_logprobs = prompt_logprobs
        pending.started = t0
        return pending

    def _feed_pending_tokens(self, step: StepArrays) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, their ids on the device) for rows whose input token is still being sampled.

        Such a row has computed every token the host knows (``num_computed == num_tokens``): it decodes
        the token the previous launch samples. Its index in the step is its logits row (one token)."""
        batch, n = self.batch, self.batch.num_reqs
        rows = np.flatnonzero(batch.num_computed_tokens[:n] >= batch.num_tokens[:n])
        if not len(rows):
            return None
        last = self._last_sampled
        if last is None:
            raise RuntimeError("a step decodes a token no earlier step sampled")
        sampled, row_of = last
        src = torch.tensor([row_of[batch.req_ids[i]] for i in rows.tolist()], device=self.device)
        dst = torch.from_numpy(step.logits_idx[rows]).to(self.device)
        return dst, sampled.index_select(0, src)

    def finish(self, pending: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled tokens, append them to their requests, build its output.

        Rows may have moved since the launch (a later launch rearranged the batch): then each token goes
        to its request by id, to its state if it left the batch, or nowhere if it finished meanwhile."""
        if pending.copied is not None:
            pending.copied.synchronize()
        sampled = pending.host.numpy()
        rows = pending.rows
        if self.append_sampled:
            batch = self.batch
            if pending.launch == self._launches:  # no launch since: rows are where they were
                batch.append_tokens(rows, sampled[rows])
            else:
                self._append_new_tokens({pending.req_ids[i]: [int(sampled[i])] for i in rows.tolist()})
        if len(rows) == len(pending.req_ids):
            sampled_lists = [[t] for t in sampled.tolist()]
        else:
            sampled_lists = [[] for _ in pending.req_ids]
            for i, t in zip(rows.tolist(), sampled[rows].tolist()):
                sampled_lists[i] = [t]
        result = ModelRunnerOutput(pending.req_ids, sampled_lists)
        logprobs = pending.logprobs
        if logprobs is not None:
            result.logprob_token_ids = logprobs.token_ids.tolist()
            result.logprobs = logprobs.logprobs.tolist()
            result.sampled_ranks = logprobs.ranks.tolist()
        result.prompt_logprobs = pending.prompt_logprobs
        self.busy_intervals.append((pending.started, time.perf_counter()))
        return result

    def _step_arrays(self, q_lens: np.ndarray) -> StepArrays:
        """This step's inputs as host arrays, rows ordered decodes first (the attention backends batch
        decodes separately from prefills)."""
        batch, n, bs = self.batch, len(q_lens), self.block_size
        computed = batch.num_computed_tokens[:n]
        is_decode = q_lens == 1
        num_decodes = int(is_decode.sum())
        if num_decodes == n:
            order = np.arange(n)
            q_o = q_lens
        else:
            order = np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)])
            q_o = q_lens[order]
        cu = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(q_o, out=cu[1:])
        rows = np.repeat(order, q_o)
        positions = np.repeat(computed[order] - cu[:-1], q_o) + np.arange(int(cu[-1]), dtype=np.int32)
        seq_lens = (computed[order] + q_o).astype(np.int32)
        # Logits of each row's last scheduled token, in batch-row order (what the sampler indexes).
        logits_idx = np.empty(n, dtype=np.int64)
        logits_idx[order] = cu[1:] - 1
        return StepArrays(
            token_ids=batch.token_ids[rows, positions].astype(np.int64),
            positions=positions.astype(np.int64),
            slots=batch.block_table[rows, positions // bs].astype(np.int64) * bs + positions % bs,
            query_start_loc=cu,
            seq_lens=seq_lens,
            block_tables=np.ascontiguousarray(batch.block_table[order, : -(-int(seq_lens.max()) // bs)]),
            logits_idx=logits_idx,
            num_decodes=num_decodes,
            max_query_len=int(q_o.max()),
        )

    def _device_inputs(self, step: StepArrays):
        """Token ids, positions, attention metadata and logits indices of an eager step, on the device."""
        dev = self.device
        plan = None
        if self.config.attention_backend == "torch":
            plan = make_plan(
                step.query_start_loc, step.seq_lens, step.block_tables, step.num_decodes, self.block_size,
                dev, self.use_c_decode,
            )  # fmt: skip
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(step.slots).to(dev),
            query_start_loc=torch.from_numpy(step.query_start_loc).to(dev),
            seq_lens=torch.from_numpy(step.seq_lens).to(dev),
            block_tables=torch.from_numpy(step.block_tables).to(dev),
            max_query_len=step.max_query_len,
            max_seq_len=int(step.seq_lens.max()),
            num_decodes=step.num_decodes,
            plan=plan,
        )
        return (
            torch.from_numpy(step.token_ids).to(dev),
            torch.from_numpy(step.positions).to(dev),
            meta,
            torch.from_numpy(step.logits_idx).to(dev),
        )

    def _sample(self, logits: torch.Tensor, q_lens: np.ndarray, sched: SchedulerOutput) -> PendingStep:
        batch, n = self.batch, len(q_lens)
        if sched.grammar_bitmask is not None:
            rows = [batch.req_id_to_index[rid] for rid in sched.structured_req_ids]
            apply_token_bitmask(logits, sched.grammar_bitmask, rows)
        # Rows still mid-prefill sample nothing; their seeded generators must not advance either.
        completes = batch.num_computed_tokens[:n] + q_lens >= batch.num_tokens[:n]
        saved = {}
        for i in np.flatnonzero(~completes & batch.seeded[:n]).tolist():
            saved[i] = batch.states[i].generator.get_state()
        out = self.sampler(logits, batch.sampling_metadata(self.generator))
        for i, state in saved.items():
            batch.states[i].generator.set_state(state)

        req_ids = batch.req_ids[:n]
        rows = np.arange(n) if completes.all() else np.flatnonzero(completes)
        sampled = out.sampled_token_ids
        self._last_sampled = (sampled, {req_ids[i]: i for i in rows.tolist()})
        copied = None
        if sampled.device.type == "cuda" and self.config.async_scheduling:
            # The step's one device -> host copy, waited for in ``finish``, not here.
            if not self._pinned:
                size = self.config.max_num_seqs
                self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            host = self._pinned[self._launches % 2][: sampled.shape[0]]
            host.copy_(sampled, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = sampled.cpu()  # step by step: the step's one device -> host sync, here
        return PendingStep(list(req_ids), rows, host, copied, out.logprobs, self._launches)
