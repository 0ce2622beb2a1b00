"""From a checkpoint's tensors (transformers names) to a ready graphrt model.

The whole state dict is built and checked before the model exists, so a bad checkpoint never
leaves a half-loaded model behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from graphrt.loader import deepseek_weights
from graphrt.loader.quantization import (
    QuantizedTensor,
    cat_rows,
    dequantize_state,
    quantize_state,
    swap_quantized_modules,
)
from graphrt.models import model_class
from graphrt.models.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated or does not match its config."""


class TensorSource:
    """Named tensors of a checkpoint, read lazily, each remembering the file it came from."""

    def __init__(self, names: Iterable[str], read: Callable[[str], torch.Tensor], file_of: Callable[[str], str]):
        self._names = set(names)
        self._read = read
        self.file_of = file_of

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self._names:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        try:
            t = self._read(name)
        except Exception as e:  # truncated file, bad header, ...
            raise CheckpointError(f"cannot read tensor {name!r} from {self.file_of(name)}: {e}") from e
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"tensor {name!r} in {self.file_of(name)} has shape {tuple(t.shape)}, but the config needs {shape}"
            )
        return t


def _layer_tensors(cfg: ModelConfig, src: TensorSource, i: int) -> dict[str, torch.Tensor]:
    hf, ours = f"model.layers.{i}.", f"layers.{i}."
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {
        ours + "input_layernorm.weight": src.get(hf + "input_layernorm.weight", (h,)),
        ours + "post_attention_layernorm.weight": src.get(hf + "post_attention_layernorm.weight", (h,)),
        ours + "self_attn.o_proj.weight": src.get(hf + "self_attn.o_proj.weight", (h, q_out)),
        ours + "mlp.down_proj.weight": src.get(hf + "mlp.down_proj.weight", (h, inter)),
    }
    attn = hf + "self_attn."
    out[ours + "self_attn.qkv_proj.weight"] = cat_rows(
        [
            src.get(attn + "q_proj.weight", (q_out, h)),
            src.get(attn + "k_proj.weight", (kv_out, h)),
            src.get(attn + "v_proj.weight", (kv_out, h)),
        ]
    )
    if cfg.qkv_bias:
        out[ours + "self_attn.qkv_proj.bias"] = torch.cat(
            [
                src.get(attn + "q_proj.bias", (q_out,)),
                src.get(attn + "k_proj.bias", (kv_out,)),
                src.get(attn + "v_proj.bias", (kv_out,)),
            ]
        )
    if cfg.o_bias:
        out[ours + "self_attn.o_proj.bias"] = src.get(attn + "o_proj.bias", (h,))
    if cfg.qk_norm:
        out[ours + "self_attn.q_norm.weight"] = src.get(attn + "q_norm.weight", (d,))
        out[ours + "self_attn.k_norm.weight"] = src.get(attn + "k_norm.weight", (d,))
    mlp = hf + "mlp."
    out[ours + "mlp.gate_up_proj.weight"] = cat_rows(
        [src.get(mlp + "gate_proj.weight", (inter, h)), src.get(mlp + "up_proj.weight", (inter, h))]
    )
    if cfg.mlp_bias:
        out[ours + "mlp.gate_up_proj.bias"] = torch.cat(
            [src.get(mlp + "gate_proj.bias", (inter,)), src.get(mlp + "up_proj.bias", (inter,))]
        )
        out[ours + "mlp.down_proj.bias"] = src.get(mlp + "down_proj.bias", (h,))
    return out


def convert_state_dict(
    cfg: ModelConfig, src: TensorSource, dtype: torch.dtype, quantization: str | None = None
) -> dict[str, torch.Tensor]:
    """transformers-named tensors → graphrt's parameter names (q/k/v and gate/up stacked).
    Quantized source tensors stay quantized unless ``quantization="none"``; "int8" / "int4"
    quantize the float projections and embeddings (``loader/quantization.py``)."""
    v, h = cfg.vocab_size, cfg.hidden_size
    state = {
        "embed_tokens.weight": src.get("model.embed_tokens.weight", (v, h)),
        "norm.weight": src.get("model.norm.weight", (h,)),
    }
    if not cfg.tie_word_embeddings:
        state["lm_head.weight"] = src.get("lm_head.weight", (v, h))
    layer = deepseek_weights.layer_tensors if cfg.mla is not None else _layer_tensors
    for i in range(cfg.num_layers):
        state.update(layer(cfg, src, i))
    if cfg.mla is not None and not deepseek_weights.mtp_present(cfg, src):
        state.update(deepseek_weights.mtp_tensors(cfg, src))
    return finish_state(cfg, state, dtype, quantization)


def finish_state(
    cfg: ModelConfig, state: dict, dtype: torch.dtype, quantization: str | None
) -> dict[str, torch.Tensor]:
    """graphrt-named weights (float or ``QuantizedTensor``) → the state dict ``build_model`` takes."""
    if quantization in ("int8", "int4"):
        if cfg.mla is not None:
            raise ValueError(f"quantization={quantization!r} is supported for the Llama family, not {cfg.architecture}")
        state = quantize_state(state, quantization)
    elif quantization == "none":
        state = dequantize_state(state)
    out = {}
    for k, t in state.items():
        if isinstance(t, QuantizedTensor):
            out.update(t.parts(k))
        else:
            out[k] = t.to(_dtype_of(k, dtype)).contiguous()
    return out


def _dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(deepseek_weights.FLOAT32_SUFFIXES) else dtype


def build_model(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    mtp_layers = sum(1 for k in state if k.startswith("mtp.") and k.endswith(".enorm.weight"))
    with torch.device("meta"):
        model = model_class(cfg)(cfg, mtp_layers) if cfg.mla is not None else model_class(cfg)(cfg)
        swap_quantized_modules(model, state, dtype)
    # (rope's tables, not in the state dict, were built on the CPU with the model)
    model.load_state_dict(state, strict=True, assign=True)
    keep = {p: p.data for name, p in model.named_parameters() if name.endswith(deepseek_weights.FLOAT32_SUFFIXES)}
    quantized = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    quantized = [(m, name, b) for m, name, b in quantized if b.dtype == torch.float16]  # scales and mins
    model.to(dtype)
    for p, data in keep.items():  # a MoE router stays float32 whatever the model's dtype
        p.data = data
    for m, name, b in quantized:  # quantized weights' scales stay float16
        m._buffers[name] = b
    return model.eval().requires_grad_(False)
