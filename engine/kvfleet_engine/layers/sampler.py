"""Sampler: logits ``[B, V]`` -> one next token per row, with every feature of ``SamplingParams``.

It runs once per engine step, so everything is batched over rows and each stage is skipped when no
row in the batch uses it (the model runner tells us through ``SamplingMetadata``'s flags and
``None`` tensors, so skipping never needs a device -> host sync).

Order of operations (vLLM V1's):

1. logprobs shown to users: ``log_softmax`` of the *raw* logits, in float32;
2. float32 copy; ``logit_bias`` added (before anything else looks at the logits, greedy rows
   included); ``min_tokens``: stop ids banned (``-inf``) while a row is below its minimum;
3. penalties: repetition (prompt and output tokens), frequency and presence (output tokens);
4. greedy rows: argmax (done if the whole batch is greedy);
5. random rows: temperature, min_p, top_k, top_p (one sort for both), then the exponential race
   ``argmax(probs / q)``, ``q ~ Exp(1)``, where a seeded row draws ``q`` from its own generator so
   its tokens do not depend on the rest of the batch;
6. greedy and random rows merged; sampled-token logprob, top-n logprobs and rank gathered.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

# Same threshold as SamplingParams: a temperature below it is greedy.
_GREEDY_EPS = 1e-5


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (one per seeded request)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0.0 means greedy for that row
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [B] float32, None when no row uses top-p (all 1.0)
    top_k: torch.Tensor | None  # [B] int64, 0 = disabled for that row; None when no row uses it
    min_p: torch.Tensor | None  # [B] float32, None when unused
    generators: dict[int, torch.Generator]  # row index -> per-request generator (seeded requests)
    max_num_logprobs: int | None  # max top-n asked by any row; None when no row wants logprobs
    no_penalties: bool
    prompt_token_ids: torch.Tensor | None  # [B, max_prompt_len] int64 padded with V; None if no_penalties
    output_token_ids: list[list[int]]  # per row, tokens generated so far
    frequency_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    # row -> (min_tokens, stop token ids incl. EOS): banned while len(output_token_ids[row]) < min_tokens
    min_tokens: dict[int, tuple[int, frozenset[int]]]
    default_generator: torch.Generator | None = None  # rows without a seed (None: torch's global RNG)
    # (row ids, token ids, biases), one entry per biased token of every row; None when no row has a bias
    logit_bias: tuple[list[int], list[int], list[float]] | None = None


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, 1 + n] int64; column 0 = the sampled token, then the top-n
    logprobs: torch.Tensor  # [B, 1 + n] float32
    ranks: torch.Tensor  # [B] int64: rank of the sampled token (1 = most likely)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def _host_to_device(data: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor, copied without blocking the host where possible."""
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A metadata tensor on the logits' device (no-op when already there; host -> GPU is async)."""
    return t.to(device, non_blocking=device.type == "cuda")


class Sampler(torch.nn.Module):
    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        md = metadata
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        banned = self._min_tokens_bans(md, logits.shape[1])
        needs_edit = (
            banned is not None or not md.no_penalties or not md.all_greedy or md.logit_bias is not None
        )
        if not needs_edit:
            # Fast path: plain greedy batch, nothing reshapes the logits.
            sampled = logits.argmax(dim=-1)
            return SamplerOutput(sampled, self._gather_logprobs(raw_logprobs, sampled, md))

        # Our own float32 copy: everything below edits it in place.
        logits = logits.to(torch.float32, copy=True)
        if md.logit_bias is not None:
            rows, cols, biases = md.logit_bias
            index = (
                _host_to_device(rows, torch.int64, logits.device),
                _host_to_device(cols, torch.int64, logits.device),
            )
            logits.index_put_(index, _host_to_device(biases, torch.float32, logits.device), accumulate=True)
        if banned is not None:
            rows, cols = banned
            index = (
                _host_to_device(rows, torch.int64, logits.device),
                _host_to_device(cols, torch.int64, logits.device),
            )
            logits.index_put_(index, logits.new_tensor(-float("inf")))
        if not md.no_penalties:
            self._apply_penalties(logits, md)

        greedy = None
        if not md.all_random:
            greedy = logits.argmax(dim=-1)
            if md.all_greedy:
                return SamplerOutput(greedy, self._gather_logprobs(raw_logprobs, greedy, md))

        temperature = _on(md.temperature, logits.device)
        if not md.all_random:
            # Greedy rows keep 1.0 so the division is defined; their token comes from `greedy`.
            temperature = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature)
        logits.div_(temperature.unsqueeze(1))

        if md.min_p is not None:
            self._apply_min_p(logits, _on(md.min_p, logits.device))
        if md.top_k is not None or md.top_p is not None:
            self._apply_top_k_top_p(
                logits,
                None if md.top_k is None else _on(md.top_k, logits.device),
                None if md.top_p is None else _on(md.top_p, logits.device),
            )

        random = self._exponential_race(logits, md)
        if greedy is None:
            sampled = random
        else:
            sampled = torch.where(_on(md.temperature, logits.device) < _GREEDY_EPS, greedy, random)
        return SamplerOutput(sampled, self._gather_logprobs(raw_logprobs, sampled, md))

    # ----------------------------------------------------------------------------------- stages

    @staticmethod
    def _min_tokens_bans(md: SamplingMetadata, vocab: int) -> tuple[list[int], list[int]] | None:
        """(row ids, token ids) to set to -inf; None when no row is below its minimum."""
        if not md.min_tokens:
            return None
        rows: list[int] = []
        cols: list[int] = []
        for row, (min_toks, stop_ids) in md.min_tokens.items():
            if len(md.output_token_ids[row]) < min_toks:
                ids = [t for t in stop_ids if 0 <= t < vocab]
                rows.extend(itertools.repeat(row, len(ids)))
                cols.extend(ids)
        if not rows:
            return None
        return rows, cols

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
        num_rows, vocab = logits.shape
        device = logits.device

        # Count of each token in each row's output: one scatter_add over the flattened
        # [B * V] counts, indexed row * V + token (no padding needed).
        lengths = [len(toks) for toks in md.output_token_ids]
        total = sum(lengths)
        counts = torch.zeros(num_rows * vocab, dtype=torch.int32, device=device)
        if total:
            flat = _host_to_device(
                list(itertools.chain.from_iterable(md.output_token_ids)), torch.int64, device
            )
            row_of = torch.repeat_interleave(
                torch.arange(num_rows, device=device),
                _host_to_device(lengths, torch.int64, device),
                output_size=total,
            )
            counts.scatter_add_(0, row_of * vocab + flat, torch.ones(total, dtype=torch.int32, device=device))
        counts = counts.view(num_rows, vocab)
        in_output = counts > 0

        if md.repetition_penalties is not None:
            seen = in_output
            if md.prompt_token_ids is not None and md.prompt_token_ids.shape[1] > 0:
                # Prompts are padded with V: scatter into an extra column and drop it.
                in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=device)
                in_prompt.scatter_(1, _on(md.prompt_token_ids, device), True)
                seen = in_output | in_prompt[:, :vocab]
            rep = _on(md.repetition_penalties, device).unsqueeze(1).expand_as(logits)
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits.copy_(torch.where(seen, penalised, logits))
        if md.frequency_penalties is not None:
            logits.sub_(_on(md.frequency_penalties, device).unsqueeze(1) * counts)
        if md.presence_penalties is not None:
            logits.sub_(_on(md.presence_penalties, device).unsqueeze(1) * in_output)

    @staticmethod
    def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
        """Drop tokens whose probability is below ``min_p`` x the row's top probability."""
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits.masked_fill_(probs < threshold, -float("inf"))

    @staticmethod
    def _apply_top_k_top_p(
        logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
    ) -> None:
        """Top-k then top-p on one ascending sort; every row keeps at least its best token."""
        vocab = logits.shape[1]
        logits_sort, order = logits.sort(dim=-1, descending=False)
        if top_k is not None:
            # k = 0 disables: keep all V. Positions below V - k in ascending order are dropped
            # (exactly k tokens survive; among ties the sort decides).
            k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
            positions = torch.arange(vocab, device=logits.device)
            logits_sort.masked_fill_(positions.unsqueeze(0) < (vocab - k).unsqueeze(1), -float("inf"))
        if top_p is not None:
            # Drop the low tail whose cumulative mass is <= 1 - p; the best token always stays.
            cum = torch.softmax(logits_sort, dim=-1).cumsum_(dim=-1)
            drop = cum <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False
            logits_sort.masked_fill_(drop, -float("inf"))
        logits.scatter_(1, order, logits_sort)

    @staticmethod
    def _exponential_race(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """``argmax(probs / q)`` with ``q ~ Exp(1)``: an exact draw from ``probs`` per row."""
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_(generator=md.default_generator)
        for row, gen in md.generators.items():
            # The k-th step of a seeded request uses the k-th [V] draw of its own generator.
            q[row].exponential_(generator=gen)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor | None, sampled: torch.Tensor, md: SamplingMetadata
    ) -> LogprobsTensors | None:
        if raw_logprobs is None or md.max_num_logprobs is None:
            return None
        sampled = sampled.unsqueeze(1)
        sampled_lp = raw_logprobs.gather(1, sampled)
        ranks = (raw_logprobs > sampled_lp).sum(dim=-1) + 1
        num = min(md.max_num_logprobs, raw_logprobs.shape[1])
        if num > 0:
            top_lp, top_ids = raw_logprobs.topk(num, dim=-1)
            token_ids = torch.cat([sampled, top_ids], dim=1)
            logprobs = torch.cat([sampled_lp, top_lp], dim=1)
        else:
            token_ids, logprobs = sampled, sampled_lp
        return LogprobsTensors(token_ids=token_ids, logprobs=logprobs, ranks=ranks)
