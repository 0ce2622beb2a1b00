"""The official openai client against a live ``graphrt serve``: what comes back is what
graphrt.LLM generates for the same prompt and parameters."""

import json

import httpx
import jsonschema
import pytest

from graphrt import SamplingParams
from tests.server.conftest import auth

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["color", "ok", "tags"],
    "additionalProperties": False,
}


def test_completion_equals_llm_generate(client, reference):
    got = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0)
    want = reference.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0))[0]
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids) == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    assert got.model == "tiny" and got.object == "text_completion"


def test_chat_streaming_and_not_equal_llm_generate(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    ids = reference.tokenizer.apply_chat_template(messages)
    want = reference.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]

    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == want.text
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want.token_ids)

    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_completion_and_done_marker(server, reference):
    body = {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0, "stream": True, "model": "tiny"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth()) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    want = reference.generate(["Once upon a time"], SamplingParams(max_tokens=9, temperature=0))[0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)


def test_n_choices_with_a_seed_are_the_seeded_requests(client, reference):
    got = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0.9, seed=11, n=2, extra_body={"top_k": 50}
    )
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=s) for s in (11, 12)]
    want = reference.generate(["Hello", "Hello"], params)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert want[0].token_ids != want[1].token_ids  # two different samples
    assert got.usage.prompt_tokens == len(want[0].prompt_token_ids)  # counted once
    assert got.usage.completion_tokens == 16
    again = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0.9, seed=11, n=2, extra_body={"top_k": 50}
    )
    assert [c.text for c in again.choices] == [c.text for c in got.choices]


def test_json_schema_response_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
    for seed in (1, 2):
        got = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Pick a color."}],
            max_tokens=60,
            temperature=0.8,
            seed=seed,
            response_format=fmt,
        )
        value = json.loads(got.choices[0].message.content)
        jsonschema.validate(value, SCHEMA)
        assert got.choices[0].finish_reason == "stop"


def test_extra_fields_choice_and_regex(client):
    got = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=10, temperature=0, extra_body={"choice": ["yes", "no"]}
    )
    assert got.choices[0].text in ("yes", "no")
    got = client.completions.create(
        model="tiny", prompt="Year:", max_tokens=10, temperature=0, extra_body={"regex": r"[0-9]{4}"}
    )
    assert len(got.choices[0].text) == 4 and got.choices[0].text.isdigit()


def test_logprobs_and_top_logprobs_are_the_engines(client, reference):
    want = reference.generate(["Tell me"], SamplingParams(max_tokens=6, temperature=0, logprobs=2))[0]
    got = client.completions.create(model="tiny", prompt="Tell me", max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert "".join(lp.tokens) == want.text and lp.text_offset[0] == 0
    decode = reference.tokenizer.decode
    for alternatives, entry in zip(lp.top_logprobs, want.top_logprobs):
        best = sorted(entry.items(), key=lambda item: -item[1])[:2]
        assert alternatives == pytest.approx({decode([t]): v for t, v in best}, abs=1e-5)

    ids = reference.tokenizer.apply_chat_template("Tell me")
    want = reference.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Tell me"}], max_tokens=6, temperature=0)
        reply = client.chat.completions.create(logprobs=True, top_logprobs=3, stream=stream, **kwargs)
        chunks = list(reply) if stream else [reply]
        content = [
            c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
        ]
        assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=1e-5)
        for c, entry in zip(content, want.top_logprobs):
            best = sorted(entry.items(), key=lambda item: -item[1])[:3]
            assert [a.logprob for a in c.top_logprobs] == pytest.approx([v for _, v in best], abs=1e-5)
            assert [a.token for a in c.top_logprobs] == [decode([t]) for t, _ in best]
            assert bytes(c.bytes).decode() == c.token
    plain = client.chat.completions.create(logprobs=True, **kwargs)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_echo_with_logprobs_returns_the_prompts_log_probabilities(client, reference):
    ids = reference.tokenizer.encode("The capital of France")
    want = reference.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprobs=True, prompt_logprobs=0))[0]
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=0)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    prompt_want = [e[t] for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(prompt_want, abs=1e-5)
    assert lp.token_logprobs[len(ids) :] == pytest.approx(want.logprobs, abs=1e-5)


def test_echo_stop_and_models(client, reference):
    got = client.completions.create(model="tiny", prompt="Echo this", max_tokens=5, temperature=0, echo=True)
    want = reference.generate(["Echo this"], SamplingParams(max_tokens=5, temperature=0))[0]
    assert got.choices[0].text == "Echo this" + want.text
    stop = want.text[3:6]
    cut = client.completions.create(model="tiny", prompt="Echo this", max_tokens=5, temperature=0, stop=[stop])
    assert cut.choices[0].text == want.text[: want.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_health_and_metrics_need_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = server.metrics()
    for name in (
        "graphrt_requests_running",
        "graphrt_requests_waiting",
        "graphrt_prompt_tokens_total",
        "graphrt_generation_tokens_total",
        "graphrt_time_to_first_token_seconds_count",
        "graphrt_inter_token_latency_seconds_count",
        "graphrt_kv_blocks_used",
        "graphrt_kv_blocks_free",
        "graphrt_prefix_cache_hit_blocks_total",
        "graphrt_spec_acceptance_rate",
        "graphrt_graph_misses_total",
    ):
        assert name in m, name
