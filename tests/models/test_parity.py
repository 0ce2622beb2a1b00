"""The models compute what transformers computes: prefill logits and greedy decoding."""

import pytest
import torch

import graphrt
from graphrt.loader import load_model
from graphrt.models.attention import AttentionInputs, compute_slot_mapping
from tests.helpers import make_llm
from tests.oracle import hf_greedy, hf_model, random_prompts
from tests.tiny_models import TINY_CONFIGS


def prefill_logits(model, cfg, ids: torch.Tensor, block_size: int = 4) -> torch.Tensor:
    """One prefill step of a single sequence through graphrt's forward protocol."""
    t = ids.shape[0]
    nb = -(-t // block_size) + 1
    (kh, kd), (vh, vd) = cfg.kv_cache_dims()
    dtype = model.norm.weight.dtype
    caches = [
        (torch.zeros(nb, block_size, kh, kd, dtype=dtype), torch.zeros(nb, block_size, vh, vd, dtype=dtype))
        for _ in range(cfg.num_layers)
    ]
    bt = torch.arange(1, nb)[None]
    pos, req = torch.arange(t), torch.zeros(t, dtype=torch.long)
    attn = AttentionInputs(
        bt, torch.tensor([t]), torch.tensor([0, t]), req, compute_slot_mapping(pos, req, bt, block_size)
    )
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, caches, attn), torch.arange(t))


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefill_logits_match_transformers(tiny_model, name):
    path = tiny_model(name)
    lm = load_model(path)
    ids = torch.tensor(random_prompts([45])[0])
    ours = prefill_logits(lm.model, lm.config, ids)
    with torch.no_grad():
        ref = hf_model(path)(ids[None], attention_mask=torch.ones(1, 45, dtype=torch.long)).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_batch_matches_transformers_generate(tiny_model, name):
    path = tiny_model(name)
    prompts = random_prompts([3, 11, 30, 7], seed=1)
    llm = make_llm(path, max_num_seqs=4, kv_cache_memory=4_000_000)
    outs = llm.generate(prompts, graphrt.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(path, p, 32)
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_in_memory_transformers_model_loads(tiny_model):
    path = tiny_model("qwen3")
    lm = load_model(hf_model(path))
    ids = torch.tensor(random_prompts([20])[0])
    with torch.no_grad():
        ref = hf_model(path)(ids[None], attention_mask=torch.ones(1, 20, dtype=torch.long)).logits[0]
    torch.testing.assert_close(prefill_logits(lm.model, lm.config, ids), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_rotary_cos_sin_equal_transformers(tiny_model, name, dtype):
    # the same bits at every position up to the model's last, in bf16 too: transformers forms the
    # angles in float32 whatever the dtype (bf16 inverse frequencies were off by 0.09-0.34 here)
    from transformers import AutoModelForCausalLM

    path = tiny_model(name)
    lm = load_model(path, dtype=str(dtype).removeprefix("torch."))
    assert lm.model.rotary.cos_table.dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.rotary_emb
    pos = torch.tensor([0, 1, 7, 100, 300, lm.config.max_position_embeddings - 1])
    cos, sin = lm.model.rotary(pos, dtype)
    ref_cos, ref_sin = ref(torch.zeros(1, len(pos), 1, dtype=dtype), pos[None])
    assert cos.dtype == dtype
    # transformers repeats each frequency's cos and sin for the two halves it turns
    assert torch.equal(ref_cos[0], torch.cat((cos, cos), -1)) and torch.equal(ref_sin[0], torch.cat((sin, sin), -1))


def test_rotary_positions_past_the_table_read_its_last_row(tiny_model):
    # MTP's chained drafts of a row at max_model_len run past the model's last position
    lm = load_model(tiny_model("deepseek_v3"))
    last = lm.config.max_position_embeddings - 1
    cos, sin = lm.model.rotary(torch.tensor([last, last + 1, last + 3]), torch.float32)
    assert torch.equal(cos[1:], cos[:1].expand(2, -1)) and torch.equal(sin[1:], sin[:1].expand(2, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_transformers_bits(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from graphrt.models.layers import apply_rotary

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=g).to(dtype), torch.randn(5, 2, 16, generator=g).to(dtype)
    angles = torch.randn(5, 8, generator=g) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    full = lambda t: torch.cat((t, t), -1)[None]  # noqa: E731 - transformers' [1, T, head_dim]
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full(cos), full(sin))
    assert torch.equal(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1))
    # a partial rotation turns the first 2 * half dims and passes the rest through
    part = apply_rotary(q, cos[:, :4], sin[:, :4])
    assert torch.equal(part[..., 8:], q[..., 8:])
    ref_part, _ = apply_rotary_pos_emb(
        q[..., :8].transpose(0, 1)[None], k[..., :8].transpose(0, 1)[None], full(cos[:, :4]), full(sin[:, :4])
    )
    assert torch.equal(part[..., :8], ref_part[0].transpose(0, 1))


def test_bfloat16_prefill_close_to_transformers_bf16(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama_gqa")
    lm = load_model(path, dtype="bfloat16")
    assert lm.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.tensor(random_prompts([30])[0])
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = ref_model(ids[None], attention_mask=torch.ones(1, 30, dtype=torch.long)).logits[0].float()
    ours = prefill_logits(lm.model, lm.config, ids).float()
    # bf16 keeps 8 bits of mantissa: compare at the scale of the logits
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()
