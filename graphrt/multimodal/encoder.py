"""The vision side: the checkpoint's image processor, vision tower and projector (transformers'
modules, eager), and a cache of image embeddings keyed by the image's content.

``embed(images)`` returns each image's embeddings [patches, hidden] (hidden: the language
model's). The cache holds up to ``cache_bytes`` (64 MiB) of them, least recently used out first, so the
same image in several requests (or a preempted request that starts again) is encoded once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from graphrt.sampling_params import InvalidRequestError


def image_array(image, index: int) -> np.ndarray:
    """A PIL image or an [H, W, 3] / [H, W] uint8 (or float in [0, 1]) array as uint8 RGB."""
    try:
        from PIL import Image

        if isinstance(image, Image.Image):
            image.load()  # a truncated or corrupt file fails here, not inside the encoder
            return np.asarray(image.convert("RGB"))
    except ImportError:
        pass
    except Exception as e:  # PIL's errors for unreadable data
        raise InvalidRequestError(f"image {index} cannot be read: {e}") from e
    if isinstance(image, torch.Tensor):
        image = image.numpy()
    if not isinstance(image, np.ndarray):
        raise InvalidRequestError(
            f"image {index} must be a PIL.Image or a numpy array [H, W, 3], got {type(image).__name__}"
        )
    if image.ndim == 2:
        image = np.repeat(image[..., None], 3, axis=-1)
    if image.ndim != 3 or image.shape[-1] not in (3, 4) or min(image.shape[:2]) < 1:
        raise InvalidRequestError(f"image {index} must be an array [H, W, 3], got shape {tuple(image.shape)}")
    if image.dtype != np.uint8:
        if not np.issubdtype(image.dtype, np.floating) or not np.isfinite(image).all():
            raise InvalidRequestError(f"image {index}: a {image.dtype} array must be finite floats in [0, 1] or uint8")
        image = (np.clip(image, 0, 1) * 255).round().astype(np.uint8)
    return np.ascontiguousarray(image[..., :3])


def content_hash(image: np.ndarray) -> str:
    h = hashlib.sha256(str(image.shape).encode())
    h.update(image.tobytes())
    return h.hexdigest()


class VisionEncoder:
    def __init__(self, hf_model, processor, config: dict, dtype: torch.dtype, cache_bytes: int = 64 << 20):
        self.hf = hf_model.eval()
        self.processor = processor
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index")))
        self.dtype = dtype
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_bytes, self.cached_bytes = cache_bytes, 0
        self.hits = self.misses = 0
        with torch.no_grad():  # patches per image: from a blank image of the processor's size
            self.patches = self._encode(np.zeros((8, 8, 3), dtype=np.uint8)).shape[0]

    @classmethod
    def from_pretrained(cls, path: str, config: dict, dtype: torch.dtype) -> VisionEncoder:
        from transformers import AutoImageProcessor, LlavaForConditionalGeneration

        hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
        hf.model.language_model = None  # graphrt runs the language model; keep only the vision side
        hf.lm_head = None
        try:
            processor = AutoImageProcessor.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} has no image processor (preprocessor_config.json): {e}") from e
        return cls(hf, processor, config, dtype)

    def profile(self, images: int) -> int:
        """Peak memory growth (bytes, ``peak_growth``) of encoding ``images`` worst-case images
        (the processor's own size), none of them cached: ``profile_run``'s encoder share."""
        from graphrt.runner.kv_cache import peak_growth

        blank = np.zeros((16, 16, 3), dtype=np.uint8)
        embeds, growth = peak_growth(lambda: [self._encode(blank) for _ in range(images)])
        return growth + sum(e.numel() * e.element_size() for e in embeds)

    def _encode(self, image: np.ndarray, index: int = 0) -> torch.Tensor:
        try:
            pixels = self.processor(images=[image], return_tensors="pt")["pixel_values"]
        except Exception as e:  # the processor's own complaint about an image it cannot take
            raise InvalidRequestError(f"image {index} cannot be processed: {e}") from e
        with torch.no_grad():
            feats = self.hf.model.get_image_features(pixel_values=pixels.to(torch.float32))
        feats = feats.pooler_output if hasattr(feats, "pooler_output") else feats
        feats = feats[0] if isinstance(feats, (list, tuple)) else feats
        return feats.reshape(-1, feats.shape[-1]).to(self.dtype)

    def embed(self, images: list[np.ndarray], hashes: list[str]) -> list[torch.Tensor]:
        out = []
        for i, (image, key) in enumerate(zip(images, hashes)):
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                self.hits += 1
                out.append(hit)
                continue
            self.misses += 1
            emb = self._encode(image, i)
            out.append(emb)
            self.cache[key] = emb
            self.cached_bytes += emb.numel() * emb.element_size()
            while self.cached_bytes > self.cache_bytes and len(self.cache) > 1:
                _, old = self.cache.popitem(last=False)
                self.cached_bytes -= old.numel() * old.element_size()
        return out
