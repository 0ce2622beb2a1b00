"""RequestTable: the runner's per-request state in stable slots, addressed through an index map.

A request keeps its slot from arrival to finish; nothing is ever swapped or compacted. Rows are
numpy arrays sized once (max_num_seqs × max_model_len tokens, × max_blocks block ids).
"""

from __future__ import annotations

import numpy as np

from graphrt.core.scheduler import CachedRequestData, NewRequestData


class RequestTable:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks: int) -> None:
        s = max_num_seqs
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(s - 1, -1, -1))
        self.token_ids = np.zeros((s, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(s, dtype=np.int64)
        self.num_computed = np.zeros(s, dtype=np.int64)
        self.block_table = np.zeros((s, max_blocks), dtype=np.int64)
        self.num_blocks = np.zeros(s, dtype=np.int64)
        self.temperature = np.zeros(s, dtype=np.float32)
        self.top_k = np.zeros(s, dtype=np.int64)
        self.top_p = np.ones(s, dtype=np.float32)
        self.min_p = np.zeros(s, dtype=np.float32)
        self.seed = np.zeros(s, dtype=np.int64)
        self.lora_slot = np.full(s, -1, dtype=np.int64)  # adapter slot (−1: the base model)
        self.mm_input: dict[str, object] = {}  # request id → its images (MultiModalInput)
        self.stop_ids: dict[str, frozenset[int]] = {}  # request id → the tokens that end it (bursts)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.slot_of

    def add(self, new: NewRequestData) -> None:
        if new.request_id in self.slot_of:
            self.remove(new.request_id)
        s = self._free_slots.pop()
        self.slot_of[new.request_id] = s
        tokens = new.prompt_token_ids + new.output_token_ids
        self.token_ids[s, : len(tokens)] = tokens
        self.num_tokens[s] = len(tokens)
        self.num_computed[s] = new.num_computed_tokens
        self.block_table[s, : len(new.block_ids)] = new.block_ids
        self.num_blocks[s] = len(new.block_ids)
        p = new.request.params
        self.temperature[s] = p.temperature
        self.top_k[s] = p.top_k
        self.top_p[s] = p.top_p
        self.min_p[s] = p.min_p
        self.seed[s] = new.request.seed
        self.lora_slot[s] = new.request.lora_slot
        if new.request.mm_input is not None:
            self.mm_input[new.request_id] = new.request.mm_input
        self.stop_ids[new.request_id] = new.request.ending_token_ids

    def update(self, c: CachedRequestData) -> None:
        s = self.slot_of[c.request_id]
        n, b = self.num_tokens[s], self.num_blocks[s]
        self.token_ids[s, n : n + len(c.new_token_ids)] = c.new_token_ids
        self.num_tokens[s] += len(c.new_token_ids)
        self.block_table[s, b : b + len(c.new_block_ids)] = c.new_block_ids
        self.num_blocks[s] += len(c.new_block_ids)
        self.num_computed[s] = c.num_computed_tokens

    def remove(self, request_id: str) -> None:
        s = self.slot_of.pop(request_id, None)
        self.mm_input.pop(request_id, None)
        self.stop_ids.pop(request_id, None)
        if s is not None:
            self.block_table[s] = 0
            self._free_slots.append(s)
