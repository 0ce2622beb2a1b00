"""Packed bf16 models end to end (kernels/packed_bf16.py, models/packed.py): an engine that
compiles packs its bf16 projections and embedding, its graphs read them through
``graphrt::linear_packed_bf16`` at every row count, and it computes what the row-major engine and
``transformers`` compute; a package that calls the op loads in a fresh process with no compile."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from graphrt import SamplingParams
from graphrt.models.packed import PackedEmbedding, PackedLinear, use_packed_bf16
from tests.helpers import EAGER_GRAPHS, make_llm
from tests.models.test_quantized_models import prompt_logprob_values
from tests.oracle import random_prompts

COMMON = dict(EAGER_GRAPHS, dtype="bfloat16")
PARAMS = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0, ignore_eos=True)


def transformers_prompt_logprobs(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    out = []
    for p in prompts:
        ids = torch.tensor(p)[None]
        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        out.append(lp[:-1].gather(-1, ids[0, 1:, None])[:, 0])
    return out


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied"])
def test_a_compiling_engine_packs_and_computes_what_the_row_major_one_does(tiny_model, monkeypatch, name):
    path = tiny_model(name)
    prompts = random_prompts([30, 9, 17], seed=12)
    monkeypatch.setenv("GRAPHRT_PACKED_BF16", "1")  # on any CPU: without AMX the op's fallback runs
    packed = make_llm(path, **COMMON)
    model = packed.engine.loaded.model
    assert isinstance(model.embed_tokens, PackedEmbedding) and model.embed_tokens.packed.dtype == torch.bfloat16
    assert isinstance(model.layers[1].self_attn.qkv_proj, PackedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    assert not any(type(m) is nn.Linear for m in model.modules())
    # every projection of every graph, prefill included, reads the packed matrix: 2 layers x 4 + LM head
    assert all("use_skinny_gemm=9" in line for line in packed.pass_report() if "use_skinny_gemm" in line)
    outs = packed.generate(prompts, PARAMS)
    assert packed.stats()["graph_misses"] == 0
    monkeypatch.setenv("GRAPHRT_PACKED_BF16", "0")
    plain = make_llm(path, **COMMON)
    assert not any(isinstance(m, (PackedLinear, PackedEmbedding)) for m in plain.engine.loaded.model.modules())
    ref = plain.generate(prompts, PARAMS)
    oracle = transformers_prompt_logprobs(path, prompts)
    for p, r, o in zip(prompt_logprob_values(outs), prompt_logprob_values(ref), oracle):
        # both engines round the same bf16 products once each, summed in another order; a
        # wrong pair order, half or block moves these by whole units
        assert (p - r).abs().max().item() < 0.1, (p - r).abs().max()
        assert (p - o).abs().max().item() < 0.2, (p - o).abs().max()


def test_only_bf16_matrices_of_whole_blocks_are_packed():
    model = nn.Sequential(
        nn.Linear(64, 96).bfloat16(), nn.Linear(96, 40).bfloat16(), nn.Linear(64, 64), nn.Embedding(64, 32).bfloat16()
    )
    assert use_packed_bf16(model) == 2
    assert [type(m).__name__ for m in model] == ["PackedLinear", "Linear", "Linear", "PackedEmbedding"]
    assert use_packed_bf16(model) == 2  # already packed: nothing packed twice
    shared = nn.Linear(64, 64).bfloat16()
    twice = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    assert use_packed_bf16(twice) == 1 and twice["a"][0] is twice["b"][0]  # one copy for both
    kept = nn.Sequential(nn.Linear(64, 64).bfloat16())
    kept[0].packable = False  # a matrix the model reads whole
    assert use_packed_bf16(kept) == 0 and type(kept[0]) is nn.Linear


def test_deepseek_keeps_its_absorbed_matrix_row_major(tiny_model):
    from graphrt.loader import load_model

    lm = load_model(tiny_model("deepseek_v3"), dtype="bfloat16")
    use_packed_bf16(lm.model)
    attn = lm.model.layers[0].self_attn
    assert type(attn.kv_b_proj) is nn.Linear and isinstance(attn.o_proj, PackedLinear)


RUN = textwrap.dedent("""
    import json, os, sys
    import graphrt
    from graphrt.runner.graph_cache import CaptureSizes
    from torch._dynamo.utils import counters
    llm = graphrt.LLM(sys.argv[1], graph_cache=sys.argv[2], dtype="bfloat16", max_num_seqs=2,
                      max_num_batched_tokens=16, kv_cache_memory=2_000_000, progress=False,
                      capture_sizes=CaptureSizes(decode=(2,), mixed=()))
    params = graphrt.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(json.loads(sys.argv[3]), params)
    kinds = sorted({type(m).__name__ for m in llm.engine.loaded.model.modules()})
    logprobs = [[e[t] for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:])] for o in outs]
    print(json.dumps({"tokens": [o.token_ids for o in outs], "stats": llm.stats(), "kinds": kinds,
                      "prompt_logprobs": logprobs,
                      "how": [r.how for r in llm.capture_report()],
                      "dynamo_graphs": counters["stats"]["unique_graphs"]}))
""")


def test_a_package_calling_the_packed_product_loads_in_a_fresh_process(tiny_model, tmp_path):
    import os
    import zipfile

    path = tiny_model("llama_gqa")
    out = str(tmp_path / "graphs")
    env = {**os.environ, "GRAPHRT_PACKED_BF16": "1"}
    subprocess.run(
        [sys.executable, "-m", "graphrt.cli", "precompile", "--model", path, "--out", out, "--dtype", "bfloat16",
         "--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--kv-cache-memory", "2000000",
         "--capture-sizes", "2", "--mixed-sizes", ""],
        check=True, capture_output=True, env=env,
    )  # fmt: skip
    (entry,) = json.load(open(os.path.join(out, "manifest.json")))["entries"].values()
    with zipfile.ZipFile(os.path.join(out, entry["file"])) as z:
        wrapper = z.read(next(n for n in z.namelist() if n.endswith(".wrapper.cpp"))).decode()
    # each entry point declared once (every shim is), then called: the packed product 9 times, the
    # row-major one never
    assert wrapper.count("aoti_torch_cpu_linear_packed_bf16(") == 1 + 9
    assert wrapper.count("aoti_torch_cpu_linear(") == 1
    prompts = random_prompts([4, 7], seed=50)
    run = subprocess.run(
        [sys.executable, "-c", RUN, path, out, json.dumps(prompts)], capture_output=True, text=True, check=True, env=env
    )
    warm = json.loads(run.stdout.strip().splitlines()[-1])
    assert warm["how"] == ["loaded"] and warm["stats"]["compiles"] == 0 and warm["dynamo_graphs"] == 0
    assert "PackedLinear" in warm["kinds"] and "Linear" not in warm["kinds"]
    assert all(len(t) == 8 for t in warm["tokens"])
    for got, want in zip(warm["prompt_logprobs"], transformers_prompt_logprobs(path, prompts)):
        assert (torch.tensor(got) - want).abs().max().item() < 0.2


def test_lora_over_packed_projections(tiny_model, tmp_path, monkeypatch):
    """An adapter's delta beside packed projections (project(): the base product, then the delta):
    the packed engine's prompt log-probabilities with the adapter are the row-major engine's, and
    the adapter moves them."""
    from graphrt import LoRARequest
    from tests.lora.adapters import make_adapter

    path = tiny_model("llama_gqa")
    lora = LoRARequest(
        "a", 1, make_adapter(str(tmp_path), "llama_gqa", ("q_proj", "v_proj", "down_proj"), 4, 64, seed=5)
    )
    opts = dict(COMMON, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompts = random_prompts([19, 11], seed=23)

    def logprobs(packed: str, adapter):
        monkeypatch.setenv("GRAPHRT_PACKED_BF16", packed)
        llm = make_llm(path, **opts)
        kinds = {type(m) for m in llm.engine.loaded.model.modules()}
        assert (PackedLinear in kinds) == (packed == "1")
        return prompt_logprob_values(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=adapter))

    with_packed, with_plain, without = logprobs("1", lora), logprobs("0", lora), logprobs("1", None)
    for p, r, n in zip(with_packed, with_plain, without):
        assert (p - r).abs().max().item() < 0.1
        assert (p - n).abs().max().item() > 0.3  # the adapter matters
