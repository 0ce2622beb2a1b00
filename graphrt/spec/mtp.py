"""MTP drafting around the engine's step: which model can draft with MTP, and the MTP step run
after every step for the requests that draft."""

from __future__ import annotations

from graphrt.models.config import UnsupportedModelError


def check_mtp(model) -> None:
    """``method="mtp"`` needs a checkpoint with exactly one MTP layer (DeepSeek-V3 ships one)."""
    layers = getattr(model, "mtp", None)
    if not layers:
        missing = getattr(model, "mtp_missing", None) or []
        what = (
            f"missing tensors: {missing[:4]}{' …' if len(missing) > 4 else ''}"
            if missing
            else (f"{type(model).__name__} has no MTP layers")
        )
        raise ValueError(f'speculative_config method="mtp" needs the checkpoint\'s MTP layers; {what}')
    if len(layers) > 1:
        raise UnsupportedModelError(
            f"num_nextn_predict_layers={len(layers)} is not supported for MTP drafting; supported: 1"
        )


def run_mtp(engine, out, result) -> None:
    """After a step: every still-running request of it that drafts with MTP goes through the MTP
    layer (the MTP cache must hold every position it computed); each gets room for its drafts
    in its block table, and its drafts are remembered for the next step."""
    drafter, blocks, k = engine.proposer, engine.blocks, engine.spec.num_speculative_tokens
    rows = set()
    for rid in out.num_scheduled_tokens:
        tracked = engine._tracked.get(rid)
        if tracked is None or tracked.request.finished:
            drafter.forget(rid, finished=True)
            continue
        req = tracked.request
        if not drafter.wants_mtp(req):
            drafter.forget(rid)
            continue
        # room for the chained drafts, within max_model_len (kept as is when short of blocks)
        blocks.allocate(rid, min(req.num_tokens + k, engine.max_model_len))
        rows.add(rid)
    if not rows:
        return
    made = engine.runner.draft(out, result, rows, {rid: blocks.tables[rid] for rid in rows})
    for rid, (drafts, probs) in made.items():
        req = engine._tracked[rid].request
        drafter.remember(rid, req.num_tokens, drafts, probs)
