"""An engine fault fails only the requests it hit; SIGTERM drains in-flight streams and exits 0."""

import json
import signal
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn

from graphrt.server.app import build_app
from tests.helpers import make_llm
from tests.server.conftest import LiveServer, free_port


@contextmanager
def in_process_server(engine):
    """The app over ``engine`` served by uvicorn on a thread (so a test can reach into the engine)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "tiny"), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_engine_fault_fails_the_affected_requests_and_the_server_keeps_serving(tiny_model):
    llm = make_llm(tiny_model("llama_gqa"), max_model_len=64, kv_cache_memory=2_000_000)
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    execute, schedule = runner.execute, scheduler.schedule
    faults = {"execute": 0, "schedule": 0}

    def failing(original, name):
        def call(*args, **kwargs):
            if faults[name]:
                faults[name] -= 1
                raise RuntimeError(f"injected {name} fault")
            return original(*args, **kwargs)

        return call

    runner.execute, scheduler.schedule = failing(execute, "execute"), failing(schedule, "schedule")
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with in_process_server(llm.engine) as url:
        ok = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        for name in faults:  # a step fault (requests ended by the engine) and a fault outside it
            faults[name] = 1
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            faults[name] = 1
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert s.status_code == 200 and events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["type"] == "server_error"
            again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok
        m = httpx.get(f"{url}/metrics").text
        assert "graphrt_engine_step_errors_total 4.0" in m and "graphrt_kv_blocks_used 0.0" in m


def test_sigterm_finishes_in_flight_streams_then_exits_0(tiny_tok_model):
    live = LiveServer(tiny_tok_model, "--shutdown-timeout", "20")
    body = {"prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    lines = []
    try:
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 2:
                        live.proc.send_signal(signal.SIGTERM)
        code = live.proc.wait(timeout=30)
    finally:
        live.stop()
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(e) for e in lines[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert code == 0


def test_a_server_asked_to_prefault_reports_its_kv_pages_faulted_in_while_idle(tiny_tok_model):
    """``--prefault-kv-cache``: the whole cache is faulted in on a thread from start-up, and the
    gauge follows it with no request sent (the idle engine loop refreshes its counters)."""
    from graphrt.runner.page_warmer import populate_supported

    # Arrange
    live = LiveServer(tiny_tok_model, "--prefault-kv-cache")
    try:
        # Act
        deadline = time.time() + 30
        while True:
            m = live.metrics()
            if m.get("graphrt_kv_blocks_warmed", 0) > m["graphrt_kv_blocks_total"] or time.time() > deadline:
                break
            time.sleep(0.2)
    finally:
        live.stop()
    # Assert: every block, the null block too; no warmer (and no gauge) where the kernel lacks the advice
    if populate_supported():
        assert m["graphrt_kv_blocks_warmed"] == m["graphrt_kv_blocks_total"] + 1
    else:
        assert "graphrt_kv_blocks_warmed" not in m
