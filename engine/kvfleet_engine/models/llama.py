"""Llama-family decoder (Llama, Mistral, Qwen2: the same block; Qwen2 adds q/k/v biases).

Under pipeline parallelism each stage builds only its own layers (others are placeholders that keep
the checkpoint's layer indices), the first stage the embedding, the last the final norm and LM head.
A stage that is not the last returns its hidden state and residual stacked as ``[2, T, hidden]``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from kvfleet_engine.config import ModelConfig
from kvfleet_engine.distributed import get_parallel_state, stage_layer_range
from kvfleet_engine.layers.activation import SiluAndMul
from kvfleet_engine.layers.attention import Attention
from kvfleet_engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from kvfleet_engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvfleet_engine.layers.norm import RMSNorm
from kvfleet_engine.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        d = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, cfg.num_attention_heads, cfg.num_key_value_heads, bias=cfg.attention_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale=d**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.attn(q, k, v)
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage owns."""


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        pp = get_parallel_state()
        self.start_layer, self.end_layer = stage_layer_range(cfg.num_hidden_layers, pp.pp_rank, pp.pp_size)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first_stage else PPMissingLayer()
        )
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            [
                LlamaDecoderLayer(cfg, rotary) if self.start_layer <= i < self.end_layer else PPMissingLayer()
                for i in range(cfg.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last_stage else PPMissingLayer()

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``intermediate``: the previous stage's ``[2, T, hidden]`` output (None on the first stage)."""
        if intermediate is None:
            x, residual = self.embed_tokens(token_ids), None
        else:
            x, residual = intermediate[0], intermediate[1]
        for layer in self.layers[self.start_layer : self.end_layer]:
            x, residual = layer(positions, x, residual)
        if isinstance(self.norm, PPMissingLayer):
            return torch.stack((x, residual))
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # Checkpoint tensor name fragment -> (our fused parameter fragment, shard id).
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        last = get_parallel_state().is_last_stage
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if last else PPMissingLayer()
        if cfg.tie_word_embeddings and last and isinstance(self.model.embed_tokens, VocabParallelEmbedding):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, intermediate: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.model(token_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
