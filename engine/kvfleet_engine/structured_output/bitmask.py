"""Applying a step's allowed-token bitmask to the logits, on any device, before the sampler."""

from __future__ import annotations

import numpy as np
import torch

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set ``logits[rows[i], t]`` to ``-inf`` wherever bit ``t`` of ``bitmask[i]`` is clear.

    ``bitmask`` is ``[len(rows), ceil(V' / 32)]`` int32 (llguidance's layout: token ``t`` is bit
    ``t % 32`` of word ``t // 32``). Tokens past ``32 * width`` (a logits row wider than the grammar's
    vocabulary) are never allowed. In place; plain tensor ops, so CPU and GPU alike, one host->device
    copy of the (small) bitmask."""
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    words = torch.from_numpy(bitmask)
    if device.type == "cuda":
        words = words.pin_memory().to(device, non_blocking=True)
    else:
        words = words.to(device)
    vocab = logits.shape[1]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1).bool()
    width = allowed.shape[1]
    if width < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - width), value=False)
    elif width > vocab:
        allowed = allowed[:, :vocab]
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, selected)
