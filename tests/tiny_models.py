"""Tiny random transformers checkpoints, the oracle's side of every parity test."""

from __future__ import annotations

import os

import torch

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# name → (transformers config class name, overrides)
TINY_CONFIGS = {
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1, head_dim=24)),
    "qwen2_tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
}


def make_hf_model(name: str, seed: int = 0):
    import transformers

    cls_name, overrides = TINY_CONFIGS[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **overrides})
    torch.manual_seed(seed)
    model_cls = {
        "LlamaConfig": transformers.LlamaForCausalLM,
        "Qwen2Config": transformers.Qwen2ForCausalLM,
        "Qwen3Config": transformers.Qwen3ForCausalLM,
    }[cls_name]
    return model_cls(cfg).eval()


def save_tiny(name: str, root: str, seed: int = 0) -> str:
    path = os.path.join(root, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        make_hf_model(name, seed).save_pretrained(path)
    return path


def save_tiny_with_smollm2_tokenizer(root: str, name: str = "llama_gqa", seed: int = 0) -> str:
    """A tiny random model over SmolLM2's real vocabulary, with its tokenizer files."""
    import transformers

    from graphrt.loader import default_model_path
    from graphrt.tokenizer import load_hf_tokenizer

    path = os.path.join(root, f"{name}-smollm2-tok")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    gguf = default_model_path()
    tok = load_hf_tokenizer(os.path.dirname(gguf), os.path.basename(gguf)).hf
    cls_name, overrides = TINY_CONFIGS[name]
    cfg = getattr(transformers, cls_name)(
        **{
            **COMMON,
            **overrides,
            "vocab_size": 49152,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    tok.save_pretrained(path)
    return path
