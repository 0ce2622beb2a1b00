"""DeepSeek-V3: multi-head latent attention (MLA) and a mixture of experts (MoE) with shared experts.

Same forward protocol as the Llama family (flat tokens of a step, per-layer caches, attention
inputs in; hidden states out). Each layer's cache pair holds its latents and rope keys (one entry
per token), not K and V per head; attention runs in latent space with the key up-projection
absorbed into the query and the value up-projection applied after (``canonical.mla_attention``,
which the fuse_mla_attention pass turns into ``graphrt::mla_attention``). The routed experts run
as ``graphrt::moe_experts``; the router (sigmoid scores, correction bias, group-limited top-k)
is plain torch in the graph.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import canonical
from graphrt.models.attention import AttentionInputs
from graphrt.models.config import ModelConfig, MoEConfig
from graphrt.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, apply_rotary_interleaved
from graphrt.models.quantized import dense_weight

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with its default eps


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        self.num_heads, self.nope, self.rope, self.v_dim = (
            cfg.num_heads,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        self.rank = m.kv_lora_rank
        self.interleave = m.rope_interleave
        qk_dim = self.nope + self.rope
        self.scale = qk_dim**-0.5 * cfg.rope.softmax_scale_factor
        h = cfg.hidden_size
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=m.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.q_lora = m.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=m.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.kv_b_proj.packable = False  # read as a matrix (absorbed into q and the output), not projected
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=m.attention_bias)

    def forward(self, x, positions, cos_sin, kv_cache, attn: AttentionInputs) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.reshape(num_tokens, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        rotate = apply_rotary_interleaved if self.interleave else apply_rotary
        cos, sin = cos_sin
        q_pe, k_pe = rotate(q_pe, cos, sin), rotate(k_pe[:, None, :], cos, sin)[:, 0, :]
        w_kv = dense_weight(self.kv_b_proj, q_nope.dtype).view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w_kv[:, : self.nope, :], w_kv[:, self.nope :, :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        out = canonical.mla_attention(
            q_latent,
            q_pe,
            latent,
            k_pe,
            kv_cache[0],
            kv_cache[1],
            attn.slot_mapping,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            attn.token_req,
            self.scale,
        )
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))


class MoE(nn.Module):
    """Routed experts (``graphrt::moe_experts``) plus the shared experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m: MoEConfig = cfg.moe
        self.cfg = m
        h, inter = cfg.hidden_size, m.intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(m.num_experts, h, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(m.num_experts, dtype=torch.float32))
        self.w_gate_up = nn.Parameter(torch.empty(m.num_experts, 2 * inter, h))
        self.w_down = nn.Parameter(torch.empty(m.num_experts, h, inter))
        self.shared_experts = GatedMLP(h, inter * m.num_shared_experts, False) if m.num_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sigmoid scores; the top ``topk_groups`` groups by the sum of each group's two best
        (bias-corrected) scores; the top-k experts within them; weights from the uncorrected
        scores, normalised if asked, times routed_scaling_factor."""
        m = self.cfg
        scores = nn.functional.linear(x.float(), self.gate_weight).sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = m.num_experts // m.num_groups
        group_scores = choice.view(-1, m.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=m.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(-1, m.num_groups, per_group).reshape(-1, m.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = torch.topk(choice, k=m.experts_per_token, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * m.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        out = torch.ops.graphrt.moe_experts.default(x, ids, weights, self.w_gate_up, self.w_down)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = cfg.moe is None or index < cfg.moe.first_dense_layers
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False) if dense else MoE(cfg)

    def forward(self, x, positions, cos_sin, kv_cache, attn):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos_sin, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class MTPLayer(nn.Module):
    """A multi-token-prediction layer: the next token's embedding and the previous position's
    final hidden state, each normalised, projected to one hidden state, through a full decoder
    layer, then normalised for the shared LM head (transformers' ``MtpLayer``; DeepSeek's
    ``shared_head.norm`` is the post-norm)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, cfg.rms_norm_eps), RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, index)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, positions, cos_sin, kv_cache, attn) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        return self.shared_head_norm(self.block(x, positions, cos_sin, kv_cache, attn))


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, num_mtp_layers: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, cfg.num_layers + i) for i in range(num_mtp_layers))
        self.mtp_missing: list[str] = []  # set by the loader: MTP tensors the checkpoint lacks

    def forward(self, input_ids, positions, kv_caches, attn: AttentionInputs) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, cos_sin, kv_cache, attn)
        return self.norm(x)

    def mtp_forward(self, layer: int, input_ids, hidden, positions, kv_cache, attn: AttentionInputs) -> torch.Tensor:
        """MTP layer ``layer`` over the step's tokens: token t is the token after the position of
        ``hidden[t]`` (the main model's final hidden state there, or the previous MTP output) and
        sits at that position; returns the normalised hidden states for the LM head."""
        embeds = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, embeds.dtype)
        return self.mtp[layer](embeds, hidden, positions, cos_sin, kv_cache, attn)

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden[indices], dense_weight(head, hidden.dtype))
