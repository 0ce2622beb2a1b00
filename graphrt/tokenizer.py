"""A thin wrapper over a Hugging Face tokenizer: the few calls the engine makes."""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from graphrt.kernels.native_library import cache_root


class Tokenizer:
    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id


def load_hf_tokenizer(model_dir: str, gguf_file: str | None = None) -> Tokenizer:
    from transformers import AutoTokenizer

    if not gguf_file:
        return Tokenizer(AutoTokenizer.from_pretrained(model_dir))
    # Building a tokenizer from GGUF metadata re-reads the whole file (seconds): keep the result,
    # keyed by the file's identity, and load that next time.
    path = os.path.abspath(os.path.join(model_dir, gguf_file))
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(cache_root(), "tokenizers", key)  # the per-user cache the native kernels use
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        try:
            return Tokenizer(AutoTokenizer.from_pretrained(cached))
        except Exception:  # a broken cache entry: rebuild it below
            pass
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file)
    try:
        tmp = f"{cached}.tmp-{os.getpid()}"
        tok.save_pretrained(tmp)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        os.replace(tmp, cached) if not os.path.exists(cached) else shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home: the cache is an optimisation only
    return Tokenizer(tok)
