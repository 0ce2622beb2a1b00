"""Bad requests get a clear error at submission; the engine keeps serving everyone else."""

import pytest

from graphrt import SamplingParams
from graphrt.engine import EngineStepError
from graphrt.runner.kv_cache import KVCacheTooSmallError
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm
from tests.oracle import hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model):
    return make_llm(tiny_model("llama_gqa"), max_model_len=64, kv_cache_memory=2_000_000)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_p=0.0), r"top_p=0.0 .*\(0, 1\]"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(min_p=2.0), "min_p=2.0"),
        (dict(top_k=-3), "top_k=-3"),
        (dict(regex="a+", choice=["x"]), "at most one"),
    ],
)
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_unknown_sampling_field_is_named():
    with pytest.raises(InvalidRequestError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([], "empty"),
        ([1, 2, 999], r"token 2 is 999.*\[0, 256\)"),
        ([1, -4], "token 1 is -4"),
        (list(range(3, 70)), "67 tokens; max_model_len=64"),
    ],
)
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt])
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_bad_request_while_others_run(llm, tiny_model):
    engine = llm.engine
    prompts = random_prompts([10, 20], seed=13)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2, 10_000], params)
    with pytest.raises(InvalidRequestError):
        engine.add_request([1, 2], {"temperature": -1.0})
    while engine.has_unfinished():
        engine.step()
    path = tiny_model("llama_gqa")
    for rid, p in zip(ids, prompts):
        assert engine.output(rid).token_ids == hf_greedy(path, p, 16)
        engine.release(rid)
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_a_failing_step_frees_its_blocks_and_the_engine_recovers(llm, monkeypatch):
    engine = llm.engine
    calls = {"n": 0}
    real = engine.runner.steps["main"].eager

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault")
        return real(*args)

    monkeypatch.setattr(engine.runner.steps["main"], "eager", flaky)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(EngineStepError, match="injected fault"):
        engine.step()
    assert engine.output(rid).finish_reason == "error"
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def test_abort_frees_blocks(llm):
    engine = llm.engine
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.abort(rid)
    assert engine.output(rid).finish_reason == "abort"
    assert not engine.has_unfinished()
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_kv_budget_too_small_for_one_sequence(tiny_model):
    with pytest.raises(KVCacheTooSmallError, match="max_model_len=256 needs 16"):
        make_llm(tiny_model("llama_gqa"), max_model_len=256, kv_cache_memory=10_000)


def test_max_model_len_beyond_the_model(tiny_model):
    with pytest.raises(ValueError, match=r"max_model_len=100000 must lie in \[2, 512\]"):
        make_llm(tiny_model("llama_gqa"), max_model_len=100_000)
