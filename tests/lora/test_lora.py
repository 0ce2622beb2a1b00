"""LoRA adapters against transformers + peft: greedy tokens and logits per adapter, mixed
batches in compiled graphs, slot eviction, prefix-cache isolation, every bad adapter."""

import json
import os
import shutil

import pytest
import torch

import graphrt
from graphrt import LoRARequest, SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm
from tests.lora.adapters import make_adapter, peft_greedy, peft_logits
from tests.oracle import random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=2_000_000)
ATTN, MLP, ALL = ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("adapters"))


@pytest.mark.parametrize(
    "base, targets, r, alpha, rslora",
    [
        ("llama_gqa", ATTN, 4, 8, False),
        ("llama_gqa", ALL, 8, 16, True),
        ("qwen2_tied", MLP + ("o_proj",), 2, 4, False),
        ("qwen3", ALL, 16, 8, False),
    ],
)
def test_adapter_output_equals_peft(tiny_model, adapter_root, base, targets, r, alpha, rslora):
    path = tiny_model(base)
    adapter = make_adapter(adapter_root, base, targets, r, alpha, seed=r, rslora=rslora)
    lora = LoRARequest("a", 1, adapter)
    llm = make_llm(path, enable_lora=True, max_loras=2, max_lora_rank=16, **OPTS)
    prompts = random_prompts([5, 19, 11], seed=r)
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    assert [o.token_ids for o in got] == [peft_greedy(base, adapter, p, 8) for p in prompts]
    assert [o.token_ids for o in got] != [peft_greedy(base, None, p, 8) for p in prompts]  # the adapter matters
    # log-probabilities within 1e-4 of peft's, at every prompt position (prompt_logprobs)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate([prompts[1]], params, use_tqdm=False, lora_request=lora)[0]
    ref = torch.log_softmax(peft_logits(base, adapter, prompts[1]), dim=-1)
    got_lp = torch.tensor([out.prompt_logprobs[i][t] for i, t in enumerate(prompts[1]) if i > 0])
    want_lp = torch.stack([ref[i - 1, t] for i, t in enumerate(prompts[1]) if i > 0])
    torch.testing.assert_close(got_lp, want_lp, atol=1e-4, rtol=1e-4)


def test_mixed_adapters_in_compiled_graphs_with_eviction(tiny_model, adapter_root, tmp_path):
    base = "llama_gqa"
    path = tiny_model(base)
    adapters = [make_adapter(adapter_root, base, t, r, 2 * r, seed=10 + i) for i, (t, r) in
                enumerate([(ATTN, 4), (ALL, 8), (MLP, 16), (ALL, 2)])]  # fmt: skip
    loras = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]
    sizes = CaptureSizes(decode=(), mixed=(32,))  # one graph: decode steps pad into it
    llm = graphrt.LLM(path, enable_lora=True, max_loras=3, max_lora_rank=16, capture_sizes=sizes,
                      graph_cache=str(tmp_path / "graphs"), progress=False, **OPTS)  # fmt: skip
    compiles = llm.stats()["compiles"]
    prompts = random_prompts([6, 13, 9, 17, 4, 11], seed=3)
    # one batch: three adapters and two base requests (max_num_seqs 4: they queue and mix)
    batch = [loras[0], None, loras[1], loras[2], None, loras[0]]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=batch)]
    want = [peft_greedy(base, lr.lora_path if lr else None, p, 8) for p, lr in zip(prompts, batch)]
    assert got == want
    # a fourth adapter evicts the least recently used one; that one comes back later
    again = [loras[3], loras[0], loras[3], None]
    got = [o.token_ids for o in llm.generate(prompts[:4], GREEDY, use_tqdm=False, lora_request=again)]
    assert got == [peft_greedy(base, lr.lora_path if lr else None, p, 8) for p, lr in zip(prompts, again)]
    stats = llm.stats()
    assert stats["lora_slot_fills"] >= 4 and stats["compiles"] == compiles  # slots filled, nothing compiled
    assert stats["graph_hits"] > 0


def test_no_prefix_cache_hit_across_adapters(tiny_model, adapter_root):
    base = "llama_gqa"
    adapter = make_adapter(adapter_root, base, ATTN, 4, 8, seed=4)
    llm = make_llm(tiny_model(base), enable_lora=True, block_size=4, **OPTS)
    prompt = random_prompts([21], seed=9)[0]
    lora = LoRARequest("a", 1, adapter)
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].token_ids
    hits = llm.stats()["prefix_cache_hits"]
    base_out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids  # same prompt, no adapter
    assert llm.stats()["prefix_cache_hits"] == hits  # nothing shared with the adapter's blocks
    assert base_out == peft_greedy(base, None, prompt, 8)
    assert llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0].token_ids == first
    assert llm.stats()["prefix_cache_hits"] > hits  # the same adapter does share


def damaged(adapter: str, tmp_path, how: str) -> str:
    out = str(tmp_path / how)
    shutil.copytree(adapter, out)
    config = os.path.join(out, "adapter_config.json")
    cfg = json.load(open(config))
    if how == "no-config":
        os.remove(config)
    elif how == "bad-json":
        open(config, "w").write("{not json")
    elif how == "rank":
        cfg["r"] = 32
    elif how == "modules_to_save":
        cfg["modules_to_save"] = ["lm_head"]
    elif how == "dora":
        cfg["use_dora"] = True
    elif how == "no-weights":
        os.remove(os.path.join(out, "adapter_model.safetensors"))
    if how in ("rank", "modules_to_save", "dora"):
        json.dump(cfg, open(config, "w"))
    return out


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", "no such directory"),
        ("no-config", "adapter_config.json is missing"),
        ("bad-json", "not readable as JSON"),
        ("rank", "rank r=32 is above max_lora_rank=16"),
        ("modules_to_save", "modules_to_save .* is not supported"),
        ("dora", "DoRA"),
        ("no-weights", "adapter_model.safetensors is missing"),
    ],
)
def test_bad_adapters_are_refused_at_submission_naming_the_file(tiny_model, adapter_root, tmp_path, how, message):
    adapter = make_adapter(adapter_root, "llama_gqa", ATTN, 4, 8, seed=4)
    path = str(tmp_path / "nowhere") if how == "missing" else damaged(adapter, tmp_path, how)
    llm = make_llm(tiny_model("llama_gqa"), enable_lora=True, **OPTS)
    with pytest.raises(InvalidRequestError, match=message) as e:
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora_request=LoRARequest("bad", 1, path))
    assert path in str(e.value) or how == "missing" and "nowhere" in str(e.value)
    assert not llm.engine.has_unfinished()  # nothing was queued


def test_adapters_of_another_model_or_module_are_refused(tiny_model, adapter_root, tmp_path):
    other = make_adapter(adapter_root, "qwen3", ATTN, 4, 8, seed=4)  # head_dim 32: other shapes
    llm = make_llm(tiny_model("llama_gqa"), enable_lora=True, **OPTS)
    with pytest.raises(InvalidRequestError, match=r"q_proj.lora_[AB] has shape .* the base model needs"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("q", 2, other))
    embed = make_adapter(adapter_root, "llama_gqa", ("q_proj", "lm_head"), 4, 8, seed=4)
    with pytest.raises(InvalidRequestError, match="target module 'lm_head' is not supported"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("e", 3, embed))
    off = make_llm(tiny_model("llama_gqa"), **OPTS)
    with pytest.raises(InvalidRequestError, match="LoRA is off; start the engine with enable_lora=True"):
        off.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("q", 2, other))


def test_a_bad_adapter_leaves_running_requests_alone(tiny_model, adapter_root, tmp_path):
    base = "llama_gqa"
    good = make_adapter(adapter_root, base, ATTN, 4, 8, seed=4)
    llm = make_llm(tiny_model(base), enable_lora=True, **OPTS)
    prompt = random_prompts([7], seed=1)[0]
    rid = llm.engine.add_request(prompt, GREEDY, lora_request=LoRARequest("g", 1, good))
    llm.engine.step()
    with pytest.raises(InvalidRequestError):
        llm.engine.add_request([5, 6], GREEDY, lora_request=LoRARequest("b", 2, str(tmp_path / "none")))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.output(rid).token_ids == peft_greedy(base, good, prompt, 8)


def test_bad_lora_settings(tiny_model):
    with pytest.raises(ValueError, match="max_loras=0 must be an integer in"):
        make_llm(tiny_model("llama_gqa"), enable_lora=True, max_loras=0, **OPTS)
    with pytest.raises(ValueError, match="LoRA serves the Llama family"):
        make_llm(tiny_model("deepseek_v3"), enable_lora=True, **OPTS)
    with pytest.raises(InvalidRequestError, match="lora_int_id 0 must be an integer >= 1"):
        LoRARequest("x", 0, "/p")


def test_lora_served_on_chosen_modules_only(tiny_model, adapter_root):
    base = "llama_gqa"
    qv = make_adapter(adapter_root, base, ATTN, 4, 8, seed=4)
    llm = make_llm(tiny_model(base), enable_lora=True, lora_target_modules=["q_proj", "v_proj"], **OPTS)
    layer = llm.engine.loaded.model.layers[0]
    assert not hasattr(layer.mlp.down_proj, "lora_a") and not hasattr(layer.self_attn.o_proj, "lora_a")
    assert layer.self_attn.qkv_proj.lora_parts == (0, 2)  # q and v, not k
    prompts = random_prompts([6, 12], seed=5)
    got = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("qv", 1, qv))
    assert [o.token_ids for o in got] == [peft_greedy(base, qv, p, 8) for p in prompts]
    wide = make_adapter(adapter_root, base, ALL, 4, 8, seed=5)
    served = r"it targets \['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'up_proj'\]; this engine serves LoRA on"
    with pytest.raises(InvalidRequestError, match=served):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=LoRARequest("wide", 2, wide))
    with pytest.raises(ValueError, match=r"lora_target_modules \['lm_head'\] must be a non-empty subset"):
        make_llm(tiny_model(base), enable_lora=True, lora_target_modules=["lm_head"], **OPTS)


def test_adapters_over_a_quantized_base_in_compiled_graphs(tiny_model, adapter_root):
    """LoRA beside int4 projections (tiles on VNNI CPUs, read by the skinny product in the
    graphs): the same tokens as the adapter over a float model holding the dequantised weights, and
    prompt log-probabilities within 1e-3 (the products carry the activations as two int8 digits)."""
    from graphrt.kernels import NATIVE_ISA, quant_tiles
    from graphrt.loader import load_model
    from graphrt.models.quantized import QuantizedEmbedding, QuantizedLinear, dense_weight

    base = "llama_gqa"
    path = tiny_model(base)
    lora = LoRARequest("a", 1, make_adapter(adapter_root, base, ATTN + ("down_proj",), 4, 8, seed=21))
    graphs = dict(compile=True, backend="eager", capture_sizes=CaptureSizes(decode=(4,), mixed=(32,)))
    opts = dict(enable_lora=True, max_loras=2, max_lora_rank=16, **graphs, **OPTS)
    quantized = make_llm(path, quantization="int4", kv_cache_dtype="float32", **opts)  # the weights alone differ
    dense = load_model(path).model
    for name, m in quantized.engine.loaded.model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            dense.get_submodule(name).weight.data.copy_(dense_weight(m, torch.float32))
    prompts = random_prompts([5, 19, 11], seed=22)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = quantized.generate(prompts, params, use_tqdm=False, lora_request=lora)
    want = make_llm(dense, **opts).generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        lp = [torch.tensor([e[t] for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])]) for o in (g, w)]
        assert (lp[0] - lp[1]).abs().max().item() < 1e-3
    assert quantized.stats()["graph_misses"] == 0
    assert any("use_skinny_gemm" in line for line in quantized.pass_report())
    tiled = [m.tiles is not None for m in quantized.engine.loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert all(tiled) == quant_tiles.wanted(NATIVE_ISA) and any(tiled) == all(tiled)
