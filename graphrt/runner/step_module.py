"""The whole per-token computation of one step as one module: the unit graphrt compiles.

Integers in (token ids, positions, block tables, lengths, sampling parameters), token ids out.
Slot mapping, attention with its cache write, logits at the logits indices, the grammar bitmask
and sampling are all inside.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import canonical
from graphrt.lora.projection import token_slots
from graphrt.models.attention import AttentionInputs

GRAMMAR_BACKENDS = ("in-graph", "xgrammar-cpu")


class StepModule(nn.Module):
    def __init__(
        self, model: nn.Module, block_size: int, grammar_backend: str = "in-graph", return_hidden: bool = False
    ) -> None:
        super().__init__()
        if grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend={grammar_backend!r} is not known; backends: {GRAMMAR_BACKENDS}")
        self.model = model
        self.block_size = block_size
        self.grammar_backend = grammar_backend
        self.return_hidden = return_hidden  # MTP drafting reads every token's final hidden state
        if grammar_backend == "xgrammar-cpu":
            import graphrt.grammar.reference_op  # noqa: F401  (registers the op)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_req: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,
        bitmask: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, bitmask, hidden = self.logits(
            input_ids, positions, token_req, block_tables, seq_lens, query_start_loc, logits_indices, bitmask, kv_caches
        )
        tokens, logprobs = canonical.sample(logits, bitmask, temperature, top_k, top_p, min_p, seeds, offsets)
        return (tokens, logprobs, hidden) if self.return_hidden else (tokens, logprobs)

    def logits(
        self,
        input_ids,
        positions,
        token_req,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
        bitmask,
        kv_caches,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward up to the logits at ``logits_indices``, the grammar bitmask still to apply,
        and the final hidden states."""
        slot_mapping = canonical.slot_mapping(positions, token_req, block_tables, self.block_size)
        lora = token_slots(self.model, token_req)  # None without adapters
        attn = AttentionInputs(block_tables, seq_lens, query_start_loc, token_req, slot_mapping, lora)
        hidden = self.model(input_ids, positions, kv_caches, attn)
        logits = self.model.compute_logits(hidden, logits_indices)
        if self.grammar_backend == "xgrammar-cpu":  # the reference: a host round trip of the logits
            logits = torch.ops.graphrt.xgrammar_bitmask_cpu(logits, bitmask)
            bitmask = torch.full_like(bitmask, -1)
        return logits, bitmask, hidden


class VerifyStepModule(StepModule):
    """The verify step: the same forward over each row's last token and its drafts, target logits
    at every draft position and the bonus position (``logits_indices`` is [R·(K+1)], row-major),
    each position's grammar mask, then rejection sampling (``canonical.rejection_sample``, or
    ``rejection_sample_by_ratio`` when drafts come with their distributions, ``draft_probs``
    [R, K, V], as MTP drafts do; the sampling pass turns either into ``graphrt::rejection_sample``).
    ``offsets`` are each row's sample offset at its first position. Returns ``(tokens [R, K+1],
    logprobs [R, K+1])``: a row's accepted drafts, then its correction or bonus token, then −1."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        num_speculative_tokens: int,
        grammar_backend: str = "in-graph",
        return_hidden: bool = False,
        draft_probs: bool = False,
    ) -> None:
        super().__init__(model, block_size, grammar_backend, return_hidden)
        self.k = num_speculative_tokens
        self.draft_probs = draft_probs

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_req: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,
        bitmask: torch.Tensor,
        draft_token_ids: torch.Tensor,
        num_drafts: torch.Tensor,
        *rest,  # (draft_probs, kv_caches) with draft distributions, else (kv_caches,)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv_caches = rest[-1]
        logits, bitmask, hidden = self.logits(
            input_ids, positions, token_req, block_tables, seq_lens, query_start_loc, logits_indices, bitmask, kv_caches
        )
        params = (temperature, top_k, top_p, min_p, seeds, offsets, draft_token_ids, num_drafts)
        if self.draft_probs:
            tokens, logprobs = canonical.rejection_sample_by_ratio(logits, bitmask, *params, rest[0])
        else:
            tokens, logprobs = canonical.rejection_sample(logits, bitmask, *params)
        return (tokens, logprobs, hidden) if self.return_hidden else (tokens, logprobs)


class MTPStepModule(nn.Module):
    """The MTP step: the model's MTP layer over the tokens the last step computed (each paired with
    its final hidden state; its latent written to the MTP layer's cache), then K drafts a row in
    one graph: draft 1 from each row's last token, drafts 2..K by running the same layer on the
    draft before (one token a row, at the next position). Greedy rows draft the argmax; random
    rows draw from the MTP distribution after their temperature and filters (a stream of their
    own). Returns ``(drafts [R, K], draft_probs [R, K, V])``."""

    def __init__(self, model: nn.Module, block_size: int, num_speculative_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.block_size = block_size
        self.k = num_speculative_tokens

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: the token after each position
        hidden: torch.Tensor,  # [T, H]: the final hidden state at each position
        positions: torch.Tensor,
        token_req: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,  # [R]: each row's last token
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        seeds: torch.Tensor,
        offsets: torch.Tensor,  # [R]: draft 1's sample offset
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = kv_caches[self.model.config.num_layers]  # the MTP layer's own cache, after the model's
        slots = canonical.slot_mapping(positions, token_req, block_tables, self.block_size)
        attn = AttentionInputs(block_tables, seq_lens, query_start_loc, token_req, slots)
        h = self.model.mtp_forward(0, input_ids, hidden, positions, cache, attn)[logits_indices]  # [R, H]
        rows = torch.arange(logits_indices.shape[0], device=positions.device)
        real = seq_lens > 0
        row_of = torch.where(real, rows, -1)
        pos, lens = positions[logits_indices], seq_lens
        drafts, probs = [], []
        for j in range(self.k):
            logits = self.model.compute_logits(h, rows)
            token, q = canonical.draft_sample(logits, temperature, top_k, top_p, min_p, seeds, offsets + j)
            drafts.append(token)
            probs.append(q)
            if j + 1 < self.k:
                # the next position (past max_model_len: block-table columns of the null block)
                pos, lens = pos + 1, lens + real.long()
                slots = canonical.slot_mapping(pos, row_of, block_tables, self.block_size)
                step = AttentionInputs(block_tables, lens, torch.cat((rows.new_zeros(1), rows + 1)), row_of, slots)
                h = self.model.mtp_forward(0, token, h, pos, cache, step)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1)
