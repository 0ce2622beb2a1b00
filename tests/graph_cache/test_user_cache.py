"""The per-user cache: graphs compiled once and loaded by every later process, safely shared by
processes that race on it; `graphrt cache ls / clear`."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from graphrt.artifacts.store import ArtifactStore, sha256_file
from tests.helpers import make_llm
from tests.oracle import random_prompts

PROMPTS = random_prompts([5, 9], seed=60)
CHILD = textwrap.dedent("""
    import json, sys
    import graphrt
    from graphrt.runner.graph_cache import CaptureSizes
    model, prompts, extra = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    llm = graphrt.LLM(model, max_num_seqs=2, max_num_batched_tokens=16, progress=False,
                      capture_sizes=CaptureSizes(decode=(2,), mixed=()), **extra)
    outs = llm.generate(prompts, graphrt.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    dynamo_imported = "torch._dynamo" in sys.modules  # before reading its counters imports it
    from torch._dynamo.utils import counters
    from graphrt.compiler.aoti import PackageBuild
    print(json.dumps({"tokens": [o.token_ids for o in outs], "how": [r.how for r in llm.capture_report()],
                      "compiles": llm.stats()["compiles"], "dynamo_imported": dynamo_imported,
                      "dynamo_graphs": counters["stats"]["unique_graphs"],
                      "inductor": sum(counters["inductor"].values()), "builds": PackageBuild.started}))
""")
GREEDY = dict(max_tokens=8, temperature=0, ignore_eos=True)


def start(model, cache_dir, **extra):
    seed_native(cache_dir)
    env = {**os.environ, "GRAPHRT_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, "-c", CHILD, model, json.dumps(PROMPTS), json.dumps(extra)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def seed_native(cache_dir):
    """Share the suite's native kernel build with a fresh cache directory (a build costs seconds)."""
    from graphrt.user_cache import cache_root

    src, dst = cache_root() / "native", os.path.join(cache_dir, "native")
    if src.is_dir() and not os.path.exists(dst):
        shutil.copytree(src, dst)


def finish(proc):
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def eager_tokens(model):
    from graphrt import SamplingParams

    llm = make_llm(model, max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory=4_000_000)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(**GREEDY))]


def check_consistent(root):
    """Every manifest entry names a present file of its size and SHA-256; no temporary is left."""
    store = ArtifactStore(root, strict=True)
    entries = store.entries()
    for e in entries:
        path = os.path.join(root, e["file"])
        assert os.path.getsize(path) == e["size"] and sha256_file(path) == e["sha256"]
    left = [n for n in os.listdir(os.path.join(root, "graphs")) if n.startswith(".")]
    assert not left, left
    return entries


@pytest.fixture(scope="module")
def cold_cache(tiny_model, tmp_path_factory):
    """A per-user cache filled by one cold process over the tiny Llama, and what it printed
    (copied by the tests that need a filled cache: a cold build costs tens of seconds)."""
    root = tmp_path_factory.mktemp("cold-cache")
    return root, finish(start(tiny_model("llama_gqa"), root))


def test_the_second_process_loads_every_graph_from_the_default_cache(tiny_model, cold_cache, tmp_path):
    model = tiny_model("llama_gqa")
    shutil.copytree(cold_cache[0], tmp_path, dirs_exist_ok=True)
    cold = cold_cache[1]
    assert cold["how"] == ["compiled"] and cold["compiles"] == 1 and cold["dynamo_graphs"] == 1
    assert cold["builds"] == 1  # the counters count: their zeros below mean something
    assert os.path.isdir(tmp_path / "graphs") and len(check_consistent(str(tmp_path / "graphs"))) == 1
    # another KV budget and context length: the same packages (those sizes are free in them)
    warm = finish(start(model, tmp_path, kv_cache_memory=3_000_000, max_model_len=128))
    assert warm["how"] == ["loaded"] and warm["compiles"] == 0
    assert warm["dynamo_graphs"] == 0 and warm["inductor"] == 0 and warm["builds"] == 0
    assert not warm["dynamo_imported"]  # no trace, no compiler: only the packages' loader
    assert warm["tokens"] == cold["tokens"] == eager_tokens(model)
    off = finish(start(model, tmp_path, graph_cache=False))  # opting out compiles in memory
    assert off["how"] == ["compiled"] and off["tokens"] == cold["tokens"]


def test_a_quantized_models_package_loads_in_a_fresh_process_with_no_compile(tiny_model, tmp_path):
    """The package calls graphrt::linear_quantized (the native op, through the dispatcher): a
    fresh process loads it with no trace and no compile, and decodes what the first one did."""
    from graphrt import SamplingParams

    model = tiny_model("llama_gqa")
    cold = finish(start(model, tmp_path, quantization="int4"))
    warm = finish(start(model, tmp_path, quantization="int4"))
    assert cold["how"] == ["compiled"] and warm["how"] == ["loaded"]
    assert warm["compiles"] == 0 and warm["inductor"] == 0 and not warm["dynamo_imported"]
    eager = make_llm(model, quantization="int4", max_num_seqs=2, max_num_batched_tokens=16, kv_cache_memory=4_000_000)
    assert warm["tokens"] == cold["tokens"] == [o.token_ids for o in eager.generate(PROMPTS, SamplingParams(**GREEDY))]


def test_two_processes_racing_on_an_empty_cache_both_succeed(tiny_model, tmp_path):
    model = tiny_model("llama_gqa")  # the Inductor cache already holds its kernels: the race is what is tested
    a, b = start(model, tmp_path), start(model, tmp_path)
    first, second = finish(a), finish(b)
    assert first["tokens"] == second["tokens"] == eager_tokens(model)
    entries = check_consistent(str(tmp_path / "graphs"))
    assert len(entries) == 1  # both built the same key; one entry stands
    third = finish(start(model, tmp_path))
    assert third["how"] == ["loaded"] and third["tokens"] == first["tokens"]


def test_a_second_publish_of_a_key_keeps_the_file_that_stands(tmp_path):
    """Two processes that built the same key: the second's publish keeps the first's file (the
    first may be loading it: replaced under its loader, a package read as an empty file) and
    drops its own; a damaged standing file is replaced."""
    store = ArtifactStore(str(tmp_path))
    key = {"graph": "main-t2-r2", "model": "m"}

    def built(data: bytes) -> str:
        tmp = store.reserve(key)
        with open(tmp, "wb") as f:
            f.write(data)
        return tmp

    path, first = store.publish(key, built(b"first build"), {})
    inode = os.stat(path).st_ino
    second_tmp = built(b"second build, other bytes")
    again, entry = store.publish(key, second_tmp, {})
    assert again == path and entry == first and os.stat(path).st_ino == inode
    assert open(path, "rb").read() == b"first build" and not os.path.exists(second_tmp)
    assert store.lookup(key) == (path, first)
    with open(path, "wb") as f:  # damaged: the next publish replaces it
        f.write(b"trunc")
    path, third = store.publish(key, built(b"third build"), {})
    assert open(path, "rb").read() == b"third build" and third["sha256"] == sha256_file(path)
    assert store.lookup(key) == (path, third)
    assert [n for n in os.listdir(tmp_path / "graphs") if n.startswith(".")] == []


def test_cache_ls_and_clear(tiny_model, cold_cache, tmp_path, monkeypatch, capsys):
    from graphrt.cli import main

    shutil.copytree(cold_cache[0], tmp_path, dirs_exist_ok=True)
    monkeypatch.setenv("GRAPHRT_CACHE_DIR", str(tmp_path))
    assert main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "main-t2-r2" in out and "current" in out
    assert "graphs" in out and "MiB" in out
    assert main(["cache", "clear", "graphs"]) == 0
    assert "freed" in capsys.readouterr().err
    assert ArtifactStore(str(tmp_path / "graphs")).entries() == []
    assert [n for n in os.listdir(tmp_path / "graphs") if n.endswith(".pt2")] == []
    assert main(["cache", "clear", "bogus"]) == 2
    assert "unknown cache section(s) ['bogus']" in capsys.readouterr().err


def test_the_cache_root_rule_is_the_same_for_kernels_and_the_runtime(monkeypatch, tmp_path):
    from graphrt.kernels import native_library
    from graphrt.user_cache import cache_root

    for env in ({"GRAPHRT_CACHE_DIR": str(tmp_path / "a")}, {"XDG_CACHE_HOME": str(tmp_path / "x")}, {}):
        monkeypatch.delenv("GRAPHRT_CACHE_DIR", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert cache_root() == native_library.cache_root()
