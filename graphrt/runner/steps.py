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
    hidden: torch.Tensor | None = None  # [T, H] final hidden states of the step's tokens (MTP)
    query_start_loc: np.ndarray | None = None  # where each row's tokens sit in ``hidden``


class MainStep:
    kind = "main"

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.block_size = module.block_size

    def prepare(self, table: RequestTable, out: SchedulerOutput, bitmask_provider=None) -> StepBatch:
        t = table
        req_ids = tuple(out.num_scheduled_tokens)
        slots = np.array([t.slot_of[r] for r in req_ids], dtype=np.int64)
        # a decode burst's first step: one token a row, the block tables wide enough for its last
        burst = out.decode_steps - 1
        counts = [1] * len(req_ids) if burst else list(out.num_scheduled_tokens.values())
        positions, token_req, qsl, seq_lens = token_layout(t.num_computed[slots], counts)
        width = max(1, -(-(int(seq_lens.max()) + burst) // self.block_size))
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
            lora_slots=t.lora_slot[slots],
        )

    def read(self, batch: StepBatch, outputs) -> ModelRunnerOutput:
        tokens, logprobs, *hidden = outputs
        # whole tensors to lists, then sliced: a torch slice right after a step costs more (about
        # 50 µs a batch-1 int4 step, its code evicted by the step's weight streams)
        tokens, logprobs = tokens.tolist()[: batch.num_reqs], logprobs.tolist()[: batch.num_reqs]
        result = ModelRunnerOutput(batch.req_ids)
        for r, rid in enumerate(batch.req_ids):
            if batch.samples[r]:
                result.sampled[rid] = [tokens[r]]
                result.logprobs[rid] = [logprobs[r]]
        return with_hidden(result, batch, hidden)

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
        self.vocab = module.model.config.vocab_size
        # request id → the distributions its drafts were drawn from ([≥ n, V]), or None (one-hot);
        # set when the module takes draft distributions (MTP)
        self.draft_probs_of = None

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
                "draft_probs": self.probs(base.req_ids, out.draft_token_ids) if self.module.draft_probs else None,
                "logits_indices": logits_indices,
                "bitmask": bitmask,
                "offsets": base.offsets - num_drafts,  # position 0 samples where a main step would
                "draft_token_ids": drafts,
                "num_drafts": num_drafts,
            }
        )

    def probs(self, req_ids, drafts: dict) -> torch.Tensor:
        """[R, K, V]: each drafted row's draft distributions (one-hot where it has none)."""
        out = torch.zeros(len(req_ids), self.k, self.vocab)
        for r, rid in enumerate(req_ids):
            d = drafts.get(rid, ())
            q = self.draft_probs_of(rid, d) if d and self.draft_probs_of is not None else None
            if q is not None:
                out[r, : len(d)] = q[: len(d)]
            elif d:
                out[r, torch.arange(len(d)), torch.tensor(d)] = 1.0
        return out

    def read(self, batch: StepBatch, outputs) -> ModelRunnerOutput:
        tokens, logprobs, *hidden = outputs
        tokens, logprobs = tokens.tolist()[: batch.num_reqs], logprobs.tolist()[: batch.num_reqs]
        result = with_hidden(ModelRunnerOutput(batch.req_ids), batch, hidden)
        for r, rid in enumerate(batch.req_ids):
            if not batch.samples[r]:
                continue  # a prefill chunk that does not reach the prompt's end
            kept = next((i for i, t in enumerate(tokens[r]) if t < 0), len(tokens[r]))
            result.sampled[rid] = tokens[r][:kept]
            result.logprobs[rid] = logprobs[r][:kept]
            if batch.num_drafts[r]:
                result.num_rejected[rid] = int(batch.num_drafts[r]) + 1 - kept
        return result


def token_layout(computed: np.ndarray, counts: list[int]) -> tuple[np.ndarray, ...]:
    """Each row's ``counts[r]`` tokens after its ``computed[r]``: (positions, token_req,
    query_start_loc, seq_lens). A decode step (one token a row) takes a shorter path: the step's
    numpy calls run with their code and data evicted by the last step's weight streams, so each
    one costs microseconds."""
    rows = len(counts)
    if counts.count(1) == rows:
        qsl = np.arange(rows + 1, dtype=np.int64)
        return computed, qsl[:-1], qsl, computed + 1
    n = np.array(counts, dtype=np.int64)
    qsl = np.concatenate(([0], np.cumsum(n)))
    token_req = np.repeat(np.arange(rows), n)
    positions = computed[token_req] + np.arange(int(qsl[-1])) - qsl[token_req]
    return positions, token_req, qsl, computed + n


def with_hidden(result: ModelRunnerOutput, batch: StepBatch, hidden: list) -> ModelRunnerOutput:
    if hidden:
        result.hidden, result.query_start_loc = hidden[0], batch.query_start_loc
    return result


class MTPStep(MainStep):
    """The MTP step after a main or verify step: every token that step computed and kept, paired
    with the token after it and its final hidden state, through the MTP layer; K drafts a row."""

    kind = "mtp"

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.k = module.k

    def prepare(self, table: RequestTable, out: SchedulerOutput, last: ModelRunnerOutput, rows, block_ids):
        """``rows``: the request ids of the step to run through the MTP layer (still running);
        ``block_ids``: their block tables now (grown to hold the drafts)."""
        order = [r for r, rid in enumerate(last.req_ids) if rid in rows]
        if not order:
            return None
        req_ids = tuple(last.req_ids[r] for r in order)
        ids, pos, hid, counts = [], [], [], []
        for r, rid in zip(order, req_ids):
            s = table.slot_of[rid]
            c0 = int(table.num_computed[s])
            m = out.num_scheduled_tokens[rid] - last.num_rejected.get(rid, 0)
            nxt = table.token_ids[s, c0 + 1 : c0 + m].tolist()
            nxt.append(last.sampled[rid][-1] if rid in last.sampled else int(table.token_ids[s, c0 + m]))
            ids += nxt
            pos += range(c0, c0 + m)
            start = int(last.query_start_loc[r])
            hid.append(last.hidden[start : start + m])
            counts.append(m)
        n = np.array(counts, dtype=np.int64)
        qsl = np.concatenate(([0], np.cumsum(n)))
        positions = np.array(pos, dtype=np.int64)
        seq_lens = positions[qsl[1:] - 1] + 1
        width = min(max(1, -(-int(seq_lens.max() + self.k) // self.block_size)), table.block_table.shape[1])
        # (a row near max_model_len chains past its table: those positions read the null block)
        tables = np.zeros((len(req_ids), width), dtype=np.int64)
        for i, rid in enumerate(req_ids):
            blocks = block_ids[rid][:width]
            tables[i, : len(blocks)] = blocks
        slots = np.array([table.slot_of[rid] for rid in req_ids])
        return StepBatch(
            req_ids=req_ids,
            token_ids=np.array(ids, dtype=np.int64),
            positions=positions,
            token_req=np.repeat(np.arange(len(req_ids)), n),
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            logits_indices=qsl[1:] - 1,
            temperature=table.temperature[slots],
            top_k=table.top_k[slots],
            top_p=table.top_p[slots],
            min_p=table.min_p[slots],
            seeds=table.seed[slots],
            offsets=seq_lens + 1,
            bitmask=None,
            samples=np.ones(len(req_ids), dtype=bool),
            hidden=torch.cat(hid),
        )

    def read(self, batch: StepBatch, outputs) -> dict[str, tuple[list[int], torch.Tensor]]:
        drafts, probs = outputs
        drafts = drafts.tolist()[: batch.num_reqs]
        return {rid: (drafts[r], probs[r]) for r, rid in enumerate(batch.req_ids)}

    @torch.inference_mode()
    def eager(self, *args):
        *inputs, kv_caches = args
        width = max(1, -(-int(inputs[5].max() + self.k) // self.block_size))  # seq_lens, then the drafts
        width = min(width, inputs[4].shape[1])
        inputs[4] = inputs[4][:, :width]  # block_tables
        return self.module(*inputs, kv_caches)
