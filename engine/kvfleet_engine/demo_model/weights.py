"""Random weights for the demo models, initialised so that greedy decoding is robust and not degenerate.

Why not the usual N(0, 0.02): with that init every residual branch is tiny, the final hidden state is
essentially the (tied) input embedding, the logits are nearly uniform (std ~0.1) and greedy decoding repeats
one token forever. Tests that compare this engine's greedy tokens with HF transformers' token for token need
the opposite: the top-1 logit clearly ahead of the top-2 at every step, and an output sequence that actually
depends on the context. The scheme (d = hidden size, every matrix is N(0, std^2), each tensor from its own
seeded PCG64 stream so that sharding/order never changes values):

* Embeddings: std ``EMBED_STD`` (0.1). The first layer's RMSNorm removes the scale, so only the residual
  stream sees it: every block adds an O(1) branch, so after the first layer the stream is dominated by what
  the blocks computed, not by the raw embedding. With tied embeddings this is what keeps the model from
  predicting its own input token (logit of the input token ~ |e|^2, which must stay small next to the spread
  of the other logits).
* RMSNorm weights (``input_layernorm``, ``post_attention_layernorm``): 1 + N(0, 0.1^2), so a loader that
  ignores them or uses 1 + w (Gemma style) gives visibly different results.
* Attention: q and k have std ``QK_GAIN / sqrt(d)`` so q.k/sqrt(head_dim) has std ~QK_GAIN^2 (~2.6): attention
  is peaked on a few content- and position-dependent tokens rather than a flat average, so the context
  matters. v: 1/sqrt(d); o: ``ATTN_GAIN / sqrt(heads * head_dim)`` -> an O(1) attention branch.
  Qwen2's q/k/v biases are N(0, 0.5^2) / N(0, 0.5^2) / N(0, 0.2^2): large enough that an engine which drops
  them produces different tokens.
* MLP: gate/up 1/sqrt(d) (unit pre-activations), down ``MLP_GAIN / sqrt(intermediate * E[silu(z)^2])`` ->
  an O(1) MLP branch.
* Output: logits = W_out . (w_norm * x / rms(x)). At one position they are ~N(0, logit_std^2) over the
  vocabulary. Untied: final norm 1 + N(0, 0.1^2), lm_head std logit_std / sqrt(d). Tied: the embedding
  (std 0.1) is the output matrix, so the final norm weight carries the scale:
  (logit_std / (EMBED_STD * sqrt(d))) * (1 + N(0, 0.1^2)).

``logit_std`` (default 8) only rescales the logits: the greedy tokens and the ratio (top1 - top2 gap) /
(float32 error) are the same for every value, because float32 errors in the logits are relative (measured:
|fp32 - fp64| <= ~3e-5 * logit_std at every position and vocab entry, prompts up to 300 tokens). With 4096
Gaussian logits the gap is ~0.26 * logit_std on average and below ~0.003 * logit_std at 1 % of positions;
that fraction cannot shrink without concentrating the argmax on far fewer tokens (less varied output). The
default 8 keeps temperature-1 sampling realistic (a few likely tokens per step: seeded samples differ);
build with ``logit_std=64`` for absolute gaps 8x larger (1st percentile ~0.15) and near one-hot sampling.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np

DEFAULT_LOGIT_STD = 8.0
EMBED_STD = 0.1
NORM_JITTER = 0.1
QK_GAIN = 1.6
ATTN_GAIN = 1.0
MLP_GAIN = 1.0
QK_BIAS_STD = 0.5
V_BIAS_STD = 0.2
# E[silu(z)^2] for z ~ N(0, 1): the mean square of the MLP's gated activation (silu(gate) * up, up ~ N(0, 1)).
SILU_MEAN_SQUARE = 0.3556
# Bump when the scheme changes: it is mixed into every tensor's seed, so old and new weights never coincide.
SCHEME_VERSION = 1


def tensor_rng(seed: int, arch: str, preset: str, name: str) -> np.random.Generator:
    """A PCG64 stream of its own for one tensor, from (seed, arch, preset, tensor name)."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    digest = hashlib.sha256(f"kvfleet-demo/{SCHEME_VERSION}/{arch}/{preset}/{name}".encode()).digest()
    words = struct.unpack("<4I", digest[:16])
    return np.random.default_rng(np.random.SeedSequence([seed, *words]))


def init_std(name: str, shape: tuple[int, ...], config: dict[str, Any], logit_std: float) -> float:
    """Standard deviation of the random part of tensor ``name`` (norm weights: of their jitter around the mean)."""
    d = config["hidden_size"]
    leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]  # e.g. "q_proj.weight"
    if name == "model.embed_tokens.weight":
        return EMBED_STD
    if name == "lm_head.weight":
        return logit_std / math.sqrt(d)
    if name.endswith("norm.weight"):
        return NORM_JITTER
    fan_in = shape[-1]
    if leaf in ("q_proj.weight", "k_proj.weight"):
        return QK_GAIN / math.sqrt(fan_in)
    if leaf in ("v_proj.weight", "gate_proj.weight", "up_proj.weight"):
        return 1.0 / math.sqrt(fan_in)
    if leaf == "o_proj.weight":
        return ATTN_GAIN / math.sqrt(fan_in)
    if leaf == "down_proj.weight":
        return MLP_GAIN / math.sqrt(fan_in * SILU_MEAN_SQUARE)
    if leaf in ("q_proj.bias", "k_proj.bias"):
        return QK_BIAS_STD
    if leaf == "v_proj.bias":
        return V_BIAS_STD
    raise KeyError(f"no init rule for tensor {name}")


def norm_mean(name: str, config: dict[str, Any], logit_std: float) -> float:
    """Mean of an RMSNorm weight: 1, except the final norm of a tied model, which sets the logit scale."""
    if name == "model.norm.weight" and config["tie_word_embeddings"]:
        return logit_std / (EMBED_STD * math.sqrt(config["hidden_size"]))
    return 1.0


def make_tensor(
    name: str,
    shape: tuple[int, ...],
    config: dict[str, Any],
    *,
    seed: int,
    arch: str,
    preset: str,
    logit_std: float = DEFAULT_LOGIT_STD,
) -> np.ndarray:
    """The float32 values of one weight tensor; a pure function of its arguments."""
    rng = tensor_rng(seed, arch, preset, name)
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= np.float32(init_std(name, shape, config, logit_std))
    if name.endswith("norm.weight"):
        mean = norm_mean(name, config, logit_std)
        values += np.float32(1.0)
        values *= np.float32(mean)
    return values
