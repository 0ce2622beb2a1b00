"""A thin wrapper over a Hugging Face tokenizer: the few calls the engine makes."""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any


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


def cache_root() -> str:
    """graphrt's per-user cache: $GRAPHRT_CACHE_DIR, else $XDG_CACHE_HOME/graphrt, else ~/.cache/graphrt."""
    if os.environ.get("GRAPHRT_CACHE_DIR"):
        return os.environ["GRAPHRT_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "graphrt")


def load_hf_tokenizer(model_dir: str, gguf_file: str | None = None) -> Tokenizer:
    from transformers import AutoTokenizer

    if not gguf_file:
        return Tokenizer(AutoTokenizer.from_pretrained(model_dir))
    # Building a tokenizer from GGUF metadata re-reads the whole file (seconds): keep the result,
    # keyed by the file's identity, and load that next time.
    path = os.path.abspath(os.path.join(model_dir, gguf_file))
    st = os.stat(path)
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = os.path.join(cache_root(), "tokenizers", key)
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
