"""LoRAConfig: how many adapters a server keeps in slots, and the largest rank a slot holds."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.lora.adapter import TARGETS

TARGET_NAMES = tuple(TARGETS)


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4  # adapter slots: distinct adapters in one step at most
    max_lora_rank: int = 16  # every slot is this wide; smaller ranks are zero-padded
    # the PEFT modules adapters may target: buffers (and their reads every step) for these only
    target_modules: tuple[str, ...] = TARGET_NAMES

    def __post_init__(self) -> None:
        unknown = [m for m in self.target_modules if m not in TARGET_NAMES]
        if unknown or not self.target_modules:
            raise ValueError(
                f"lora_target_modules {list(self.target_modules)} must be a non-empty subset of {list(TARGET_NAMES)}"
            )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 256:
                raise ValueError(f"{name}={value!r} must be an integer in [1, 256]")
