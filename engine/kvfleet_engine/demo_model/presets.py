"""Model shapes (presets) and architectures of the demo models, their HF ``config.json`` and parameter counts.

=======  ======  ======  =====  ========  ========  =====  =======  ===========================================
preset   hidden  layers  heads  kv heads  head_dim  inter  max_pos  parameters (vocab 4096)
=======  ======  ======  =====  ========  ========  =====  =======  ===========================================
tiny         64       4      4         2        16    192     4096  llama/mistral 721,472 (untied);
                                                                    qwen2 459,840 (tied, q/k/v biases)
small       512      14      8         2        64   1792     8192  llama/mistral 51,919,360 (untied);
                                                                    qwen2 49,832,960 (tied, q/k/v biases)
bench       896      24     14         2        64   4864    32768  qwen2 361,568,128; llama/mistral
                                                                    361,540,480 (all tied)
=======  ======  ======  =====  ========  ========  =====  =======  ===========================================

``bench`` is the Qwen2-0.5B shape, except that the vocabulary is the demo tokenizer's 4096 entries instead of
Qwen2's 151936, so its embedding is 3.7 M parameters instead of 136 M (0.36 B parameters in all instead of
0.49 B); per-layer compute and KV-cache size per token are Qwen2-0.5B's.

Architectures: ``llama`` (LlamaForCausalLM: no biases), ``qwen2`` (Qwen2ForCausalLM: q/k/v projections have
biases, o_proj and the MLP none; no sliding window), ``mistral`` (MistralForCausalLM: no biases,
``sliding_window`` null so attention is full). All use SiLU-gated MLPs, RMSNorm and plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfleet_engine.demo_model.tokenizer import (
    EOS_TOKEN_ID,
    GENERATION_EOS_TOKEN_IDS,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
)

ARCHS: tuple[str, ...] = ("llama", "qwen2", "mistral")
PRESETS: tuple[str, ...] = ("tiny", "small", "bench")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ArchSpec:
    architecture: str
    model_type: str
    qkv_bias: bool
    rope_theta: float
    rms_norm_eps: float


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", qkv_bias=False, rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", qkv_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "mistral": ArchSpec(
        "MistralForCausalLM", "mistral", qkv_bias=False, rope_theta=10000.0, rms_norm_eps=1e-5
    ),
}


@dataclass(frozen=True)
class PresetSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    # Archs whose embeddings are tied to the LM head for this preset.
    tied_archs: frozenset[str]


PRESET_SPECS: dict[str, PresetSpec] = {
    # Tests: loads in milliseconds; 2 KV heads so tensor-parallel 2 splits heads evenly.
    "tiny": PresetSpec(64, 4, 4, 2, 16, 192, 4096, tied_archs=frozenset({"qwen2"})),
    # ~50 M parameters: big enough for realistic GEMM shapes, small enough for CPU smoke runs.
    "small": PresetSpec(512, 14, 8, 2, 64, 1792, 8192, tied_archs=frozenset({"qwen2"})),
    # Qwen2-0.5B shape (see the module docstring for the vocabulary difference).
    "bench": PresetSpec(896, 24, 14, 2, 64, 4864, 32768, tied_archs=frozenset(ARCHS)),
}


def _check(arch: str, preset: str) -> None:
    if arch not in ARCH_SPECS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    if preset not in PRESET_SPECS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")


def make_config(
    arch: str = "llama",
    preset: str = "tiny",
    dtype: str = "float32",
    vocab_size: int = VOCAB_SIZE,
) -> dict[str, Any]:
    """The ``config.json`` contents for ``arch`` at ``preset`` size.

    Written for both transformers 4.x and 5.x: ``rope_theta`` at top level (what 4.x and most engines read)
    and ``rope_parameters`` (5.x's form); ``torch_dtype`` (4.x) and ``dtype`` (5.x).
    """
    _check(arch, preset)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    a, p = ARCH_SPECS[arch], PRESET_SPECS[preset]
    if p.hidden_size % p.num_attention_heads or p.num_attention_heads % p.num_key_value_heads:
        raise AssertionError(f"inconsistent preset {preset}")
    cfg: dict[str, Any] = {
        "architectures": [a.architecture],
        "model_type": a.model_type,
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": arch in p.tied_archs,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": PAD_TOKEN_ID,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=p.num_hidden_layers)
    elif arch == "mistral":
        cfg.update(sliding_window=None)
    return cfg


def generation_config() -> dict[str, Any]:
    """``generation_config.json``: greedy by default; stops on ``<|endoftext|>`` or ``<|im_end|>``."""
    return {
        "bos_token_id": None,
        "do_sample": False,
        "eos_token_id": list(GENERATION_EOS_TOKEN_IDS),
        "pad_token_id": PAD_TOKEN_ID,
    }


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight tensor of the checkpoint, name -> shape, in HF's state-dict order.

    Tied models have no ``lm_head.weight`` (HF ties it to ``model.embed_tokens.weight`` at load time).
    """
    d = config["hidden_size"]
    hd = config["head_dim"]
    q_out = config["num_attention_heads"] * hd
    kv_out = config["num_key_value_heads"] * hd
    inter = config["intermediate_size"]
    bias = config["model_type"] == "qwen2"
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], d)}
    for i in range(config["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes[pre + "self_attn.q_proj.weight"] = (q_out, d)
        if bias:
            shapes[pre + "self_attn.q_proj.bias"] = (q_out,)
        shapes[pre + "self_attn.k_proj.weight"] = (kv_out, d)
        if bias:
            shapes[pre + "self_attn.k_proj.bias"] = (kv_out,)
        shapes[pre + "self_attn.v_proj.weight"] = (kv_out, d)
        if bias:
            shapes[pre + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[pre + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[pre + "mlp.gate_proj.weight"] = (inter, d)
        shapes[pre + "mlp.up_proj.weight"] = (inter, d)
        shapes[pre + "mlp.down_proj.weight"] = (d, inter)
        shapes[pre + "input_layernorm.weight"] = (d,)
        shapes[pre + "post_attention_layernorm.weight"] = (d,)
    shapes["model.norm.weight"] = (d,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    return shapes


def count_parameters(config: dict[str, Any]) -> int:
    """Parameters of the model ``config`` describes (tied embeddings counted once), by closed formula."""
    d, hd, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * hd
    kv_out = config["num_key_value_heads"] * hd
    attn = d * q_out + 2 * d * kv_out + q_out * d
    if config["model_type"] == "qwen2":
        attn += q_out + 2 * kv_out
    per_layer = attn + 3 * d * inter + 2 * d
    embed = config["vocab_size"] * d
    head = 0 if config["tie_word_embeddings"] else config["vocab_size"] * d
    return embed + config["num_hidden_layers"] * per_layer + d + head
