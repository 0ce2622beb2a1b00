"""LoRA adapters over HTTP: ``"model": NAME`` selects the adapter served under that name,
``/v1/models`` lists it, and what comes back is what graphrt.LLM generates with the adapter."""

import httpx
import pytest

from graphrt import LoRARequest, SamplingParams
from tests.helpers import make_llm
from tests.lora.adapters import make_adapter
from tests.server.conftest import SETTINGS, LiveServer

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    # q/v of the tiny Llama: the same shapes in the tiny model over SmolLM2's vocabulary
    return make_adapter(str(tmp_path_factory.mktemp("adapters")), "llama_gqa", ("q_proj", "v_proj"), 4, 8, seed=7)


@pytest.fixture(scope="module")
def lora_server(tiny_tok_model, adapter):
    live = LiveServer(tiny_tok_model, "--lora", f"ada={adapter}", "--max-loras", "2")
    yield live
    live.stop()


def complete(server, model: str) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()


def test_the_adapter_is_a_model_of_its_own(lora_server, tiny_tok_model, adapter):
    models = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "ada"] and models[1]["parent"] == "tiny"
    reference = make_llm(tiny_tok_model, enable_lora=True, **SETTINGS)
    params = SamplingParams(max_tokens=10, temperature=0)
    with_adapter = reference.generate([PROMPT], params, lora_request=LoRARequest("ada", 1, adapter))[0].text
    base = reference.generate([PROMPT], params)[0].text
    assert with_adapter != base
    assert complete(lora_server, "ada")["choices"][0]["text"] == with_adapter
    assert complete(lora_server, "tiny")["choices"][0]["text"] == base
    missing = httpx.post(f"{lora_server.url}/v1/completions", json={"model": "nope", "prompt": "x"}).json()
    assert missing["error"]["code"] == "model_not_found" and "'ada'" in missing["error"]["message"]
