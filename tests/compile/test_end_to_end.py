"""Compiled steps end to end: fused graphs, and compile=True == compile=False == transformers."""

import collections

import pytest
import torch

import graphrt
from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from tests.helpers import make_llm
from tests.oracle import hf_greedy, random_prompts

SIZES = CaptureSizes(decode=(4,), mixed=(32,))  # two graphs: keep cold compiles few
OPTS = dict(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=4_000_000, capture_sizes=SIZES)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def op_counts(llm):
    out = {}
    for key, graph in llm.engine.graphs.graphs.items():
        out[key.name] = collections.Counter(
            str(n.target) for n in graph.gm.graph.nodes if n.op in ("call_function", "call_method")
        )
    return out


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_tied", "qwen3", "deepseek_v3"])
def test_compiled_graphs_are_fused_and_exact(tiny_model, name, tmp_path):
    path = tiny_model(name)
    # the Llama builds a decode graph and a mixed one; the others one mixed graph, which their
    # decode steps replay too (padded): the fusions do not depend on the shape, compiles cost
    sizes = SIZES if name == "llama_gqa" else CaptureSizes(decode=(), mixed=(32,))
    graphs = len(sizes.decode) + len(sizes.mixed)
    compiled = graphrt.LLM(
        path, progress=False, graph_cache=str(tmp_path / "graphs"), **{**OPTS, "capture_sizes": sizes}
    )
    stats = compiled.stats()
    assert stats["compiles"] == graphs
    cfg = compiled.engine.loaded.config
    attention = "graphrt.mla_attention.default" if cfg.mla else "graphrt.paged_attention.default"
    for graph, counts in op_counts(compiled).items():
        assert counts[attention] == cfg.num_layers, graph
        if cfg.moe:
            assert counts["graphrt.moe_experts.default"] == cfg.num_layers - cfg.moe.first_dense_layers, graph
        assert counts["graphrt.slot_mapping.default"] == 1, graph
        assert counts["graphrt.sample.default"] == 1, graph
        assert not any("softmax" in t or "einsum" in t or "index_copy" in t for t in counts), graph
    prompts = random_prompts([3, 25, 9, 40, 14], seed=20)  # 40 > 32: a chunked prefill too
    eager = make_llm(path, **OPTS)
    got = [o.token_ids for o in compiled.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert got == [hf_greedy(path, p, 16) for p in prompts]
    after = compiled.stats()
    assert after["compiles"] == graphs and after["graph_misses"] == 0 and after["graph_hits"] > 0
    assert after["free_blocks"] == after["total_blocks"]
    # seeded sampling is the same in graph and eager mode
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
    assert any("fuse_attention=" in line for line in compiled.pass_report())


def test_disabling_a_pass_removes_its_rewrite_and_keeps_outputs(tiny_model):
    path = tiny_model("llama_gqa")
    llm = graphrt.LLM(path, progress=False, backend="eager", passes_disabled=["fuse_attention"], **OPTS)
    for counts in op_counts(llm).values():
        assert counts["graphrt.paged_attention.default"] == 0
        assert counts["graphrt.slot_mapping.default"] == 1 and counts["graphrt.sample.default"] == 1
    prompts = random_prompts([5, 20], seed=21)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [hf_greedy(path, p, 16) for p in prompts]
    assert all("fuse_attention" not in line for line in llm.pass_report())


def test_a_model_the_passes_cannot_fuse_still_runs_and_is_reported(tiny_model, monkeypatch):
    import graphrt.models.llama as llama_mod
    from graphrt.kernels import canonical

    def other_spelling(q, k, v, k_cache, v_cache, attn, scale):
        # softmax in float64: a spelling the attention pattern does not claim
        keys_vals = canonical._write_gather_mask(
            k,
            v,
            k_cache,
            v_cache,
            attn.slot_mapping,
            attn.block_tables,
            attn.seq_lens,
            attn.query_start_loc,
            attn.token_req,
        )
        keys, values, allowed = keys_vals
        t, h, d = q.shape
        hkv = k_cache.shape[2]
        scores = torch.einsum("tkgd,tlkd->tkgl", q.reshape(t, hkv, h // hkv, d), keys).double() * scale
        probs = torch.softmax(scores.masked_fill(~allowed[:, None, None, :], float("-inf")), -1).to(q.dtype)
        return torch.einsum("tkgl,tlkd->tkgd", probs, values).reshape(t, h * d)

    monkeypatch.setattr(llama_mod, "attention", other_spelling)
    path = tiny_model("llama_gqa")
    llm = graphrt.LLM(path, progress=False, backend="eager", **OPTS)
    report = llm.pass_report()
    assert all("fuse_attention=0 (unmatched 4)" in line for line in report), report
    prompts = random_prompts([6, 17], seed=22)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == [hf_greedy(path, p, 16) for p in prompts]


def test_graphrt_compile_and_verbose_report(tiny_tok_model, capsys):
    from graphrt.cli import main

    llm = graphrt.compile(tiny_tok_model, backend="eager", progress=False, **OPTS)
    assert llm.stats()["compiles"] == 2 and len(llm.pass_report()) == 2
    rc = main(
        [
            "generate",
            "--model",
            tiny_tok_model,
            "--backend",
            "eager",
            "--prompt",
            "Hi",
            "--max-tokens",
            "3",
            "--max-num-seqs",
            "1",
            "--max-num-batched-tokens",
            "16",
            "--kv-cache-memory",
            "4000000",
            "--verbose",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0 and "passes main-" in err and "fuse_attention=2" in err and "compiled, ready after" in err
    assert "start-up" in err and "(0 loaded, 2 compiled)" in err and "first token" in err
