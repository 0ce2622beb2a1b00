"""Step objects: what differs between the step kinds — the host batch a step prepares and how its
graph's outputs read back — so that the runner reads the same for every kind.

``MainStep``: prefill / decode rows, one token sampled a row. ``VerifyStep``: a step in which some
decoding rows carry draft tokens, scored in one forward (other rows, prefill chunks included, ride
along with no drafts); each drafted row gets its accepted drafts and one more token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from graphrt.core.scheduler import SchedulerOutput
from graphrt.runner.request_table import RequestTable
from graphrt.runner.step_batch import StepBatch


@dataclass
class ModelRunnerOutput:
    req_ids: tuple[str, ...] = ()
    sampled: dict[str, list[int]] = field(default_factory=dict)  # rows whose prompt is done
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    num_rejected: dict[str, int] = field(default_factory=dict)  # drafts scored but not accepted


class MainStep:
    kind = "main"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.block_size = module.block_size

    def prepare(self, table: RequestTable, out: SchedulerOutput, bitmask_provider=None) -> StepBatch:
        t = table
        req_ids = tuple(out.num_scheduled_tokens)
        slots = np.array([t.slot_of[r] for r in req_ids], dtype=np.int64)
        n = np.array([out.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = t.num_computed[slots]
        qsl = np.concatenate(([0], np.cumsum(n)))
        token_req = np.repeat(np.arange(len(req_ids)), n)
        positions = computed[token_req] + np.arange(int(qsl[-1])) - qsl[token_req]
        seq_lens = computed + n
        width = max(1, -(-int(seq_lens.max()) // self.block_size))
        samples = seq_lens >= t.num_tokens[slots]
        bitmask = bitmask_provider(req_ids, samples) if bitmask_provider is not None else None
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

    def read(self, batch: StepBatch, outputs) -> ModelRunnerOutput:
        tokens, logprobs = outputs
        tokens, logprobs = tokens[: batch.num_reqs].tolist(), logprobs[: batch.num_reqs].tolist()
        result = ModelRunnerOutput(batch.req_ids)
        for r, rid in enumerate(batch.req_ids):
            if batch.samples[r]:
                result.sampled[rid] = [tokens[r]]
                result.logprobs[rid] = [logprobs[r]]
        return result

    @torch.inference_mode()
    def eager(self, *args):
        """The step module over a key's buffers, for keys without a graph. The buffers hold
        max_model_len worth of blocks a row; eager gathers only those the step can reach."""
        *inputs, kv_caches = args
        width = max(1, -(-int(inputs[4].max()) // self.block_size))  # seq_lens
        inputs[3] = inputs[3][:, :width]  # block_tables
        return self.module(*inputs, kv_caches)


class VerifyStep(MainStep):
    kind = "verify"

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.k = module.k

    def prepare(self, table: RequestTable, out: SchedulerOutput, bitmask_provider=None) -> StepBatch:
        for rid, drafts in out.draft_token_ids.items():  # past the request's tokens, for this step only
            s, n = table.slot_of[rid], table.num_tokens[table.slot_of[rid]]
            table.token_ids[s, n : n + len(drafts)] = drafts
        base = super().prepare(table, out)
        r, span = base.num_reqs, self.k + 1
        num_drafts = np.array([len(out.draft_token_ids.get(rid, ())) for rid in base.req_ids], dtype=np.int64)
        drafts = np.zeros((r, self.k), dtype=np.int64)
        for i, rid in enumerate(base.req_ids):
            drafts[i, : num_drafts[i]] = out.draft_token_ids.get(rid, ())
        # logits row (i, j) scores row i's last known token (j = 0), then its drafts; a row without
        # drafts (a prefill chunk, say) is scored at its last token only
        j = np.minimum(np.arange(span)[None, :], num_drafts[:, None])
        last_known = base.query_start_loc[1:] - 1 - num_drafts
        logits_indices = (last_known[:, None] + j).reshape(-1)
        # a constrained row's masks: at its last token (j = 0) and after each accepted draft prefix
        bitmask = bitmask_provider(base.req_ids, base.samples, out.draft_token_ids, span) if bitmask_provider else None
        return StepBatch(
            **{
                **base.__dict__,
                "logits_indices": logits_indices,
                "bitmask": bitmask,
                "offsets": base.offsets - num_drafts,  # position 0 samples where a main step would
                "draft_token_ids": drafts,
                "num_drafts": num_drafts,
            }
        )

    def read(self, batch: StepBatch, outputs) -> ModelRunnerOutput:
        tokens, logprobs = outputs
        tokens, logprobs = tokens[: batch.num_reqs].tolist(), logprobs[: batch.num_reqs].tolist()
        result = ModelRunnerOutput(batch.req_ids)
        for r, rid in enumerate(batch.req_ids):
            if not batch.samples[r]:
                continue  # a prefill chunk that does not reach the prompt's end
            kept = next((i for i, t in enumerate(tokens[r]) if t < 0), len(tokens[r]))
            result.sampled[rid] = tokens[r][:kept]
            result.logprobs[rid] = logprobs[r][:kept]
            if batch.num_drafts[r]:
                result.num_rejected[rid] = int(batch.num_drafts[r]) + 1 - kept
        return result
