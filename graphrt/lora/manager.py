"""LoRAManager: the adapters a server knows, which of them sit in slots, and which slots running
requests hold. A request takes its adapter's slot when it is admitted (filling a free slot, or
the least recently used one nobody holds) and gives it back when it finishes or is preempted."""

from __future__ import annotations

import collections

import torch

from graphrt.lora.adapter import Adapter, load_adapter
from graphrt.lora.request import LoRARequest
from graphrt.lora.slots import AdapterSlots
from graphrt.models.config import ModelConfig
from graphrt.sampling_params import InvalidRequestError


class LoRAManager:
    def __init__(self, slots: AdapterSlots, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.slots, self.cfg, self.dtype = slots, cfg, dtype
        self.adapters: dict[int, Adapter] = {}  # lora_int_id → read and checked
        self.resident: collections.OrderedDict[int, int] = collections.OrderedDict()  # id → slot, LRU first
        self.holders: collections.Counter[int] = collections.Counter()  # slot → running requests on it
        self.fills = 0  # slots filled so far (a copy each)

    def register(self, lora: LoRARequest) -> int:
        """Read and check ``lora``'s adapter the first time its id is seen (InvalidRequestError
        naming the file otherwise); returns its id."""
        known = self.adapters.get(lora.lora_int_id)
        if known is None:
            adapter = load_adapter(lora.lora_name, lora.lora_path, self.cfg, self.slots.max_rank, self.dtype)
            self.slots.check(adapter)
            self.adapters[lora.lora_int_id] = adapter
        elif known.path != lora.lora_path:
            raise InvalidRequestError(
                f"lora_int_id {lora.lora_int_id} is already adapter {known.name!r} from {known.path}, "
                f"not {lora.lora_path}"
            )
        return lora.lora_int_id

    def acquire(self, lora_id: int) -> int | None:
        """The slot holding ``lora_id`` for one more request; None when every slot is held."""
        slot = self.resident.get(lora_id)
        if slot is None:
            used = set(self.resident.values())
            free = [s for s in range(self.slots.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((i for i, s in self.resident.items() if not self.holders[s]), None)
                if victim is None:
                    return None
                slot = self.resident.pop(victim)
            self.slots.fill(slot, self.adapters[lora_id])
            self.fills += 1
            self.resident[lora_id] = slot
        self.resident.move_to_end(lora_id)
        self.holders[slot] += 1
        return slot

    def release(self, lora_id: int) -> None:
        slot = self.resident[lora_id]
        self.holders[slot] -= 1
