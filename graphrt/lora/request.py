"""``LoRARequest``: which adapter a request runs with (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass

from graphrt.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what the server calls it ("model": NAME)
    lora_int_id: int  # the adapter's identity: requests with the same id share a slot and KV blocks
    lora_path: str  # a PEFT directory: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError(f"lora_name {self.lora_name!r} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id {self.lora_int_id!r} must be an integer >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError(f"lora_path {self.lora_path!r} must be a directory path")
