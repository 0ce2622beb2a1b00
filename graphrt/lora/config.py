"""LoRAConfig: how many adapters a server keeps in slots, and the largest rank a slot holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4  # adapter slots: distinct adapters in one step at most
    max_lora_rank: int = 16  # every slot is this wide; smaller ranks are zero-padded

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
                raise ValueError(f"{name}={value!r} must be an integer in [1, 256]")
