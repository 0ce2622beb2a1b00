"""Loading a GGUF file: metadata → ModelConfig, tensors dequantised and renamed to transformers'."""

from __future__ import annotations

import os

import numpy as np
import torch

from graphrt.loader.weights import CheckpointError, TensorSource
from graphrt.models.config import ModelConfig, RopeConfig, UnsupportedModelError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of q/k for its interleaved rotary layout."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


class GGUFCheckpoint:
    def __init__(self, path: str) -> None:
        import gguf

        if not os.path.exists(path):
            raise CheckpointError(f"GGUF file {path} does not exist")
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:
            raise CheckpointError(f"cannot read GGUF file {path}: {e}") from e
        self.path = path
        self._dequantize = gguf.quants.dequantize

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} in {self.path} is not supported; supported: {SUPPORTED_GGUF_ARCHITECTURES}"
            )
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise UnsupportedModelError(f"{self.path}: GGUF rope_freqs (llama3 rope) is not supported")
        heads = int(self.field(f"{arch}.attention.head_count"))
        hidden = int(self.field(f"{arch}.embedding_length"))
        head_dim = int(self.field(f"{arch}.attention.key_length", hidden // heads))
        vocab = self.field(f"{arch}.vocab_size") or len(self.field("tokenizer.ggml.tokens"))
        scaling = self.field(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise UnsupportedModelError(f"{self.path}: GGUF rope scaling {scaling!r} is not supported")
        rope = RopeConfig(
            theta=float(self.field(f"{arch}.rope.freq_base", 10000.0)),
            type="linear" if scaling == "linear" else "default",
            factor=float(self.field(f"{arch}.rope.scaling.factor", 1.0)),
        )
        eos = self.field("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{arch}.feed_forward_length")),
            num_layers=int(self.field(f"{arch}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(self.field(f"{arch}.context_length", 2048)),
            rope=rope,
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )

    def tensors(self, cfg: ModelConfig) -> TensorSource:
        by_name = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                by_name[name] = t

        def read(name: str) -> torch.Tensor:
            t = by_name[name]
            shape = tuple(int(s) for s in reversed(t.shape))
            data = np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = torch.from_numpy(data.reshape(shape).copy())
            if name.endswith("q_proj.weight"):
                w = unpermute_rows(w, cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                w = unpermute_rows(w, cfg.num_kv_heads)
            return w

        return TensorSource(by_name, read, lambda name: self.path)
