"""``graphrt::moe_experts``: the routed experts of a mixture-of-experts layer, as one op.

Each token goes through its top-k experts (a SiLU-gated MLP each, gate and up stacked) and the
results are summed with the router's weights. The body groups the tokens by expert and runs one
matmul pair per expert that any token chose: each chosen expert's weights are read once per step,
whatever the number of tokens, and experts nobody chose are not read at all. Inside a compiled
graph the op is opaque, so the data-dependent grouping never reaches the graph: one static graph
serves every routing.
"""

import torch
import torch.nn.functional as F

from graphrt.kernels import checks
from graphrt.kernels.op_library import define


def _moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros_like(x)
    inter = w_down.shape[2]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        picks = order[start : start + n]
        start += n
        tokens, slot = picks // topk_ids.shape[1], picks % topk_ids.shape[1]
        gate, up = F.linear(x[tokens], w_gate_up[e]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * topk_weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def _moe_experts_fake(x, topk_ids, topk_weights, w_gate_up, w_down):
    return torch.empty_like(x)


define(
    "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up, Tensor w_down) -> Tensor",
    _moe_experts,
    _moe_experts_fake,
)


def moe_experts(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; topk_ids [T, k] (int, in [0, E)) and topk_weights [T, k]; w_gate_up
    [E, 2·I, H] (gate rows, then up rows) and w_down [E, H, I]. Returns
    ``Σ_k w[t, k] · down_e(silu(gate_e(x_t)) · up_e(x_t))`` for e = topk_ids[t, k], [T, H]."""
    checks.check_ndim("x", x, 2, "[num_tokens, hidden]")
    checks.check_ndim("topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    checks.check_int("topk_ids", topk_ids)
    checks.check_dim("topk_ids", topk_ids, 0, x.shape[0], "num_tokens of x")
    if topk_weights.shape != topk_ids.shape:
        raise checks.KernelArgumentError(
            f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}"
        )
    checks.check_ndim("w_gate_up", w_gate_up, 3, "[num_experts, 2 * intermediate, hidden]")
    checks.check_ndim("w_down", w_down, 3, "[num_experts, hidden, intermediate]")
    num_experts, hidden, inter = w_down.shape
    if w_gate_up.shape != (num_experts, 2 * inter, hidden):
        raise checks.KernelArgumentError(
            f"w_gate_up shape {tuple(w_gate_up.shape)} must be {(num_experts, 2 * inter, hidden)} for w_down "
            f"{tuple(w_down.shape)}"
        )
    checks.check_dim("x", x, 1, hidden, "hidden of w_down")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise checks.KernelArgumentError(f"topk_ids must lie in [0, {num_experts}), got {topk_ids.tolist()}")
    return torch.ops.graphrt.moe_experts(x, topk_ids, topk_weights, w_gate_up, w_down)
