"""DeepSeek-V3's MTP layer against transformers' own MTP implementation (``MtpModel``)."""

import pytest
import torch

from graphrt.loader import load_model
from graphrt.models.attention import AttentionInputs, compute_slot_mapping
from tests.oracle import hf_model, random_prompts
from tests.tiny_models import make_mtp_oracle, save_tiny_with_mtp


@pytest.fixture(scope="module")
def mtp_path(tiny_root):
    return save_tiny_with_mtp(tiny_root)


def prefill_attn(t: int, block_size: int = 4):
    nb = -(-t // block_size) + 1
    bt = torch.arange(1, nb)[None]
    pos, req = torch.arange(t), torch.zeros(t, dtype=torch.long)
    return (
        nb,
        pos,
        AttentionInputs(bt, torch.tensor([t]), torch.tensor([0, t]), req, compute_slot_mapping(pos, req, bt, 4)),
    )


def test_mtp_draft_logits_match_transformers_mtp(mtp_path):
    lm = load_model(mtp_path)
    model, cfg = lm.model, lm.config
    assert len(model.mtp) == 1 and model.mtp_missing == []
    ids = torch.tensor(random_prompts([30], seed=5)[0])
    n = ids.shape[0]
    hf = hf_model(mtp_path)
    oracle = make_mtp_oracle(hf)
    with torch.no_grad():
        out = hf(ids[None], attention_mask=torch.ones(1, n, dtype=torch.long), output_hidden_states=True)
        h = out.hidden_states[-1]  # the final (normalised) hidden states, as generate(use_mtp=True) feeds them
        # transformers' convention: the token after position p sits at p + 1; graphrt's at p (same relative positions)
        ref_h = oracle.forward_layer(0, h[:, : n - 1], torch.arange(1, n)[None], None, input_ids=ids[None, 1:])
        ref = oracle._project_to_logits(ref_h)[0]
        nb, pos, attn = prefill_attn(n)
        (kh, kd), (vh, vd) = cfg.kv_cache_dims()
        caches = [(torch.zeros(nb, 4, kh, kd), torch.zeros(nb, 4, vh, vd)) for _ in range(cfg.num_layers + 1)]
        hidden = model(ids, pos, caches, attn)
        torch.testing.assert_close(hidden, h[0], atol=1e-4, rtol=0)
        _, pos, attn = prefill_attn(n - 1)
        ours_h = model.mtp_forward(0, ids[1:], hidden[:-1], pos, caches[-1], attn)
        ours = model.compute_logits(ours_h, torch.arange(n - 1))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_a_checkpoint_without_mtp_layers_loads_without_them(tiny_model):
    lm = load_model(tiny_model("deepseek_v3"))
    assert len(lm.model.mtp) == 0
    assert lm.model.mtp_missing[0] == "model.layers.3.enorm.weight"
