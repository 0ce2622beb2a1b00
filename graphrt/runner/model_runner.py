"""The thin runner: request states in, one graph replay per step, sampled token ids out.

``execute`` reads as the step's table of contents: update states, prepare the host batch,
dispatch it to a graph key, load the key's buffers, run the key's graph, hand back the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.core.scheduler import SchedulerOutput
from graphrt.runner.graph_cache import GraphCache
from graphrt.runner.request_table import RequestTable
from graphrt.runner.step_batch import StepBatch
from graphrt.runner.step_module import StepModule


@dataclass
class ModelRunnerOutput:
    req_ids: tuple[str, ...] = ()
    sampled: dict[str, int] = field(default_factory=dict)  # rows whose prompt is done
    logprobs: dict[str, float] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        step: StepModule,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        graphs: GraphCache,
        max_num_seqs: int,
        max_model_len: int,
    ) -> None:
        self.step = step
        self.kv_caches = kv_caches
        self.graphs = graphs
        self.block_size = step.block_size
        self.max_blocks = graphs.max_blocks
        self.table = RequestTable(max_num_seqs, max_model_len, self.max_blocks)
        # (req_ids, samples) → [R, words] int32 bitmask or None; set by the engine for grammars
        self.bitmask_provider = None

    # --- the step -----------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        batch = self.prepare(out)
        key = self.graphs.dispatch(batch)
        self.graphs.buffers(key).load(batch)
        tokens, logprobs = self.graphs.run(key, self.run_eager, self.kv_caches)
        tokens, logprobs = tokens[: batch.num_reqs].tolist(), logprobs[: batch.num_reqs].tolist()
        result = ModelRunnerOutput(batch.req_ids)
        for r, rid in enumerate(batch.req_ids):
            if batch.samples[r]:
                result.sampled[rid] = tokens[r]
                result.logprobs[rid] = logprobs[r]
        return result

    def update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.table.remove(rid)
        for new in out.new_requests:
            self.table.add(new)
        for cached in out.cached_requests:
            self.table.update(cached)

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        t = self.table
        req_ids = tuple(out.num_scheduled_tokens)
        slots = np.array([t.slot_of[r] for r in req_ids], dtype=np.int64)
        n = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = t.num_computed[slots]
        qsl = np.concatenate(([0], np.cumsum(n)))
        token_req = np.repeat(np.arange(len(req_ids)), n)
        positions = computed[token_req] + np.arange(int(qsl[-1])) - qsl[token_req]
        seq_lens = computed + n
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        samples = seq_lens == t.num_tokens[slots]
        bitmask = None
        if self.bitmask_provider is not None:
            bitmask = self.bitmask_provider(req_ids, samples)
        return StepBatch(
            req_ids=req_ids,
            token_ids=t.token_ids[slots[token_req], positions],
            positions=positions,
            token_req=token_req,
            block_tables=t.block_table[slots, :width],
            seq_lens=seq_lens,
            query_start_loc=qsl,
            logits_indices=qsl[1:] - 1,
            temperature=t.temperature[slots],
            top_k=t.top_k[slots],
            top_p=t.top_p[slots],
            min_p=t.min_p[slots],
            seeds=t.seed[slots],
            offsets=seq_lens,
            bitmask=bitmask,
            samples=samples,
        )

    # --- eager execution behind every key without a graph --------------------------------------

    @torch.inference_mode()
    def run_eager(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        *inputs, kv_caches = args
        # The fixed buffers hold max_model_len worth of blocks per row; eager gathers only the
        # blocks this step can reach.
        seq_lens = inputs[4]
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        inputs[3] = inputs[3][:, :width]
        return self.step(*inputs, kv_caches)
