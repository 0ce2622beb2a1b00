"""The tokenizer: the few calls the engine makes (encode, decode, chat template, EOS).

A directory of tokenizer files that the ``tokenizers`` library can serve exactly (a
``tokenizer.json`` with no settings transformers would apply on top of it) is served by it: no
transformers import, half a second of every start-up. The transformers tokenizer is loaded on
first need: for the grammar compiler, and for anything the fast path does not cover (a chat
template it cannot render, a clean-up step). tests/test_tokenizer.py checks the two agree.
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any

# Tokenizer classes whose transformers wrapper adds nothing to tokenizer.json's own pipeline.
FAST_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}


class Tokenizer:
    def __init__(self, hf_tokenizer: Any = None, directory: str | None = None) -> None:
        self._hf = hf_tokenizer
        self.directory = directory
        self._fast, self._config, self._template = None, {}, None
        if hf_tokenizer is None:
            self._fast, self._config, self._template = _fast_parts(directory)
            if self._fast is None:
                self._hf = _load_hf(directory)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (loaded on first use when the fast path serves the rest)."""
        if self._hf is None:
            self._hf = _load_hf(self.directory)
        return self._hf

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=True).ids
        return list(self.hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, conversation: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation (a list of {role, content} messages, or one user
        message's text) rendered with the model's chat template, ready for the reply."""
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
        if self._template is not None:
            try:
                rendered = _compiled(self._template).render(
                    messages=messages, add_generation_prompt=True, **self._special_tokens()
                )
                return self._fast.encode(rendered, add_special_tokens=False).ids
            except Exception:  # a template the plain renderer cannot serve: transformers' own
                pass
        out = self.hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    @property
    def eos_token_id(self) -> int | None:
        if self._fast is not None:
            eos = self._special_tokens().get("eos_token")
            return None if eos is None else self._fast.token_to_id(eos)
        return self.hf.eos_token_id

    def _special_tokens(self) -> dict[str, str]:
        out = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = self._config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[name] = value
        return out


def _load_hf(directory: str | None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _fast_parts(directory: str | None):
    """(tokenizers.Tokenizer, tokenizer_config, chat template) when the directory can be served
    without transformers; (None, {}, None) otherwise."""
    none = (None, {}, None)
    if directory is None or not os.path.exists(os.path.join(directory, "tokenizer.json")):
        return none
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return none
    if (
        config.get("tokenizer_class") not in FAST_CLASSES
        or config.get("add_bos_token")
        or config.get("add_eos_token")
        or config.get("clean_up_tokenization_spaces")
    ):
        return none
    from tokenizers import Tokenizer as FastTokenizer

    template = config.get("chat_template")
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja) as f:
            template = f.read()
    return (
        FastTokenizer.from_file(os.path.join(directory, "tokenizer.json")),
        config,
        (template if isinstance(template, str) else None),
    )


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """A chat template compiled the way transformers compiles it (sandboxed, trimmed blocks,
    loop controls, its ``tojson``, ``raise_exception`` and ``strftime_now``)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_hf_tokenizer(model_dir: str, gguf_file: str | None = None) -> Tokenizer:
    """From a directory of tokenizer files, or built from a GGUF file's metadata (seconds: the
    weights cache keeps the result as files)."""
    if not gguf_file:
        return Tokenizer(directory=model_dir)
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_file), directory=model_dir)
