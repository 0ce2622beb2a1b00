"""One implementation of the Llama family: Llama, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

The forward protocol is the runtime's: the flattened tokens of a whole step, the per-layer paged
KV caches and the step's attention inputs in, hidden states out; logits are a separate call.
Parameter names follow transformers' with q/k/v and gate/up stacked (see loader.weights).
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.lora.projection import project
from graphrt.models.attention import AttentionInputs, attention
from graphrt.models.config import ModelConfig
from graphrt.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from graphrt.models.quantized import dense_weight
from graphrt.multimodal.merge import merge

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        attn: AttentionInputs,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = project(self.qkv_proj, x, attn.lora_slot).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, kv_cache[0], kv_cache[1], attn, self.scale)
        return project(self.o_proj, out, attn.lora_slot)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, positions, cos_sin, kv_cache, attn):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos_sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x), attn.lora_slot)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # given a weight, Embedding skips its random init (costly on the meta device)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn: AttentionInputs,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x = merge(self, input_ids, self.embed_tokens(input_ids))  # image embeddings, if any
        cos_sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, cos_sin, kv_cache, attn)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden[indices], dense_weight(head, hidden.dtype))
