"""The TorchAir backend without an NPU: every graph key of the tiny Llama, Qwen3 and DeepSeek-V3
(with their verify and MTP graphs) converts to Ascend IR through TorchAir's own converters, the
attention and its cache write are single Ascend operators, and the converted graphs (GE mode)
and the ACL-mode graphs replay to the tokens of graphrt's eager backend.

TorchAir runs in one separate process (tests/npu/torchair_run.py): its import sets process-wide
state that no other test should share. Compiling or running the Ascend graphs needs an NPU and
is not tested here.
"""

import json
import os
import subprocess
import sys

import pytest

import graphrt
from graphrt.npu import standins, torchair_package
from tests.conftest import ROOT

MODELS = {"llama_gqa": "llama_gqa", "qwen3": "qwen3", "deepseek_v3": "deepseek_v3-mtp"}  # name → folder


def torchair_reason() -> str | None:
    if torchair_package.has_torch_npu():
        return None
    if not (torchair_package.package_root() / "torchair" / "__init__.py").exists():
        return (
            f"TorchAir's package is not in {torchair_package.package_root()}: `make setup-test` takes it "
            "from the torch-npu wheel, which could not be downloaded on this machine"
        )
    return None


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    reason = torchair_reason()
    if reason:
        pytest.skip(reason)
    root = str(tmp_path_factory.mktemp("torchair-models"))
    cmd = [sys.executable, "-m", "tests.npu.torchair_run", root, "+llama_gqa", "qwen3", "deepseek_v3"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    return root, result


def num_layers(root: str, name: str) -> int:
    with open(os.path.join(root, MODELS[name], "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_graph_key_converts_to_ascend_operators(converted, name):
    root, result = converted
    graphs = result[name]["ops"]
    assert len(graphs) == result[name]["stats"]["compiles"]  # every key the engine built was converted
    kinds = {key.split("-")[0] for key in graphs}
    assert kinds == {"llama_gqa": {"main", "verify"}, "qwen3": {"main"}, "deepseek_v3": {"main", "verify", "mtp"}}[name]
    layers = num_layers(root, name)
    for key, ops in graphs.items():
        attention_layers = 1 if key.startswith("mtp") else layers  # an MTP graph runs the MTP layer
        # attention with its cache write: one FusedInferAttentionScore and one ScatterPaKvCache per layer
        assert ops["FusedInferAttentionScore"] == attention_layers, key
        assert ops["ScatterPaKvCache"] == attention_layers, key
        # no attention left in pieces: the one softmax is the sampler's
        assert ops.get("SoftmaxV2", 0) == 1, key
        assert ops["AddRmsNorm"] >= attention_layers, key
        if name != "deepseek_v3":  # (its MoE experts are batched matmuls)
            assert "BatchMatMul" not in ops, key
        assert not any(op.startswith("graphrt") or "." in op for op in ops), key  # Ascend types only


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_torchair_graphs_replay_to_the_eager_backends_tokens(converted, mode):
    _, result = converted
    llama = result["llama_gqa"]
    assert llama[mode]["greedy"] == llama["eager"]["greedy"]
    # equal to float32 rounding: the eager CPU backend's greedy log-probabilities come from the
    # native one-pass kernel, the graph's from the sampler's aten body (log_softmax)
    flat = [[x for row in llama[run]["logprobs"] for x in row] for run in (mode, "eager")]
    assert flat[0] == pytest.approx(flat[1], rel=1e-6, abs=1e-6)
    assert llama[mode]["seeded"] == llama["eager"]["seeded"]
    assert len(llama["eager"]["greedy"][0]) == 6


def test_an_op_without_an_ascend_lowering_is_named(converted):
    _, result = converted
    error = result["unconvertible"]
    assert error.startswith("TorchAirConversionError: op torch.ops.aten.logcumsumexp.default could not be lowered")
    assert "is not implemented" in error  # TorchAir's own words follow


def test_torchair_without_its_package_names_the_fix(tiny_model, tmp_path, monkeypatch):
    if torchair_package.has_torch_npu():
        pytest.skip("torch_npu is installed: TorchAir comes from it")
    monkeypatch.setenv("GRAPHRT_TORCHAIR_DIR", str(tmp_path / "none"))
    monkeypatch.setattr(torchair_package, "_loaded", None)
    with pytest.raises(torchair_package.TorchAirUnavailable, match="python -m graphrt.npu.torchair_package"):
        graphrt.LLM(tiny_model("llama_gqa"), backend="torchair", graph_cache=False, progress=False)


def test_unknown_torchair_mode_is_refused(tiny_model):
    with pytest.raises(ValueError, match="torchair_mode 'fast' is not known; modes: \\['max-autotune'"):
        graphrt.LLM(tiny_model("llama_gqa"), backend="torchair", torchair_mode="fast", progress=False)


def test_stand_ins_refuse_what_needs_an_npu():
    module = standins._torchair_module()
    assert module.check_cann_compat("FusedInferAttentionScore", (), ()) == ""
    graph = module.TorchNpuGraphBase("g")
    with pytest.raises(standins.NoNPU, match="loading a GE graph needs an Ascend NPU"):
        graph.load(b"", {})
    with pytest.raises(standins.NoNPU, match="needs an Ascend NPU"):
        module.as_torch_tensors()


def test_torchair_builds_go_into_the_graph_cache(converted):
    """Off the NPU a graph cache of TorchAir builds is made (TorchAir's generated code with the GE
    graph, under graphrt's key, manifest and hashes), each entry loads and refuses to run without
    an NPU, and a second engine converts again (its graphs cannot run here) without touching them."""
    _, result = converted
    shipped = result["shipped"]
    assert shipped["entries"] == shipped["graphs"] and len(shipped["graphs"]) == 2
    assert shipped["inner"] == [{"torchair_mode": "max-autotune"}] * 2
    assert all("needs an Ascend NPU" in r for r in shipped["refused"])
    assert shipped["second"] == ["compiled", "compiled"] and shipped["entries_after"] == 2
    assert shipped["same_tokens"]
