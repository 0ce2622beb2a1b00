"""Loading a GGUF file: metadata → ModelConfig, tensors renamed to transformers'.

Q4_0, Q4_1 and Q8_0 tensors stay quantized (graphrt's int4 / int8 layouts, ``loader/quantization.py``)
unless the caller asks for float weights; F32/F16/BF16 are read as they are; every other type the
``gguf`` package can dequantise is dequantised to float at load, with a one-line notice.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np
import torch

from graphrt.loader.quantization import GGUF_KEPT, from_gguf_blocks
from graphrt.loader.weights import CheckpointError, TensorSource
from graphrt.models.config import ModelConfig, RopeConfig, UnsupportedModelError

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
FLOAT_TYPES = ("F32", "F16", "BF16")  # read as they are; every other type is dequantised at load

log = logging.getLogger("graphrt.loader")

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
            self.reader = _checked_reader()(path)
        except CheckpointError:
            raise
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

    def tensors(self, cfg: ModelConfig, keep_quantized: bool = True) -> TensorSource:
        by_name = {}
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                by_name[name] = t

        kept = GGUF_KEPT if keep_quantized else ()
        quantized: dict[str, int] = {}
        for t in by_name.values():
            if t.tensor_type.name not in FLOAT_TYPES + kept:
                quantized[t.tensor_type.name] = quantized.get(t.tensor_type.name, 0) + 1
        if quantized:
            kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(quantized.items()))
            log.warning("%s: GGUF tensors of type %s are dequantised to float at load", self.path, kinds)

        def read(name: str) -> torch.Tensor:
            t = by_name[name]
            shape = tuple(int(s) for s in reversed(t.shape))
            if t.tensor_type.name in kept and len(shape) == 2:
                w = from_gguf_blocks(np.asarray(t.data), t.tensor_type.name, shape)
                return _unpermuted(name, w, cfg)
            try:
                data = np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32)
            except NotImplementedError:
                raise CheckpointError(
                    f"{self.path}: tensor {t.name} has GGML type {t.tensor_type.name}, which graphrt cannot read "
                    f"(readable: the float types {FLOAT_TYPES} and the quantized types the gguf package "
                    f"dequantises)"
                ) from None
            return _unpermuted(name, torch.from_numpy(data.reshape(shape).copy()), cfg)

        return TensorSource(by_name, read, lambda name: self.path)


def _unpermuted(name: str, w, cfg: ModelConfig):
    """q and k with llama.cpp's row permutation undone (rows only: quantized blocks move whole)."""
    if not name.endswith(("q_proj.weight", "k_proj.weight")):
        return w
    heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
    if isinstance(w, torch.Tensor):
        return unpermute_rows(w, heads)
    order = unpermute_rows(torch.arange(w.shape[0])[:, None], heads)[:, 0]
    return w.rows(order)


@functools.cache
def _checked_reader():
    """gguf's reader, checking each tensor's entry before it maps the tensor's bytes: an unknown
    type, a row that is no whole number of its type's blocks, or fewer bytes in the file than the
    type and shape need is refused with the tensor's name, type and expected byte count (gguf's
    own reader fails on these with a bare numpy error, or not at all)."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields) -> None:
            path = getattr(self.data, "filename", None) or "GGUF file"
            spans = []
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise CheckpointError(
                        f"{path}: tensor {name} has unknown GGML type code {int(raw_dtype[0])}"
                    ) from None
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
                row = int(dims[0]) if len(dims) else 1
                if row % block:
                    raise CheckpointError(
                        f"{path}: tensor {name} ({kind.name}, shape {list(reversed(dims.tolist()))}) has rows of "
                        f"{row} values, not a whole number of its {block}-value blocks"
                    )
                expected = int(np.prod(dims)) * type_size // block
                start = int(start_offs + offset[0])
                held = max(0, len(self.data) - start)
                if held < expected:
                    raise CheckpointError(
                        f"{path}: tensor {name} ({kind.name}, shape {list(reversed(dims.tolist()))}) needs "
                        f"{expected} bytes of data; the file holds {held} from its offset {start}"
                    )
                spans.append((start, expected, name, kind.name))
            spans.sort()
            for (start, expected, name, kind), (next_start, _, next_name, _) in zip(spans, spans[1:]):
                if start + expected > next_start:
                    raise CheckpointError(
                        f"{path}: tensor {name} ({kind}) needs {expected} bytes of data, but tensor {next_name} "
                        f"begins {next_start - start} bytes after it"
                    )
            super()._build_tensors(start_offs, fields)

    return CheckedReader
