"""Every client mistake gets its 4xx and OpenAI's error body naming the field, while a good
request running beside it is unaffected; the key and the body-size limit guard the API."""

import json
import threading

import httpx
import pytest

from graphrt import SamplingParams
from tests.server.conftest import API_KEY, auth

GOOD = {"prompt": [20, 21, 22, 23], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "model": "tiny"}
LONG_PROMPT = "hello " * 600  # beyond max_model_len=512

BAD = [
    # (path, raw body or json, status, param, words in the message)
    ("completions", b'{"prompt": "Hi", ', 400, None, "not valid JSON"),
    ("completions", {"prompt": "Hi", "max_tokens": -3}, 400, "max_tokens", "greater than or equal to 1"),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {"prompt": "Hi", "n": "two"}, 400, "n", "valid integer"),
    ("completions", {"prompt": "Hi", "tempreature": 0.5}, 400, "tempreature", "unknown field"),
    ("completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("completions", {"prompt": LONG_PROMPT}, 400, "prompt", "max_model_len=512"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "99999"),
    ("completions", {"prompt": "Hi", "regex": "(a"}, 400, "regex", "invalid regex"),
    ("completions", {"prompt": "Hi", "regex": "a", "choice": ["x"]}, 400, "regex", "at most one"),
    ("completions", {"prompt": "Hi", "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    ("completions", {"prompt": "Hi", "logprobs": 2, "regex": "a+"}, 400, "logprobs", "structured output"),
    ("completions", {"prompt": "Hi", "echo": True, "logprobs": 0, "stream": True}, 400, "echo", "stream: false"),
    ("completions", {"prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("completions", {"prompt": "Hi", "stop": [""]}, 400, "stop", "non-empty"),
    ("chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "Input"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0]",
        "text only",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        "needs logprobs: true",
    ),
    (
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}},
        },
        400,
        "response_format",
        "invalid json_schema",
    ),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "greater than or equal to 1",
    ),
]


def _post(server, path, body, headers=None):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    h = {"content-type": "application/json", **auth(), **(headers or {})}
    return httpx.post(f"{server.url}/v1/{path}", headers=h, timeout=60, **kwargs)


def test_each_bad_request_gets_its_error_while_a_good_one_runs(server, reference):
    want = reference.generate(
        [GOOD["prompt"]], SamplingParams(**{k: v for k, v in GOOD.items() if k not in ("model", "prompt")})
    )
    result = {}
    good = threading.Thread(target=lambda: result.update(r=_post(server, "completions", {**GOOD, "stream": False})))
    good.start()
    for path, body, status, param, words in BAD:
        r = _post(server, path, body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param, (body, error)
        assert words in error["message"], (body, error)
    good.join()
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["text"] == want[0].text
    assert server.wait_idle()["graphrt_kv_blocks_used"] == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_without_the_key_401_and_nothing_else(server, headers):
    before = server.metrics()["graphrt_prompt_tokens_total"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401
    assert server.metrics()["graphrt_prompt_tokens_total"] == before  # nothing reached the engine


def test_bodies_over_the_limit_get_413(server):
    big = json.dumps({"prompt": "x" * 70_000, "max_tokens": 2}).encode()
    r = _post(server, "completions", big)
    assert r.status_code == 413 and "65536 bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    r = httpx.post(
        f"{server.url}/v1/completions", content=chunks(), headers={**auth(), "content-type": "application/json"}
    )
    assert r.status_code == 413
    assert _post(server, "completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
