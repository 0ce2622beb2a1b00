"""A live ``graphrt serve`` on 127.0.0.1 over the tiny model with SmolLM2's tokenizer, and the
same model in-process (graphrt.LLM) as the reference for what the server must return."""

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.helpers import make_llm

API_KEY = "test-key"
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512, kv_cache_memory=16_000_000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "graphrt.cli", "serve", "--model", model, "--port", str(self.port)]
        args += ["--no-compile", "--no-graph-cache", "--served-model-name", "tiny"]
        for name, value in SETTINGS.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen([*args, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphrt serve exited {self.proc.returncode}: {self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("graphrt serve did not become healthy in 120 s")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples without labels, by name."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once no request runs or waits (and every KV block is free), or the last seen."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = m["graphrt_requests_running"] == 0 and m["graphrt_requests_waiting"] == 0
            if (idle and m["graphrt_kv_blocks_used"] == 0) or time.time() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, sig=None) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig or subprocess.signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="session")
def server(tiny_tok_model):
    live = LiveServer(tiny_tok_model, "--api-key", API_KEY, "--max-queued", "32", "--max-request-bytes", "65536")
    yield live
    live.stop()


@pytest.fixture(scope="session")
def reference(tiny_tok_model):
    """The served model in-process, with the server's settings."""
    return make_llm(tiny_tok_model, **SETTINGS)


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


os.environ.setdefault("NO_PROXY", "127.0.0.1,localhost")
