"""Many clients at once on loopback: continuous batching across clients, back-pressure, and
clients that leave mid-stream."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from graphrt import SamplingParams
from tests.oracle import random_prompts
from tests.server.conftest import auth


def _params(i: int) -> dict:
    if i % 3 == 0:
        return {"temperature": 0, "max_tokens": 4 + i % 12}
    return {"temperature": 0.8, "top_k": 40, "seed": 100 + i, "max_tokens": 4 + i % 12, "ignore_eos": True}


def _stream(url: str, body: dict) -> tuple[list[dict], str]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(), timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(e) for e in events[:-1]], events[-1]


def test_32_streaming_clients_each_get_their_single_request_output(server, reference):
    prompts = random_prompts([3 + (7 * i) % 40 for i in range(32)], seed=5, vocab=49152)
    bodies = [{"prompt": p, "stream": True, "model": "tiny", **_params(i)} for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda b: _stream(server.url, b), bodies))
    for i, ((chunks, done), prompt) in enumerate(zip(results, prompts)):
        assert done == "[DONE]"
        want = reference.generate([prompt], SamplingParams(**_params(i)), use_tqdm=False)[0]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want.text, i
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes[-1] == want.finish_reason and all(f is None for f in finishes[:-1])
    m = server.wait_idle()
    assert m["graphrt_kv_blocks_used"] == 0 and m["graphrt_requests_running"] == 0


def test_a_burst_beyond_max_queued_gets_429_while_admitted_requests_finish(server):
    # 64 requests at once against 8 running + 32 waiting: each runs long enough (32 tokens) that
    # the queue cannot drain while the burst arrives
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 32, "ignore_eos": True, "temperature": 0, "model": "tiny"}
    start = threading.Barrier(64)

    def post(_):
        start.wait()
        return httpx.post(f"{server.url}/v1/completions", json=body, headers=auth(), timeout=120)

    with ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(post, range(64)))
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == 64
    assert refused[0].headers["retry-after"] == "1"
    assert refused[0].json()["error"]["type"] == "rate_limit_error"
    for r in served:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 32
    assert server.wait_idle()["graphrt_kv_blocks_used"] == 0


def test_clients_that_leave_mid_stream_free_their_blocks(server):
    before = server.metrics().get('graphrt_requests_finished_total{finish_reason="abort"}', 0)
    body = {"prompt": [9, 10, 11], "max_tokens": 500, "ignore_eos": True, "stream": True, "model": "tiny"}

    def leave_early():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth(), timeout=60) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 6:
                    return  # closes the connection

    def leave_while_waiting():  # a whole (non-streamed) response: the connection just closes
        raw = json.dumps({**body, "stream": False}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += f"Authorization: {auth()['Authorization']}\r\nContent-Length: {len(raw)}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head.encode() + raw)
            time.sleep(0.5)

    threads = [threading.Thread(target=leave_early) for _ in range(4)]
    threads.append(threading.Thread(target=leave_while_waiting))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m = server.wait_idle()
    assert m["graphrt_kv_blocks_used"] == 0 and m["graphrt_requests_running"] == 0
    assert m['graphrt_requests_finished_total{finish_reason="abort"}'] - before == 5
