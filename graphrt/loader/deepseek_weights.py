"""DeepSeek-V3 checkpoint tensors (transformers names) → graphrt's parameter names.

Attention keeps transformers' projections (q_proj or q_a/q_b, kv_a_proj_with_mqa, kv_b_proj,
o_proj); a MoE layer's experts, saved one module each (``mlp.experts.{j}.gate_proj`` …), are
stacked into ``w_gate_up`` [E, 2·I, H] and ``w_down`` [E, H, I]; the router's weight and correction
bias stay float32 (as transformers keeps them); dense MLPs stack gate and up like the Llama family.
"""

from __future__ import annotations

import torch

from graphrt.models.config import ModelConfig

FLOAT32_SUFFIXES = ("mlp.gate_weight", "mlp.e_score_correction_bias")


def layer_tensors(cfg: ModelConfig, src, i: int) -> dict[str, torch.Tensor]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    a, o = hf + "self_attn.", ours + "self_attn."
    out = {
        ours + "input_layernorm.weight": src.get(hf + "input_layernorm.weight", (h,)),
        ours + "post_attention_layernorm.weight": src.get(hf + "post_attention_layernorm.weight", (h,)),
        o + "kv_a_proj_with_mqa.weight": src.get(
            a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h)
        ),
        o + "kv_a_layernorm.weight": src.get(a + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
        o + "kv_b_proj.weight": src.get(
            a + "kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        ),
        o + "o_proj.weight": src.get(a + "o_proj.weight", (h, heads * m.v_head_dim)),
    }
    if m.q_lora_rank is None:
        out[o + "q_proj.weight"] = src.get(a + "q_proj.weight", (heads * qk, h))
    else:
        out[o + "q_a_proj.weight"] = src.get(a + "q_a_proj.weight", (m.q_lora_rank, h))
        out[o + "q_a_layernorm.weight"] = src.get(a + "q_a_layernorm.weight", (m.q_lora_rank,))
        out[o + "q_b_proj.weight"] = src.get(a + "q_b_proj.weight", (heads * qk, m.q_lora_rank))
    if m.attention_bias:
        out[o + "kv_a_proj_with_mqa.bias"] = src.get(
            a + "kv_a_proj_with_mqa.bias", (m.kv_lora_rank + m.qk_rope_head_dim,)
        )
        out[o + "o_proj.bias"] = src.get(a + "o_proj.bias", (h,))
        if m.q_lora_rank is not None:
            out[o + "q_a_proj.bias"] = src.get(a + "q_a_proj.bias", (m.q_lora_rank,))
    mlp, om = hf + "mlp.", ours + "mlp."
    if cfg.moe is None or i < cfg.moe.first_dense_layers:
        out.update(_gated(src, mlp, om, cfg.intermediate_size, h))
        return out
    e = cfg.moe
    inter = e.intermediate_size
    out[om + "gate_weight"] = src.get(mlp + "gate.weight", (e.num_experts, h))
    out[om + "e_score_correction_bias"] = src.get(mlp + "gate.e_score_correction_bias", (e.num_experts,))
    experts = [f"{mlp}experts.{j}." for j in range(e.num_experts)]
    out[om + "w_gate_up"] = torch.stack(
        [
            torch.cat([src.get(x + "gate_proj.weight", (inter, h)), src.get(x + "up_proj.weight", (inter, h))])
            for x in experts
        ]
    )
    out[om + "w_down"] = torch.stack([src.get(x + "down_proj.weight", (h, inter)) for x in experts])
    if e.num_shared_experts:
        out.update(_gated(src, mlp + "shared_experts.", om + "shared_experts.", inter * e.num_shared_experts, h))
    return out


MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def mtp_present(cfg: ModelConfig, src) -> list[str]:
    """The MTP tensors a checkpoint lacks (empty: it has them all), by DeepSeek's names."""
    if cfg.mla is None or not cfg.num_mtp_layers:
        return ["num_nextn_predict_layers >= 1 in config.json"]
    names = [f"model.layers.{cfg.num_layers + i}.{n}" for i in range(cfg.num_mtp_layers) for n in MTP_OWN]
    return [n for n in names if n not in src]


def mtp_tensors(cfg: ModelConfig, src) -> dict[str, torch.Tensor]:
    """MTP layer i, stored as DeepSeek ships it under ``model.layers.{num_hidden_layers + i}.``:
    its own norms and projection, then one decoder layer's weights (the embedding and the head are
    the main model's; copies in the checkpoint are not read)."""
    h, out = cfg.hidden_size, {}
    for i in range(cfg.num_mtp_layers):
        index = cfg.num_layers + i
        hf, ours = f"model.layers.{index}.", f"mtp.{i}."
        out[ours + "enorm.weight"] = src.get(hf + "enorm.weight", (h,))
        out[ours + "hnorm.weight"] = src.get(hf + "hnorm.weight", (h,))
        out[ours + "eh_proj.weight"] = src.get(hf + "eh_proj.weight", (h, 2 * h))
        out[ours + "shared_head_norm.weight"] = src.get(hf + "shared_head.norm.weight", (h,))
        for name, t in layer_tensors(cfg, src, index).items():
            out[ours + "block." + name.split(".", 2)[2]] = t
    return out


def _gated(src, hf: str, ours: str, inter: int, h: int) -> dict[str, torch.Tensor]:
    return {
        ours + "gate_up_proj.weight": torch.cat(
            [src.get(hf + "gate_proj.weight", (inter, h)), src.get(hf + "up_proj.weight", (inter, h))]
        ),
        ours + "down_proj.weight": src.get(hf + "down_proj.weight", (h, inter)),
    }
