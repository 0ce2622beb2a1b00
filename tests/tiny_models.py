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
    "qwen2_yarn": (
        "Qwen2Config",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    # DeepSeek-V3: MLA with q LoRA, YaRN (mscale), a dense first layer, then MoE layers with a
    # shared expert and group-limited routing (4 groups of 4 experts, the best 2 groups, top 3)
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=24,
            first_k_dense_replace=1,
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=128,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
        ),
    ),
    # no q LoRA, NeoX-layout rope without scaling, unnormalised top-k weights, no shared expert
    "deepseek_v3_plain": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            rope_interleave=False,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            n_shared_experts=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
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
        "DeepseekV3Config": transformers.DeepseekV3ForCausalLM,
    }[cls_name]
    model = model_cls(cfg).eval()
    for name, buf in model.named_buffers():  # transformers starts the routers' correction bias at 0
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.randn_like(buf) * 0.1)
    return model


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


def make_mtp_oracle(main_model, seed: int = 1):
    """transformers' own MTP implementation over ``main_model``, with seeded random weights
    (norm weights and the router bias randomised too, so that they matter)."""
    from transformers.modeling_layers import MtpModel

    shared = [main_model.get_input_embeddings().weight, main_model.lm_head.weight]
    saved = [t.detach().clone() for t in shared]
    mtp = MtpModel(main_model, 1).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t, s in zip(shared, saved):  # its init re-initialises the shared embedding and head in place
            t.copy_(s)
        for name, t in mtp.layers.named_parameters():  # its own init is not seeded: set every weight here
            noise = torch.randn(t.shape, generator=g)
            t.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
        for name, buf in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return mtp


def mtp_checkpoint_tensors(mtp, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """The oracle's MTP layer under DeepSeek's names (``model.layers.{num_hidden_layers}.``), with
    the experts one module each and copies of the embedding and head, as DeepSeek ships them."""
    prefix = f"model.layers.{num_hidden_layers}."
    out = {}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers.0."):
            continue
        name = name.removeprefix("layers.0.")
        if name == "post_norm.weight":
            out[prefix + "shared_head.norm.weight"] = t
        elif name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            base = prefix + name.removeprefix("mtp_block.").removesuffix("gate_up_proj")
            for j in range(t.shape[0]):
                out[f"{base}{j}.gate_proj.weight"] = t[j, :inter]
                out[f"{base}{j}.up_proj.weight"] = t[j, inter:]
        elif name.endswith("experts.down_proj"):
            base = prefix + name.removeprefix("mtp_block.").removesuffix("down_proj")
            for j in range(t.shape[0]):
                out[f"{base}{j}.down_proj.weight"] = t[j]
        else:
            out[prefix + name.removeprefix("mtp_block.")] = t
    out[prefix + "embed_tokens.weight"] = mtp.embed_tokens.weight
    out[prefix + "shared_head.head.weight"] = mtp.shared_head.weight
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_tiny_with_mtp(root: str, name: str = "deepseek_v3", seed: int = 0) -> str:
    """A tiny DeepSeek-V3 checkpoint with one MTP layer written in (save_pretrained drops them)."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(root, f"{name}-mtp")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    model = make_hf_model(name, seed)
    model.save_pretrained(path)
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    tensors.update(mtp_checkpoint_tensors(make_mtp_oracle(model), model.config.num_hidden_layers))
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


LLAVA_IMAGE_TOKEN = 250


def make_hf_llava(seed: int = 0):
    """A tiny LLaVA: a 2-layer CLIP vision tower over 32x32 images in 8x8 patches (16 image
    tokens after the class token is dropped), a projector and the tiny Llama GQA language model."""
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = transformers.LlamaConfig(**{**COMMON, **TINY_CONFIGS["llama_gqa"][1]})
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN)
    torch.manual_seed(seed)
    return transformers.LlavaForConditionalGeneration(cfg).eval()


def save_tiny_llava(root: str, seed: int = 0) -> str:
    import transformers

    path = os.path.join(root, "llava")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_hf_llava(seed).save_pretrained(path)
        transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ).save_pretrained(path)
    return path
