"""A thin wrapper over a Hugging Face tokenizer: the few calls the engine makes."""

from __future__ import annotations

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


def load_hf_tokenizer(model_dir: str, gguf_file: str | None = None) -> Tokenizer:
    """From a directory of tokenizer files, or built from a GGUF file's metadata (seconds: the
    weights cache keeps the result)."""
    from transformers import AutoTokenizer

    if not gguf_file:
        return Tokenizer(AutoTokenizer.from_pretrained(model_dir))
    return Tokenizer(AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file))
