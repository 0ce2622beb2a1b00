"""The whole per-token computation of one step as one module: the unit graphrt compiles.

Integers in (token ids, positions, block tables, lengths, sampling parameters), token ids out.
Slot mapping, attention with its cache write, logits at the logits indices, the grammar bitmask
and sampling are all inside.
"""

from __future__ import annotations

import torch
from torch import nn

from graphrt.kernels import canonical
from graphrt.models.attention import AttentionInputs

GRAMMAR_BACKENDS = ("in-graph", "xgrammar-cpu")


class StepModule(nn.Module):
    def __init__(self, model: nn.Module, block_size: int, grammar_backend: str = "in-graph") -> None:
        super().__init__()
        if grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend={grammar_backend!r} is not known; backends: {GRAMMAR_BACKENDS}")
        self.model = model
        self.block_size = block_size
        self.grammar_backend = grammar_backend
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
        logits, bitmask = self.logits(
            input_ids, positions, token_req, block_tables, seq_lens, query_start_loc, logits_indices, bitmask, kv_caches
        )
        return canonical.sample(logits, bitmask, temperature, top_k, top_p, min_p, seeds, offsets)

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
        """The forward up to the logits at ``logits_indices``, and the grammar bitmask still to apply."""
        slot_mapping = canonical.slot_mapping(positions, token_req, block_tables, self.block_size)
        attn = AttentionInputs(block_tables, seq_lens, query_start_loc, token_req, slot_mapping)
        hidden = self.model(input_ids, positions, kv_caches, attn)
        logits = self.model.compute_logits(hidden, logits_indices)
        if self.grammar_backend == "xgrammar-cpu":  # the reference: a host round trip of the logits
            logits = torch.ops.graphrt.xgrammar_bitmask_cpu(logits, bitmask)
            bitmask = torch.full_like(bitmask, -1)
        return logits, bitmask


class VerifyStepModule(StepModule):
    """The verify step: the same forward over each row's last token and its drafts, target logits
    at every draft position and the bonus position (``logits_indices`` is [R·(K+1)], row-major),
    each position's grammar mask, then rejection sampling (``canonical.rejection_sample``, which
    the sampling pass turns into ``graphrt::rejection_sample``). ``offsets`` are each row's sample
    offset at its first position. Returns ``(tokens [R, K+1], logprobs [R, K+1])``: a row's
    accepted drafts, then its correction or bonus token, then −1."""

    def __init__(
        self, model: nn.Module, block_size: int, num_speculative_tokens: int, grammar_backend: str = "in-graph"
    ) -> None:
        super().__init__(model, block_size, grammar_backend)
        self.k = num_speculative_tokens

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
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, bitmask = self.logits(
            input_ids, positions, token_req, block_tables, seq_lens, query_start_loc, logits_indices, bitmask, kv_caches
        )
        return canonical.rejection_sample(
            logits, bitmask, temperature, top_k, top_p, min_p, seeds, offsets, draft_token_ids, num_drafts
        )
