"""Applying a step's allowed-token bitmask to the logits, on any device, before the sampler."""

from __future__ import annotations

import numpy as np
import torch

_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set ``logits[rows[i], t]`` to ``-inf`` wherever bit ``t`` of ``bitmask[i]`` is clear.

    ``bitmask`` is ``[len(rows), ceil(V' / 32)]`` int32 (llguidance's layout: token ``t`` is bit
    ``t % 32`` of word ``t // 32``; on a little-endian host that is bit ``t % 8`` of byte ``t // 8``,
    which is how it is unpacked: bytes, not words, so the unpacked mask is a quarter of the size).
    Tokens past ``32 * width`` (a logits row wider than the grammar's vocabulary) are never allowed.
    In place; plain tensor ops, so CPU and GPU alike, one host->device copy of the (small) bitmask.

    Cost on CPU: ~12 ms for 32 rows of a 152k vocabulary (2 threads), ~0.3 ms at the demo's 4k."""
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(8, dtype=torch.uint8, device=device)
    packed = torch.from_numpy(bitmask.view(np.uint8))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    vocab = logits.shape[1]
    disallowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1) == 0
    width = disallowed.shape[1]
    if width < vocab:
        disallowed = torch.nn.functional.pad(disallowed, (0, vocab - width), value=True)
    elif width > vocab:
        disallowed = disallowed[:, :vocab]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        logits.masked_fill_(disallowed, float("-inf"))  # every row constrained, in order: no gather
        return
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, index, selected)
