"""Models graphrt runs: the Llama family (Llama, Qwen2, Qwen3) and DeepSeek-V3 (MLA, MoE)."""

from graphrt.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from graphrt.models.deepseek_v3 import DeepseekV3ForCausalLM
from graphrt.models.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type:
    return DeepseekV3ForCausalLM if cfg.architecture == "DeepseekV3ForCausalLM" else LlamaForCausalLM


__all__ = [
    "DeepseekV3ForCausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedModelError",
    "model_class",
]
