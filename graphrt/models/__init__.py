"""Models graphrt runs: one Llama-family implementation."""

from graphrt.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from graphrt.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "SUPPORTED_ARCHITECTURES", "UnsupportedModelError"]
