"""Structured output: the bitmask inside the step, the xgrammar CPU reference path, bad grammars."""

import json
import re

import jsonschema
import numpy as np
import pytest

import graphrt
from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}


@pytest.fixture(scope="module")
def smollm2():
    return make_llm(None, max_num_seqs=4, max_model_len=512, kv_cache_memory=64_000_000)


def test_smollm2_json_schema_regex_and_choice(smollm2):
    prompt = "Describe a person as JSON with a name, an age, a favourite color and tags."
    outs = smollm2.generate(
        [prompt, prompt, "Pick a color.", "Give me a date."],
        [
            SamplingParams(max_tokens=80, temperature=0, json_schema=PERSON),
            SamplingParams(max_tokens=80, temperature=0.8, seed=3, json_schema=PERSON),
            SamplingParams(max_tokens=10, temperature=0, choice=["red", "green", "blue"]),
            SamplingParams(max_tokens=20, temperature=0, regex=r"\d{4}-\d{2}-\d{2}"),
        ],
        chat=True,
    )
    for o in outs[:2]:
        assert o.finish_reason == "stop"
        value = json.loads(o.text)
        jsonschema.validate(value, PERSON)
        assert list(value) == ["name", "age", "color", "tags"]  # the schema's property order
    assert outs[2].text in ("red", "green", "blue") and outs[2].finish_reason == "stop"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[3].text)


def schemas(n):
    colors = ["red", "green", "blue", "cyan"]
    out = []
    for i in range(n):
        props = {
            f"f{i}": {"enum": colors[: 2 + i % 3]},
            "ok": {"type": "boolean"},
            "items": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 1 + i % 3},
        }
        out.append({"type": "object", "properties": props, "required": list(props), "additionalProperties": False})
    return out


def test_sixteen_constrained_requests_mixed_with_free_ones(tiny_tok_model):
    sizes = CaptureSizes(decode=(8,), mixed=(64,))
    opts = dict(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory=16_000_000, capture_sizes=sizes)
    llm = graphrt.LLM(tiny_tok_model, backend="eager", progress=False, **opts)
    prompts = [f"Request number {i}:" for i in range(24)]
    free = SamplingParams(max_tokens=12, temperature=0.7, seed=99, ignore_eos=True)
    constrained = [
        SamplingParams(max_tokens=60, temperature=0.9, seed=i, json_schema=s) for i, s in enumerate(schemas(16))
    ]
    params = []
    for i in range(24):  # every third request is free, the others constrained, all in the same batches
        params.append(free if i % 3 == 2 else constrained.pop())
    outs = llm.generate(prompts, params)
    for o, p in zip(outs, params):
        if p.json_schema is not None:
            assert o.finish_reason == "stop", o.text
            jsonschema.validate(json.loads(o.text), p.json_schema)
    baseline = llm.generate([p for i, p in enumerate(prompts) if i % 3 == 2], free)
    assert [o.token_ids for i, o in enumerate(outs) if i % 3 == 2] == [o.token_ids for o in baseline]
    assert llm.engine.grammar_compiler.compiles == 16
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_in_graph_path_equals_the_xgrammar_cpu_reference(tiny_tok_model):
    sizes = CaptureSizes(decode=(4,), mixed=(32,))
    opts = dict(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        kv_cache_memory=8_000_000,
        capture_sizes=sizes,
        backend="eager",
        progress=False,
    )
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=s, json_schema=sch)
        for (t, s), sch in zip([(0.0, 1), (0.8, 2), (1.2, 3), (0.5, 4)], schemas(4))
    ]
    prompts = ["a", "b", "c", "d"]
    in_graph = graphrt.LLM(tiny_tok_model, **opts)
    reference = graphrt.LLM(tiny_tok_model, grammar_backend="xgrammar-cpu", **opts)
    got = [o.token_ids for o in in_graph.generate(prompts, params)]
    assert got == [o.token_ids for o in reference.generate(prompts, params)]
    counts = [c for g in reference.engine.graphs.graphs.values() for c in [str(n.target) for n in g.gm.graph.nodes]]
    assert any("xgrammar_bitmask_cpu" in c for c in counts)  # the reference really takes the round trip


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(json_schema='{"type": "object", "properties": 5}'), "invalid json_schema"),
        (dict(regex="([a-z"), "invalid regex"),
        (dict(grammar="root ::= undefined_rule"), "invalid grammar"),
    ],
)
def test_invalid_grammars_are_rejected_and_the_engine_keeps_serving(tiny_tok_model, kwargs, match):
    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    engine = llm.engine
    rid = engine.add_request("Hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request("Hi", SamplingParams(max_tokens=6, **kwargs))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.output(rid).token_ids) == 6
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_a_grammar_that_allows_no_token_ends_the_request_cleanly(tiny_tok_model, monkeypatch):
    from graphrt.grammar.matcher import RequestGrammar

    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    real_fill = RequestGrammar.fill
    calls = {"n": 0}

    def fill(self, out):
        calls["n"] += 1
        if calls["n"] >= 3:  # from the third step on, nothing is allowed
            out[:] = 0
            return False
        return real_fill(self, out)

    monkeypatch.setattr(RequestGrammar, "fill", fill)
    out = llm.generate(["x"], SamplingParams(max_tokens=20, temperature=0, json_object=True))[0]
    assert out.finish_reason == "grammar" and len(out.token_ids) == 2
    assert llm.stats()["free_blocks"] == llm.stats()["total_blocks"]


def test_rollback_and_draft_masks(tiny_tok_model):
    from graphrt.grammar import GrammarCompiler, RequestGrammar

    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    tok = llm.tokenizer.hf
    compiler = GrammarCompiler(tok, 49152)
    g = RequestGrammar(compiler.compile(SamplingParams(choice=["yes", "no"])), 49152)
    first = np.zeros(compiler.vocab_size // 32, dtype=np.int32)
    g.fill(first)
    draft = tok.encode("yes") + tok.encode("no")  # "yes" is legal, "no" after it is not
    rows = np.zeros((len(draft) + 1, first.shape[0]), dtype=np.int32)
    accepted = g.fill_for_draft(draft, rows)
    assert accepted == len(tok.encode("yes"))
    assert np.array_equal(rows[0], first)  # row 0 is the mask before any draft token
    again = np.zeros_like(first)
    g.fill(again)
    assert np.array_equal(again, first)  # the matcher ended where it started
    for t in tok.encode("yes"):
        assert g.accept(t)
    g.rollback(len(tok.encode("yes")))
    g.fill(again)
    assert np.array_equal(again, first)


def test_a_bad_grammar_in_a_batch_call_queues_nothing(tiny_tok_model):
    llm = make_llm(tiny_tok_model, kv_cache_memory=8_000_000)
    with pytest.raises(InvalidRequestError, match="prompt 1: invalid regex"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, regex="([a-z")])
    assert not llm.engine.has_unfinished()
