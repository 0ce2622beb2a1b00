"""A PEFT LoRA adapter read from its directory, checked against the base model, and laid out on
graphrt's projections (q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``).

Every refusal is an ``InvalidRequestError`` naming the file, the module or tensor, and the value,
raised when a request names the adapter (before it is queued).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from graphrt.models.config import ModelConfig
from graphrt.sampling_params import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT's module name → (graphrt module in a decoder layer, which part of its stacked output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# graphrt module → how many PEFT modules its output stacks
PARTS: dict[str, int] = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


def _module_of(key: str) -> str:
    """The module a tensor of an adapter file belongs to: ``...lm_head.base_layer.weight`` → lm_head."""
    path = re.split(r"\.(?:lora_|base_layer|weight|bias|modules_to_save)", key, maxsplit=1)[0]
    return path.rsplit(".", 1)[-1]


def part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module → (in_features, out_features) in the base model."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with rsLoRA; folded into B
    # (layer, PEFT module) → (A [r, in], B [out, r] · scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _refuse(path: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {path}: {what}")


def read_config(path: str, max_rank: int) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise _refuse(path, "no such directory")
    if not os.path.isfile(file):
        raise _refuse(path, f"{CONFIG_FILE} is missing (a PEFT adapter directory holds it)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise _refuse(file, f"not readable as JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(file, "not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(file, f"peft_type {config.get('peft_type')!r} is not LORA")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _refuse(file, f"r={r!r} must be a positive integer")
    if r > max_rank:
        raise _refuse(file, f"rank r={r} is above max_lora_rank={max_rank}")
    unsupported = {
        "modules_to_save": "modules_to_save (fully trained copies of modules) is not supported",
        "use_dora": "DoRA (use_dora) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
        "layers_pattern": "layers_pattern is not supported",
    }
    for key, why in unsupported.items():
        if config.get(key):
            raise _refuse(file, f"{why}: {key}={config[key]!r}")
    if config.get("bias", "none") != "none":
        raise _refuse(file, f"bias={config['bias']!r}: trained biases are not supported (bias='none' only)")
    if config.get("fan_in_fan_out"):
        raise _refuse(file, "fan_in_fan_out=True (Conv1D layouts) is not supported")
    return config


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype) -> Adapter:
    """Read, check and scale one adapter (on the CPU, in the model's dtype)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(path, max_rank)
    r = config["r"]
    alpha = config.get("lora_alpha", r)
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise _refuse(path, f"{WEIGHTS_FILE} is missing (only safetensors adapters are read)")
    try:
        tensors = load_file(file)
    except (SafetensorError, OSError, ValueError) as e:
        raise _refuse(file, f"not a readable safetensors file ({e})") from None
    shapes = part_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            module = _module_of(key)
            raise _refuse(
                file, f"tensor {key}: target module {module!r} is not supported; LoRA applies to {list(TARGETS)}"
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise _refuse(
                file, f"tensor {key}: target module {module!r} is not supported; LoRA applies to {list(TARGETS)}"
            )
        if layer >= cfg.num_layers:
            raise _refuse(file, f"tensor {key}: layer {layer} does not exist (the base model has {cfg.num_layers})")
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise _refuse(file, "holds no LoRA tensors")
    adapter = Adapter(name, path, r, scaling)
    for (layer, module), pair in sorted(halves.items()):
        where = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise _refuse(file, f"{where} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (r, fan_in):
            raise _refuse(file, f"{where}.lora_A has shape {tuple(a.shape)}; the base model needs ({r}, {fan_in})")
        if tuple(b.shape) != (fan_out, r):
            raise _refuse(file, f"{where}.lora_B has shape {tuple(b.shape)}; the base model needs ({fan_out}, {r})")
        adapter.weights[(layer, module)] = (a.to(dtype), (b.float() * scaling).to(dtype))
    return adapter
