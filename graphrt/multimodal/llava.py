"""LLaVA checkpoints (``LlavaForConditionalGeneration``): a CLIP/SigLIP vision tower and a projector
over a Llama-family language model.

The language model is graphrt's own (``model.language_model.*`` and ``lm_head`` read as a Llama /
Qwen2 / Qwen3 checkpoint), compiled into graphrt's graphs like any text model. The vision tower
and projector stay transformers' modules, run eagerly once per image (``encoder.py``): they run
once per image, not once per token, and a prompt's image is a few hundred patches at most, so a
graph would save little and cost a compile per image size.
"""

from __future__ import annotations

import os

import torch

from graphrt.loader import hf_dir
from graphrt.loader.weights import TensorSource, build_model, convert_state_dict
from graphrt.models.config import ModelConfig


def is_llava(model_dir: str) -> bool:
    path = os.path.join(model_dir, "config.json")
    return os.path.exists(path) and hf_dir.read_json(path).get("model_type") == "llava"


def language_source(src: TensorSource) -> TensorSource:
    """The language model's tensors under a text model's names: checkpoints store them as
    ``language_model.model.*`` / ``language_model.lm_head.*`` (the original layout, which
    ``save_pretrained`` writes) or ``model.language_model.*`` / ``lm_head.*``."""
    theirs = {}
    for key in src._names:
        if key.startswith("language_model."):
            theirs[key.removeprefix("language_model.")] = key
        elif key.startswith("model.language_model."):
            theirs["model." + key.removeprefix("model.language_model.")] = key
        elif key.startswith("lm_head."):
            theirs[key] = key
    return TensorSource(theirs, lambda n: src._read(theirs[n]), lambda n: src.file_of(theirs[n]))


def load_llava(path: str, dtype: torch.dtype, quantization: str | None):
    """(text ModelConfig, graphrt language model, VisionEncoder, full HF config dict)."""
    from graphrt.multimodal.encoder import VisionEncoder

    full = hf_dir.read_json(os.path.join(path, "config.json"))
    text = dict(full["text_config"])
    text.setdefault("tie_word_embeddings", full.get("tie_word_embeddings", False))
    cfg = ModelConfig.from_hf_dict(text)
    state = convert_state_dict(cfg, language_source(hf_dir.safetensors_source(path)), dtype, quantization)
    model = build_model(cfg, state, dtype)
    return cfg, model, VisionEncoder.from_pretrained(path, full, dtype)
