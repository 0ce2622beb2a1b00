"""LoRA adapters served many at once inside the compiled graphs: PEFT directories read and
checked, adapter slots every graph reads in place, and the per-token delta in the projections."""

from graphrt.lora.request import LoRARequest

__all__ = ["LoRARequest"]
