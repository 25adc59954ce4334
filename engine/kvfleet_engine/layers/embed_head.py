"""Vocabulary-parallel token embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_engine.distributed import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from kvfleet_engine.layers.prepack import linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        # The last shard may be short (vocab not divisible by the TP size): pad it with zero rows.
        rows = max(0, min(self.shard_size, loaded.shape[0] - self.vocab_start))
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        in_shard = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the given hidden states, gathered over the vocabulary shards (float32)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        # oneDNN's blocked copy of ``weight`` on CPU (see layers/prepack.py); None = plain F.linear.
        self.packed_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, None, self.packed_weight)
        if self.tp_size > 1:
            logits = tp_all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size].float()
