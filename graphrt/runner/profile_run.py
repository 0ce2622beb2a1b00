"""The worst-case step's memory: one dummy step at the largest batch and token budget."""

from __future__ import annotations

import torch

from graphrt.core.block_manager import BlockManager
from graphrt.core.request import Request
from graphrt.core.scheduler import NewRequestData, SchedulerConfig, SchedulerOutput
from graphrt.models.config import ModelConfig
from graphrt.runner.graph_cache import GraphCache
from graphrt.runner.kv_cache import allocate_kv_caches, peak_growth
from graphrt.runner.model_runner import ModelRunner
from graphrt.sampling_params import SamplingParams


def worst_case_step_memory(
    step_module: torch.nn.Module,
    graphs: GraphCache,
    sched: SchedulerConfig,
    model_config: ModelConfig,
    kv_dtype: torch.dtype,
    block_size: int,
) -> int:
    """Run one dummy step (one long prefill row, the other rows decoding) on caches of its own;
    returns its peak memory growth in bytes (``peak_growth``: process RSS on CPU)."""
    num_tokens = sched.max_num_batched_tokens
    num_reqs = min(sched.max_num_seqs, num_tokens)
    lens = [num_tokens - (num_reqs - 1)] + [1] * (num_reqs - 1)
    blocks = BlockManager(num_reqs * graphs.max_blocks + 1, block_size, False)
    caches = allocate_kv_caches(model_config, blocks.pool.num_blocks, block_size, kv_dtype)
    runner = ModelRunner(step_module, caches, graphs, num_reqs, sched.max_model_len)
    new, scheduled = [], {}
    for i, n in enumerate(lens):
        rid = f"profile-{i}"
        ctx = max(n, 2)
        req = Request(rid, [0] * ctx, SamplingParams(max_tokens=1, temperature=1.0, top_k=5), seed=0)
        new.append(NewRequestData(rid, tuple(req.prompt_token_ids), (), tuple(blocks.allocate(rid, ctx)), ctx - n, req))
        scheduled[rid] = n
    _, growth = peak_growth(lambda: runner.execute(SchedulerOutput(tuple(new), (), scheduled, frozenset())))
    return growth
