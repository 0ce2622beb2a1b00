"""The model's hyper-parameters, parsed once from a Hugging Face config (4.x or 5.x) or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something graphrt's model does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    # YaRN
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0: unset
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # the cos/sin scale; None: derived from factor and mscale

    @property
    def cos_sin_scale(self) -> float:
        """YaRN's attention factor, applied to cos and sin (1 for other rope types)."""
        if self.type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek's YaRN correction of the attention softmax scale: mscale(factor, mscale_all_dim)²."""
        if self.type == "default" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: one q_proj; else q_a_proj → norm → q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    attention_bias: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3 mixture of experts: sigmoid scores, group-limited top-k, shared experts."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    num_shared_experts: int
    first_dense_layers: int  # first_k_dense_replace
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    norm_topk_prob: bool


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, Llama attention_bias
    o_bias: bool = False  # Llama attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0  # num_nextn_predict_layers: multi-token-prediction layers after the model's

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.rope.type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope.type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The inverse of ``to_dict`` (a JSON round trip included)."""
        return cls(
            **{
                **d,
                "rope": RopeConfig(**d["rope"]),
                "eos_token_ids": tuple(d["eos_token_ids"]),
                "mla": MLAConfig(**d["mla"]) if d.get("mla") else None,
                "moe": MoEConfig(**d["moe"]) if d.get("moe") else None,
            }
        )

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, dim) of each layer's two cache tensors: K and V, or for MLA the latent and the
        rope key (one entry per token, not per head)."""
        if self.mla is not None:
            return (1, self.mla.kv_lora_rank), (1, self.mla.qk_rope_head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a ``config.json`` as written by transformers 4.x (``rope_scaling``) or 5.x
        (``rope_parameters``)."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {arch!r} is not supported; supported: {SUPPORTED_ARCHITECTURES}")
        act = cfg.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; supported: {SUPPORTED_ACTIVATIONS}")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=True is not supported; supported: use_sliding_window=False")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        mla, moe = (_parse_mla(cfg), _parse_moe(cfg)) if arch == "DeepseekV3ForCausalLM" else (None, None)
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # the rotary part; the cache holds latents
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            mla=mla,
            moe=moe,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if mla is not None else 0,
        )


def _parse_mla(cfg: dict[str, Any]) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=cfg.get("q_lora_rank"),
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def _parse_moe(cfg: dict[str, Any]) -> MoEConfig | None:
    experts = cfg.get("n_routed_experts")
    if not experts:
        return None
    moe = MoEConfig(
        num_experts=experts,
        experts_per_token=cfg["num_experts_per_tok"],
        intermediate_size=cfg["moe_intermediate_size"],
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        first_dense_layers=cfg.get("first_k_dense_replace", 0),
        num_groups=cfg.get("n_group") or 1,
        topk_groups=cfg.get("topk_group") or 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )
    if moe.num_experts % moe.num_groups:
        raise UnsupportedModelError(f"n_routed_experts={experts} is not a multiple of n_group={moe.num_groups}")
    return moe


def _arch_from_model_type(model_type: str | None) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
    }.get(model_type or "", f"<model_type {model_type!r}>")


def _as_tuple(x: Any) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, (list, tuple)):
        return tuple(int(i) for i in x)
    return (int(x),)


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5.x: rope_parameters holds rope_theta and the scaling; 4.x: rope_theta at top
    # level and an optional rope_scaling dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return RopeConfig(
        theta=float(theta),
        type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
        partial_rotary_factor=float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
    )
