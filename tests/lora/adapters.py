"""PEFT adapters made in the tests, and transformers + peft as their oracle."""

from __future__ import annotations

import functools
import os

import torch

from tests.tiny_models import make_hf_model


def make_adapter(root: str, base: str, targets: tuple[str, ...], r: int, alpha: int, seed: int, rslora=False) -> str:
    """A PEFT adapter directory for the tiny ``base`` model with random (non-zero) A and B."""
    from peft import LoraConfig, get_peft_model

    path = os.path.join(root, f"{base}-{'-'.join(targets)}-r{r}-s{seed}{'-rs' if rslora else ''}")
    if os.path.exists(os.path.join(path, "adapter_config.json")):
        return path
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(make_hf_model(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=16)
def peft_model(base: str, adapter: str | None):
    """transformers' tiny ``base`` with the adapter applied by peft (None: the base alone)."""
    model = make_hf_model(base)
    if adapter is None:
        return model.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(base: str, adapter: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = peft_model(base, adapter)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def peft_logits(base: str, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return peft_model(base, adapter)(input_ids=torch.tensor([prompt])).logits[0]
