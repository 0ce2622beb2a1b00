"""The thin runner: request states in, one graph replay per step, sampled token ids out.

``execute`` reads as the step's table of contents: update states, choose the step kind, prepare
the host batch, dispatch it to a graph key, load the key's buffers, run the key's graph, read the
tokens back (and in a decode burst replay it for the burst's further steps, ``decode_burst.py``);
the whole of it is timed per key, host work included, for the drafter's cost model.
What differs between step kinds lives in the step objects (``steps.py``).
"""

from __future__ import annotations

import functools
import time

import torch

from graphrt.core.scheduler import SchedulerOutput
from graphrt.runner.decode_burst import run_burst
from graphrt.runner.graph_cache import GraphCache
from graphrt.runner.request_table import RequestTable
from graphrt.runner.step_module import StepModule
from graphrt.runner.step_times import StepTimes
from graphrt.runner.steps import MainStep, ModelRunnerOutput, MTPStep, VerifyStep

__all__ = ["ModelRunner", "ModelRunnerOutput"]


class ModelRunner:
    def __init__(
        self,
        step: StepModule,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        graphs: GraphCache,
        max_num_seqs: int,
        max_model_len: int,
        verify: StepModule | None = None,
        mtp: torch.nn.Module | None = None,
        adapter_slots=None,
        mm_buffers=None,
    ) -> None:
        self.steps = {"main": MainStep(step)}
        if verify is not None:
            self.steps["verify"] = VerifyStep(verify)
        if mtp is not None:
            self.steps["mtp"] = MTPStep(mtp)
        self.kv_caches = kv_caches
        self.graphs = graphs
        self.step_times = StepTimes()
        self.table = RequestTable(max_num_seqs, max_model_len, graphs.max_blocks)
        # (req_ids, samples) → [R, words] int32 bitmask or None; set by the engine for grammars
        self.bitmask_provider = None
        self.adapter_slots = adapter_slots  # LoRA: each step's rows' adapter slots go into the model
        self.mm_buffers = mm_buffers  # images: each step's placeholder tokens' embeddings go into the model

    # --- the step -----------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        self.update_states(out)
        if out.is_empty:
            return ModelRunnerOutput()
        step = self.steps["verify" if out.draft_token_ids else "main"]
        batch = step.prepare(self.table, out, self.bitmask_provider)
        key = self.graphs.dispatch(batch, step.kind)
        buffers = self.graphs.buffers(key)
        buffers.load(batch)
        if self.adapter_slots is not None:
            self.adapter_slots.load_rows(batch.lora_slots)
        if self.mm_buffers is not None:
            self.mm_buffers.load(batch.token_req, batch.positions, batch.req_ids, self.table.mm_input.get)
        replay = functools.partial(self.graphs.run, key, step.eager, self.kv_caches)
        result = step.read(batch, replay())
        steps = 1
        if out.decode_steps > 1:
            result = run_burst(result, batch, buffers, out.decode_steps, replay, self.table.stop_ids)
            steps = out.decode_steps - max(result.num_rejected.values(), default=0)
        self.step_times.record(key, (time.perf_counter() - start) / steps)  # a step, host work included
        return result

    def draft(self, out: SchedulerOutput, last: ModelRunnerOutput, rows, block_ids) -> dict:
        """The MTP step after ``execute``: ``rows`` (request ids of that step) through the MTP
        layer; returns each row's drafts and their distributions."""
        start = time.perf_counter()
        step = self.steps["mtp"]
        batch = step.prepare(self.table, out, last, rows, block_ids)
        if batch is None:
            return {}
        key = self.graphs.dispatch(batch, step.kind)
        self.graphs.buffers(key).load(batch)
        drafts = step.read(batch, self.graphs.run(key, step.eager, self.kv_caches))
        self.step_times.record(key, time.perf_counter() - start)
        return drafts

    def update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_request_ids:
            self.table.remove(rid)
        for new in out.new_requests:
            self.table.add(new)
        for cached in out.cached_requests:
            self.table.update(cached)
