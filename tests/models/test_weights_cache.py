"""The weights cache: a GGUF converted once, mapped afterwards, and never loaded when damaged."""

import logging
import os
import shutil

import pytest
import torch

from graphrt.loader import default_model_path, load_model
from graphrt.loader import gguf_file as gguf_mod
from graphrt.loader.weights_cache import WEIGHTS


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHRT_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A cache directory holding the converted bf16 entry and the weights it gives (converted
    once for the tests that damage a copy of it)."""
    root = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRAPHRT_CACHE_DIR", str(root))
        loaded = load_model(None, "bfloat16")
        reference = {k: v.clone() for k, v in loaded.model.state_dict().items()}
        reference["config"], reference["eos"], reference["tokenizer"] = (
            loaded.config,
            loaded.eos_token_ids,
            loaded.tokenizer,
        )
        del loaded
    return root, reference


def entry_dir(cache_dir):
    (entry,) = [e for e in os.listdir(cache_dir / "weights") if not e.startswith(".")]
    return cache_dir / "weights" / entry


def refuse_gguf(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(gguf_mod.GGUFCheckpoint, "__init__", refuse)


def test_second_load_maps_the_converted_weights_and_tokenizer(cache_dir, converted, monkeypatch):
    root, reference = converted  # the first load converted the GGUF into this entry
    shutil.copytree(root / "weights", cache_dir / "weights")
    text = "The capital of France is Paris."
    refuse_gguf(monkeypatch)
    second = load_model(None, "bfloat16")
    assert second.config == reference["config"] and second.eos_token_ids == reference["eos"]
    for k, v in second.model.state_dict().items():
        assert torch.equal(v, reference[k]), k
    first_tok = reference["tokenizer"]
    assert second.tokenizer.encode(text) == first_tok.encode(text)
    assert second.tokenizer.apply_chat_template(text) == first_tok.apply_chat_template(text)
    assert second.source == os.path.abspath(default_model_path())


@pytest.mark.parametrize("damage", ["flip", "truncate", "tokenizer"])
def test_a_damaged_entry_is_detected_and_rebuilt_from_the_checkpoint(cache_dir, converted, caplog, damage):
    root, reference = converted
    shutil.copytree(root / "weights", cache_dir / "weights")  # a copy of the converted entry to damage
    entry = entry_dir(cache_dir)
    weights = entry / WEIGHTS
    if damage == "flip":  # one byte inside the tensor data: a load would change a weight
        with open(weights, "r+b") as f:
            f.seek(os.path.getsize(weights) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(weights, os.path.getsize(weights) // 2)
    else:
        (entry / "tokenizer" / "tokenizer.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="graphrt.loader"):
        again = load_model(None, "bfloat16")
    assert any("rebuilding it from the checkpoint" in r.message for r in caplog.records)
    for k, v in again.model.state_dict().items():
        assert torch.equal(v, reference[k]), k
    assert again.tokenizer.encode("Paris") == reference["tokenizer"].encode("Paris")
    assert entry_dir(cache_dir) == entry  # rebuilt in place, under the same key


def test_the_key_follows_the_content_and_the_dtype(cache_dir, tmp_path_factory):
    from graphrt.loader.weights_cache import WeightsCache

    cache = WeightsCache(str(cache_dir / "weights"))
    src = default_model_path()
    assert cache.key(src, torch.float32) != cache.key(src, torch.bfloat16)
    copy = tmp_path_factory.mktemp("copy") / "model.gguf"
    data = bytearray(open(src, "rb").read())
    copy.write_bytes(bytes(data))
    assert cache.key(str(copy), torch.float32) == cache.key(src, torch.float32)  # content, not path
    data[-1] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert cache.key(str(copy), torch.float32) != cache.key(src, torch.float32)
