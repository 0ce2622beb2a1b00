"""A request's images: checked, encoded (through the cache) and placed at its placeholder tokens.

A prompt holds the model's image token where each image goes: once per image (a text prompt, as
users write it; expanded here to the image's number of patches) or once per patch (token ids
laid out by a processor already). Anything else — images for a text-only model, more images than
``limit_mm_per_prompt``, a placeholder count that matches neither, an unreadable image — is
refused when the request is submitted, naming the value.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from graphrt.multimodal.encoder import VisionEncoder, content_hash, image_array
from graphrt.sampling_params import InvalidRequestError


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    positions: np.ndarray  # [P] sorted prompt positions of the placeholder tokens
    embeds: torch.Tensor  # [P, hidden]: the image embeddings, in placeholder order
    hashes: tuple[str, ...]  # each image's content hash, in prompt order
    position_keys: tuple[tuple[int, tuple[str, int]], ...] = ()  # (position, (image hash, patch)) for the prefix cache


def prepare(encoder: VisionEncoder | None, ids: list[int], data, limit: int) -> tuple[list[int], MultiModalInput]:
    if not isinstance(data, dict) or set(data) - {"image"}:
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise InvalidRequestError(f"multi_modal_data must be a dict with the key 'image', got {got}")
    images = data.get("image")
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if encoder is None:
        raise InvalidRequestError(f"this model takes text only; the prompt has {len(images)} image(s)")
    if len(images) > limit:
        raise InvalidRequestError(f"the prompt has {len(images)} images; limit_mm_per_prompt allows {limit}")
    arrays = [image_array(im, i) for i, im in enumerate(images)]
    token, patches = encoder.image_token_id, encoder.patches
    count = sum(1 for t in ids if t == token)
    if count == len(arrays) and patches > 1:  # one placeholder per image: expand each
        ids = [u for t in ids for u in ([t] * patches if t == token else [t])]
    elif count != len(arrays) * patches:
        raise InvalidRequestError(
            f"the prompt has {count} image placeholder tokens (id {token}) for {len(arrays)} image(s); "
            f"expected one per image or {patches} per image"
        )
    hashes = [content_hash(a) for a in arrays]
    embeds = torch.cat(encoder.embed(arrays, hashes))
    positions = np.array([p for p, t in enumerate(ids) if t == token], dtype=np.int64)
    keys = tuple((int(p), (hashes[i // patches], i % patches)) for i, p in enumerate(positions))
    return ids, MultiModalInput(positions, embeds, tuple(hashes), keys)


def prompt_embeds_input(ids: list[int], embeds, hidden: int, dtype: torch.dtype) -> MultiModalInput:
    """Embeddings for every prompt position (vLLM's ``prompt_embeds``); the ids stay the prompt's
    tokens for detokenizing and stop checks. Keyed in the prefix cache by their bytes."""
    if not isinstance(embeds, torch.Tensor) or not embeds.dtype.is_floating_point:
        got = embeds.dtype if isinstance(embeds, torch.Tensor) else type(embeds).__name__
        raise InvalidRequestError(f"prompt_embeds must be a float tensor [prompt tokens, hidden], got {got}")
    if tuple(embeds.shape) != (len(ids), hidden):
        raise InvalidRequestError(
            f"prompt_embeds has shape {tuple(embeds.shape)}; the prompt needs ({len(ids)}, {hidden}) "
            "(one row per prompt token, the model's hidden size)"
        )
    if not torch.isfinite(embeds).all():
        raise InvalidRequestError("prompt_embeds holds NaN or infinite values")
    embeds = embeds.detach().to("cpu", dtype).contiguous()
    key = hashlib.sha256(embeds.view(torch.uint8).numpy().tobytes()).hexdigest()
    keys = tuple((p, (key, p)) for p in range(len(ids)))
    return MultiModalInput(np.arange(len(ids), dtype=np.int64), embeds, (key,), keys)
