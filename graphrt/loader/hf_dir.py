"""Loading a Hugging Face checkpoint directory: config, (sharded) safetensors, generation config."""

from __future__ import annotations

import json
import os
from typing import Any

from safetensors import safe_open

from graphrt.loader.weights import CheckpointError, TensorSource
from graphrt.models.config import ModelConfig


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def read_config(model_dir: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_json(os.path.join(model_dir, "config.json")))


def eos_from_generation_config(model_dir: str) -> tuple[int, ...] | None:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return None
    eos = read_json(path).get("eos_token_id")
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def safetensors_source(model_dir: str) -> TensorSource:
    """All tensors of the directory's safetensors files, single or sharded with an index."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    sharded = os.path.exists(index)
    if sharded:
        weight_map: dict[str, str] = read_json(index)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors file in {model_dir}")
        weight_map = {}
    handles = {}
    for name in files:
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is listed in the index but missing")
        try:
            handles[name] = safe_open(path, framework="pt")
        except Exception as e:
            raise CheckpointError(f"cannot open {path} (truncated or not safetensors?): {e}") from e
        if not sharded:
            for key in handles[name].keys():
                weight_map[key] = name
    for key, name in weight_map.items():
        if name not in handles:
            raise CheckpointError(f"index names {key!r} in {name}, which is missing")

    def read(key: str):
        return handles[weight_map[key]].get_tensor(key)

    return TensorSource(weight_map, read, lambda key: os.path.join(model_dir, weight_map[key]))


def has_tokenizer(model_dir: str) -> bool:
    return any(
        os.path.exists(os.path.join(model_dir, f))
        for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    )
