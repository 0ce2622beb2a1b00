"""The shipped graph cache: precompile, copy, warm start with no compile, and tamper resistance."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import graphrt
from graphrt import SamplingParams
from graphrt.artifacts.store import ArtifactError
from graphrt.compiler.aoti import constant_name
from graphrt.runner.graph_cache import CaptureSizes
from tests.helpers import make_llm
from tests.oracle import random_prompts

OPTS = dict(
    max_num_seqs=2,
    max_num_batched_tokens=16,
    kv_cache_memory=2_000_000,
    progress=False,
    capture_sizes=CaptureSizes(decode=(2,), mixed=()),
)  # one graph; prefills run eager
PROMPTS = random_prompts([4, 7], seed=50)
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

RUN = textwrap.dedent("""
    import json, sys, torch
    import graphrt
    from graphrt.runner.graph_cache import CaptureSizes
    from torch._dynamo.utils import counters
    llm = graphrt.LLM(sys.argv[1], graph_cache=sys.argv[2], max_num_seqs=2, max_num_batched_tokens=16,
                      kv_cache_memory=2_000_000, progress=False, capture_sizes=CaptureSizes(decode=(2,), mixed=()))
    outs = llm.generate(json.loads(sys.argv[3]), graphrt.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    print(json.dumps({"tokens": [o.token_ids for o in outs], "stats": llm.stats(),
                      "how": [r.how for r in llm.capture_report()],
                      "dynamo_graphs": counters["stats"]["unique_graphs"]}))
""")


def run_fresh(model, cache):
    out = subprocess.run(
        [sys.executable, "-c", RUN, model, cache, json.dumps(PROMPTS)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def shipped(tiny_model, tmp_path_factory):
    """A graph cache precompiled by `graphrt precompile` in its own process."""
    path = tiny_model("llama_gqa")
    out = str(tmp_path_factory.mktemp("shipped") / "graphs")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "graphrt.cli",
            "precompile",
            "--model",
            path,
            "--out",
            out,
            "--max-num-seqs",
            "2",
            "--max-num-batched-tokens",
            "16",
            "--kv-cache-memory",
            "2000000",
            "--capture-sizes",
            "2",
            "--mixed-sizes",
            "",
        ],
        check=True,
        capture_output=True,
    )
    return path, out


def test_warm_start_from_a_copy_compiles_nothing_and_matches_cold(shipped, tmp_path):
    """(That these counters count a cold start's compile is checked by tests/graph_cache/
    test_user_cache.py on the same script's counters.)"""
    path, out = shipped
    copy = str(tmp_path / "elsewhere")
    shutil.copytree(out, copy)
    warm = run_fresh(path, copy)
    assert warm["how"] == ["loaded"]
    assert warm["stats"]["compiles"] == 0 and warm["dynamo_graphs"] == 0
    cold = make_llm(path, **{k: v for k, v in OPTS.items() if k != "capture_sizes"})
    assert warm["tokens"] == [o.token_ids for o in cold.generate(PROMPTS, GREEDY)]
    assert warm["stats"]["graph_hits"] > 0


def test_packages_call_the_native_ops_through_their_c_entry_points(shipped):
    """A package calls graphrt's native ops directly (kernels/native/c_shims.cpp), not through the
    proxy executor, which serves only the ops without native code. The warm start above checks
    that such a package, loaded in a fresh process, gives the dispatched graph's tokens."""
    from graphrt.kernels.native_library import AOTI_C_SHIMS

    _, out = shipped
    (entry,) = json.load(open(os.path.join(out, "manifest.json")))["entries"].values()
    assert entry["key"]["op_calls"] == "c-shim"
    with zipfile.ZipFile(os.path.join(out, entry["file"])) as z:
        names = z.namelist()
        wrapper = z.read(next(n for n in names if n.endswith(".wrapper.cpp"))).decode()
        # the proxy executor's calls are listed in a .wrapper.json, written only when there are any
        listed = [json.loads(z.read(n))["nodes"] for n in names if n.endswith(".wrapper.json")]
    proxied = {node["node"]["target"] for nodes in listed for node in nodes}
    for op in ("linear", "paged_attention", "slot_mapping", "sample"):
        assert f"aoti_torch_cpu_{op}(" in wrapper
    assert not proxied & {f"graphrt::{op}" for op in AOTI_C_SHIMS}


def test_a_package_reads_the_engines_weights_in_place(shipped, tmp_path):
    """A package keeps no weights: the engine's own tensors are its constants, read where they are
    (one copy serves every graph), and its inputs are only the key's buffers and the KV caches.
    Negating the final norm's weight in place changes the loaded graph's tokens exactly as it
    changes the eager engine's."""
    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    loaded = graphrt.LLM(path, graph_cache=cache, **OPTS)
    assert [r.how for r in loaded.capture_report()] == ["loaded"]
    (graph,) = loaded.engine.runner.graphs.graphs.values()
    params = dict(loaded.engine.step_module.named_parameters())
    assert {constant_name(("param", n)) for n in params} <= set(graph.fn.loader.get_constant_fqns())
    assert not {t.data_ptr() for t in params.values()} & {t.data_ptr() for t in graph.inputs}
    eager = make_llm(path, **OPTS)
    before = [o.token_ids for o in loaded.generate(PROMPTS, GREEDY)]
    for llm in (loaded, eager):
        with torch.no_grad():
            dict(llm.engine.step_module.named_parameters())["model.norm.weight"].neg_()
    after = [o.token_ids for o in loaded.generate(PROMPTS, GREEDY)]
    assert after != before
    assert after == [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]


def test_a_package_samples_random_rows_as_the_dispatched_graph_and_profiles_its_ops(shipped, tmp_path):
    """graphrt::sample's entry point samples an all-greedy step itself and hands any other (a
    random row, or a grammar's cleared bit) to the op's torch body: seeded random rows, alone and
    beside a greedy one, give the dispatched graph's tokens. The profiler sees the directly called
    ops under their names, as it sees dispatched ones (`graphrt bench decode --profile`)."""
    from torch.profiler import profile

    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    loaded = graphrt.LLM(path, graph_cache=cache, **OPTS)
    assert [r.how for r in loaded.capture_report()] == ["loaded"]
    dispatched = make_llm(path, **OPTS)
    random_row = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    for params in ([random_row, random_row], [random_row, GREEDY]):
        want = [o.token_ids for o in dispatched.generate(PROMPTS, params)]
        assert [o.token_ids for o in loaded.generate(PROMPTS, params)] == want
    with profile() as prof:
        loaded.generate(PROMPTS, GREEDY)
    names = {e.key for e in prof.key_averages()}
    assert {"graphrt::linear", "graphrt::paged_attention", "graphrt::sample"} <= names


def test_without_the_native_library_a_shipped_cache_is_not_loaded(shipped):
    """Its packages need the library's C entry points: a process running the torch bodies
    (GRAPHRT_NATIVE=0) has another key and finds nothing to load."""
    path, out = shipped
    script = textwrap.dedent("""
        import sys, graphrt
        from graphrt.runner.graph_cache import CaptureSizes
        from graphrt.serving_settings import GraphCacheMismatchError
        try:
            graphrt.LLM(sys.argv[1], graph_cache=sys.argv[2], strict_graph_cache=True, max_num_seqs=2,
                        max_num_batched_tokens=16, kv_cache_memory=2_000_000, progress=False,
                        capture_sizes=CaptureSizes(decode=(2,), mixed=()))
        except Exception as e:
            print(type(e).__name__, e)
    """)
    env = {**os.environ, "GRAPHRT_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", script, path, out], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "strict" in done.stdout and "main-t2-r2" in done.stdout


def tamper(cache, how):
    manifest_path = os.path.join(cache, "manifest.json")
    manifest = json.load(open(manifest_path))
    ((eid, entry),) = manifest["entries"].items()
    artifact = os.path.join(cache, entry["file"])
    if how == "flip":
        data = bytearray(open(artifact, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(artifact, "wb").write(bytes(data))
    elif how == "truncate":
        os.truncate(artifact, os.path.getsize(artifact) // 3)
    elif how == "manifest":
        entry["key"]["graph"] = "main-t999-r2"
        json.dump(manifest, open(manifest_path, "w"))
    elif how == "torch_version":
        entry["key"]["torch"] = "0.0.0-other"  # a cache built by another torch
        manifest["entries"] = {eid: entry}
        json.dump(manifest, open(manifest_path, "w"))


@pytest.mark.parametrize("how", ["flip", "truncate", "manifest", "torch_version"])
def test_tampered_entries_are_refused_in_strict_mode(shipped, tmp_path, how):
    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    tamper(cache, how)
    with pytest.raises(ArtifactError, match="strict"):
        graphrt.LLM(path, graph_cache=cache, strict_graph_cache=True, **OPTS)


def test_a_tampered_entry_is_rebuilt_and_outputs_stay_correct(shipped, tmp_path):
    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    tamper(cache, "flip")
    llm = graphrt.LLM(path, graph_cache=cache, **OPTS)
    assert [r.how for r in llm.capture_report()] == ["compiled"]
    assert any("SHA-256" in r for r in llm.engine.store.rejected)
    eager = make_llm(path, **{k: v for k, v in OPTS.items() if k != "capture_sizes"})
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]
    again = graphrt.LLM(path, graph_cache=cache, **OPTS)  # the rebuilt entry now loads
    assert [r.how for r in again.capture_report()] == ["loaded"]


def test_no_compile_or_trace_during_generate(tiny_model):
    from torch._dynamo.utils import counters

    start = counters["stats"]["unique_graphs"]
    llm = graphrt.LLM(
        tiny_model("llama_gqa"), backend="eager", **{**OPTS, "capture_sizes": CaptureSizes((1, 2), (16,))}
    )
    before = (counters["stats"]["unique_graphs"], llm.stats()["compiles"])
    assert before == (start + 3, 3)  # the counter sees captures: its silence below means something
    llm.generate(random_prompts([3, 12, 5], seed=51), GREEDY)
    assert (counters["stats"]["unique_graphs"], llm.stats()["compiles"]) == before


def test_another_source_hash_misses_and_the_same_loads(shipped, tmp_path, monkeypatch):
    """The entry key carries the source hash over graphrt/, kernels/ and passes/ (an edited pass
    changes it: tests/test_packaging.py); a package built from other source is not found (and so
    is rebuilt, as a tampered entry is below)."""
    from graphrt.artifacts import cache_key
    from graphrt.compiler.graph_builder import GraphBuilder

    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    same = graphrt.LLM(path, graph_cache=cache, **OPTS)
    assert [r.how for r in same.capture_report()] == ["loaded"]
    e = same.engine
    builder = GraphBuilder(e.step_module, e.kv_caches, e.passes, "inductor", e.store, e.model_key)
    key = next(iter(e.graphs.graphs))
    assert builder.cached(key, e.graphs.buffers(key)) is not None
    monkeypatch.setattr(cache_key, "source_hash", lambda: "0" * 64)
    assert builder.cached(key, e.graphs.buffers(key)) is None


# --- the settings a shipped cache carries ---------------------------------------------------------


def entry_files(cache):
    return sorted(os.listdir(os.path.join(cache, "graphs")))


def test_a_shipped_cache_records_its_settings_and_an_engine_adopts_them(shipped, tmp_path):
    path, out = shipped
    recorded = json.load(open(os.path.join(out, "manifest.json")))["settings"]
    assert recorded["max_num_seqs"] == 2 and recorded["max_num_batched_tokens"] == 16
    assert recorded["capture_sizes"] == {"decode": [2], "mixed": []} and recorded["dtype"] == "float32"
    assert recorded["block_size"] == 16 and recorded["kv_num_blocks"] > 0 and recorded["kv_cache_dtype"] == "auto"
    llm = graphrt.LLM(path, graph_cache=out, progress=False)  # no settings: the cache's
    s = llm.engine.settings
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.capture_sizes) == (2, 16, CaptureSizes((2,), ()))
    assert llm.engine.kv_plan.num_blocks == recorded["kv_num_blocks"]
    assert [r.how for r in llm.capture_report()] == ["loaded"] and llm.stats()["compiles"] == 0
    eager = make_llm(path, **{k: v for k, v in OPTS.items() if k != "capture_sizes"})
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in eager.generate(PROMPTS, GREEDY)
    ]


@pytest.mark.parametrize(
    "asked, names",
    [
        (dict(max_num_seqs=4), ["max_num_seqs: asked 4, the graph cache was built with 2", "capture_sizes"]),
        (dict(dtype="bfloat16"), ["dtype: asked 'bfloat16', the graph cache was built with 'float32'"]),
        (dict(block_size=8), ["block_size: asked 8, the graph cache was built with 16"]),
        (dict(kv_cache_dtype="bfloat16"), ["kv_cache_dtype: asked 'bfloat16', the graph cache was built with 'auto'"]),
    ],
)
def test_settings_that_change_graphs_are_refused_by_name_and_nothing_compiles(shipped, asked, names):
    from torch._dynamo.utils import counters

    from graphrt.serving_settings import GraphCacheMismatchError

    path, out = shipped
    files, graphs_before = entry_files(out), counters["stats"]["unique_graphs"]
    with pytest.raises(GraphCacheMismatchError) as e:
        graphrt.LLM(path, graph_cache=out, progress=False, **asked)
    for name in names:
        assert name in str(e.value)
    assert "would have to be built" in str(e.value) and "rebuild_graph_cache=True" in str(e.value)
    assert entry_files(out) == files and counters["stats"]["unique_graphs"] == graphs_before


def test_a_mismatch_says_how_many_graphs_it_would_build(shipped):
    from graphrt.serving_settings import GraphCacheMismatchError

    path, out = shipped
    with pytest.raises(GraphCacheMismatchError, match=r"\n3 graph\(s\) would have to be built"):
        # decode sizes 1, 2, 4 and mixed 16 for max_num_seqs=4: main-t2-r2 is shipped, three are not
        graphrt.LLM(path, graph_cache=out, progress=False, max_num_seqs=4, capture_sizes=CaptureSizes((1, 2, 4), (16,)))
    # a subset of the shipped graphs needs nothing built: it just works
    llm = graphrt.LLM(path, graph_cache=out, progress=False, capture_sizes=CaptureSizes((2,), ()))
    assert llm.stats()["compiles"] == 0


def test_rebuild_builds_knowingly_and_the_next_engine_adopts_the_new_settings(shipped, tmp_path):
    path, out = shipped
    cache = str(tmp_path / "cache")
    shutil.copytree(out, cache)
    opts = dict(max_num_seqs=3, capture_sizes=CaptureSizes((3,), ()), progress=False)
    built = graphrt.LLM(path, graph_cache=cache, rebuild_graph_cache=True, **opts)
    assert [r.how for r in built.capture_report()] == ["compiled"]
    again = graphrt.LLM(path, graph_cache=cache, progress=False)
    assert again.engine.settings.max_num_seqs == 3 and [r.how for r in again.capture_report()] == ["loaded"]
    assert again.stats()["compiles"] == 0


@pytest.mark.parametrize(
    "asked",
    [dict(max_model_len=64), dict(max_model_len=512), dict(kv_cache_memory=6_000_000), dict(kv_cache_dtype="float32")],
)
def test_context_length_and_kv_size_are_free_in_shipped_graphs(shipped, asked):
    """Packages leave the KV block count and the block-table width free: another max_model_len or
    KV budget loads the same graphs, and the tokens stay exact (so does a KV dtype named as the
    model's own, which is "auto")."""
    path, out = shipped
    llm = graphrt.LLM(path, graph_cache=out, progress=False, **asked)
    assert [r.how for r in llm.capture_report()] == ["loaded"] and llm.stats()["compiles"] == 0
    opts = {**{k: v for k, v in OPTS.items() if k != "capture_sizes"}, **asked}
    prompts = random_prompts([4, 7, 30], seed=52)  # 30 + 8 tokens: three blocks of the table
    eager = make_llm(path, **opts)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert llm.stats()["graph_hits"] > 0


def test_the_cli_names_the_mismatch_and_precompile_records_settings(shipped, capsys):
    from graphrt.cli import main

    path, out = shipped
    rc = main(["generate", "--model", path, "--graph-cache", out, "--max-num-seqs", "4", "--prompt", "x"])
    assert rc == 2
    assert "max_num_seqs: asked 4, the graph cache was built with 2" in capsys.readouterr().err
