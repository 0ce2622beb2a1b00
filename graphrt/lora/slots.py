"""AdapterSlots: the fixed LoRA buffers of a model — read in place by every graph, like its weights — and the
copy that puts an adapter into a slot. Filling a slot never changes a graph.

Only the modules the engine serves LoRA on (``target_modules``) get buffers: a projection no
served module belongs to stays a plain projection, and a stacked one (q/k/v, gate/up) holds
buffers for its served parts only."""

from __future__ import annotations

import torch
from torch import nn

from graphrt.lora.adapter import PARTS, TARGETS, Adapter, part_shapes
from graphrt.models.config import ModelConfig
from graphrt.sampling_params import InvalidRequestError


class AdapterSlots:
    def __init__(
        self, model: nn.Module, cfg: ModelConfig, num_slots: int, max_rank: int, max_rows: int, targets: tuple[str, ...]
    ) -> None:
        """``model``: a Llama-family model (the engine checks that before)."""
        layers = model.layers
        self.cfg, self.num_slots, self.max_rank, self.targets = cfg, num_slots, max_rank, tuple(targets)
        self.modules: dict[tuple[int, str], nn.Linear] = {}
        # graphrt projection → the parts of its output LoRA is served on, in order
        self.parts = {
            path: tuple(sorted(j for m, (p, j) in TARGETS.items() if p == path and m in self.targets)) for path in PARTS
        }
        weight = model.norm.weight  # the activations' dtype (a quantized projection has no float weight)
        width = num_slots * max_rank
        for i, layer in enumerate(layers):
            for path, parts in self.parts.items():
                if not parts:
                    continue
                linear = layer.get_submodule(path)
                linear.register_buffer(
                    "lora_a", torch.zeros(len(parts) * width, linear.in_features, dtype=weight.dtype)
                )
                for j in parts:  # one B per part of the output: a stacked B would be mostly zeros
                    rows = part_rows(cfg, path, j)
                    linear.register_buffer(f"lora_b{j}", torch.zeros(rows.stop - rows.start, width, dtype=weight.dtype))
                linear.lora_num_slots, linear.lora_rank, linear.lora_parts = num_slots, max_rank, parts
                # every part's width, so that unserved parts get zeros in the stacked delta
                sizes = [part_rows(cfg, path, j) for j in range(PARTS[path])]
                linear.lora_part_sizes = tuple(rows.stop - rows.start for rows in sizes)
                self.modules[(i, path)] = linear
        # the adapter slot of each row of a step (−1: none), written before every step
        model.register_buffer("lora_row_slot", torch.full((max_rows,), -1, dtype=torch.int64), persistent=False)
        self.row_slot = model.lora_row_slot

    def check(self, adapter: Adapter) -> None:
        """Refuse an adapter that targets a module this engine serves no LoRA on."""
        outside = sorted({m for _, m in adapter.weights} - set(self.targets))
        if outside:
            raise InvalidRequestError(
                f"LoRA adapter {adapter.path}: it targets {outside}; this engine serves LoRA on "
                f"{list(self.targets)} (lora_target_modules)"
            )

    def fill(self, slot: int, adapter: Adapter) -> None:
        """Put ``adapter`` into ``slot`` (what the slot held before is gone)."""
        r, s = self.max_rank, self.num_slots
        for (_, path), linear in self.modules.items():
            for i, j in enumerate(linear.lora_parts):
                linear.lora_a[(i * s + slot) * r : (i * s + slot + 1) * r].zero_()
                getattr(linear, f"lora_b{j}")[:, slot * r : (slot + 1) * r].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            path, part = TARGETS[module]
            linear = self.modules[(layer, path)]
            start = (linear.lora_parts.index(part) * s + slot) * r
            linear.lora_a[start : start + adapter.rank].copy_(a)
            getattr(linear, f"lora_b{part}")[:, slot * r : slot * r + adapter.rank].copy_(b)

    def load_rows(self, slots) -> None:
        """The step's rows' slots (numpy [R]); the rest of the buffer says none."""
        n = len(slots)
        self.row_slot[:n].copy_(torch.from_numpy(slots))
        self.row_slot[n:].fill_(-1)


def part_rows(cfg: ModelConfig, path: str, part: int) -> slice:
    """The output rows of one PEFT module within its (stacked) graphrt projection."""
    outs = part_shapes(cfg)
    stacked = sorted((j, m) for m, (p, j) in TARGETS.items() if p == path)
    start = sum(outs[m][1] for j, m in stacked if j < part)
    return slice(start, start + outs[stacked[part][1]][1])
