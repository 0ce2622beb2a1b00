"""LoRA adapters served many at once inside the compiled graphs: PEFT directories read and
checked, adapter slots that are graph inputs, and the per-token delta in the projections."""

from graphrt.lora.request import LoRARequest

__all__ = ["LoRARequest"]
