"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

A step that runs prompt positions ``[start, end)`` of a request (a whole prefill or one chunk of it) has
their hidden states anyway; the sampler only looks at the last one. For a request that asks
(``SamplingParams.prompt_logprobs = k``), the logits of each of those positions ``p`` go through a
float32 ``log_softmax`` and give the logprob and rank of prompt token ``p + 1`` plus the top-k.

Invariants:

- only rows that ask pay anything: the plan is None for a batch without such a row, and only their
  positions' hidden states go through the LM head;
- a position is computed only while it is a prompt position whose next token is a prompt token
  (``p + 1 < num_prompt_tokens``); the first prompt token has no logprob (nothing predicts it);
- the same step's plan is the same on every tensor-parallel rank (the LM head gathers over them);
- the engine core, not this module, makes sure a position reaches the user once (a preempted request
  recomputes its prompt, and this module computes it again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# One entry per prompt token after the first: (token ids, logprobs, rank of the prompt token). Ids and
# logprobs start with the prompt token itself, then the top-k (most likely first); rank 1 = most likely.
PromptLogprobEntry = tuple[list[int], list[float], int]
# What a step found for one request: (index of the first prompt token covered, one entry per token).
PromptLogprobsChunk = tuple[int, list[PromptLogprobEntry]]

# Logits rows computed at once: bounds the float32 [rows, vocab] buffers of a long prefill chunk.
_MAX_LOGITS_ELEMENTS = 1 << 25


@dataclass(slots=True)
class PromptLogprobsPlan:
    """Which hidden-state rows of this step to score, and against which tokens."""

    req_ids: list[str]  # per request that gets entries this step
    first_token: list[int]  # index of the first prompt token each request's entries cover
    counts: list[int]  # entries per request (consecutive in the arrays below)
    num_top: list[int]  # top-k each request asked for
    hidden_rows: np.ndarray  # [P] int64: row of the step's hidden states for each scored position
    targets: np.ndarray  # [P] int64: the prompt token that follows each scored position


def plan_prompt_logprobs(batch, q_lens: np.ndarray, logits_idx: np.ndarray) -> PromptLogprobsPlan | None:
    """The step's prompt positions to score, or None when no scheduled row asks for prompt logprobs.

    ``logits_idx[i]`` is the hidden-state row of row i's last scheduled token (the step's rows of one
    request are consecutive), so its first scheduled token sits ``q_lens[i] - 1`` rows before it."""
    n = len(q_lens)
    asking = np.flatnonzero(batch.num_prompt_logprobs[:n] >= 0)
    if asking.size == 0:
        return None
    plan = PromptLogprobsPlan([], [], [], [], np.empty(0, np.int64), np.empty(0, np.int64))
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    for i in asking.tolist():
        start = int(batch.num_computed_tokens[i])
        end = min(start + int(q_lens[i]), int(batch.num_prompt_tokens[i]) - 1)
        if end <= start:
            continue  # past the prompt (decoding), or a one-token prompt
        first_row = int(logits_idx[i]) - int(q_lens[i]) + 1
        rows.append(np.arange(first_row, first_row + end - start, dtype=np.int64))
        targets.append(batch.token_ids[i, start + 1 : end + 1].astype(np.int64))
        plan.req_ids.append(batch.req_ids[i])
        plan.first_token.append(start + 1)
        plan.counts.append(end - start)
        plan.num_top.append(int(batch.num_prompt_logprobs[i]))
    if not rows:
        return None
    plan.hidden_rows = np.concatenate(rows)
    plan.targets = np.concatenate(targets)
    return plan


@torch.inference_mode()
def compute_prompt_logprobs(
    model: torch.nn.Module, hidden: torch.Tensor, plan: PromptLogprobsPlan, vocab_size: int
) -> dict[str, PromptLogprobsChunk]:
    """Score the plan's positions: ``model.compute_logits`` of their hidden states (float32), then
    ``log_softmax``; returns each request's chunk of entries."""
    device = hidden.device
    rows = torch.from_numpy(plan.hidden_rows).to(device)
    targets = torch.from_numpy(plan.targets).to(device).unsqueeze(1)
    max_top = max(plan.num_top)
    token_lps, ranks, top_lps, top_ids = [], [], [], []
    total = int(rows.shape[0])
    step = max(1, _MAX_LOGITS_ELEMENTS // vocab_size)
    start = 0
    while start < total:
        end = min(total, start + step)
        logprobs = torch.log_softmax(model.compute_logits(hidden[rows[start:end]]).float(), dim=-1)
        token_lp = logprobs.gather(1, targets[start:end])
        token_lps.append(token_lp.squeeze(1))
        ranks.append((logprobs > token_lp).sum(dim=-1) + 1)
        if max_top:
            lp, ids = logprobs.topk(min(max_top, logprobs.shape[1]), dim=-1)
            top_lps.append(lp)
            top_ids.append(ids)
        start = end
    token_lp_host = torch.cat(token_lps).tolist()
    rank_host = torch.cat(ranks).tolist()
    top_lp_host = torch.cat(top_lps).tolist() if max_top else None
    top_id_host = torch.cat(top_ids).tolist() if max_top else None
    target_host = plan.targets.tolist()

    out: dict[str, PromptLogprobsChunk] = {}
    pos = 0
    for rid, first_token, count, k in zip(plan.req_ids, plan.first_token, plan.counts, plan.num_top):
        entries: list[PromptLogprobEntry] = []
        for j in range(pos, pos + count):
            ids = [target_host[j]]
            lps = [token_lp_host[j]]
            if k:
                ids += top_id_host[j][:k]
                lps += top_lp_host[j][:k]
            entries.append((ids, lps, rank_host[j]))
        out[rid] = (first_token, entries)
        pos += count
    return out
