"""The tokenizer's fast path (the `tokenizers` library, no transformers import) agrees with the
transformers tokenizer it stands in for."""

import json
import random
import shutil

import pytest

from graphrt.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "  leading and trailing spaces  ",
    "naïve café — 東京 🚀\ttabs\nnewlines\n\n",
    "<|im_start|>user\nspecial tokens written as text<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tiny_tok_model):
    return tiny_tok_model  # SmolLM2's tokenizer files, saved by transformers


def test_fast_path_is_taken_and_matches_transformers(tok_dir):
    from transformers import AutoTokenizer

    fast, hf = Tokenizer(directory=tok_dir), AutoTokenizer.from_pretrained(tok_dir)
    assert fast._fast is not None and fast._hf is None  # served without transformers
    for text in TEXTS:
        assert fast.encode(text) == list(hf.encode(text)), text
        assert fast.apply_chat_template(text) == list(
            hf.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        ), text
    rng = random.Random(0)
    specials = list(hf.all_special_ids)
    for _ in range(50):
        ids = [rng.randrange(hf.vocab_size) for _ in range(rng.randrange(1, 40))] + rng.sample(specials, 1)
        rng.shuffle(ids)
        assert fast.decode(ids) == hf.decode(ids, skip_special_tokens=True), ids
    assert fast.eos_token_id == hf.eos_token_id
    assert fast.hf is not None  # the grammar compiler's tokenizer, loaded on demand


@pytest.mark.parametrize("setting", [{"add_bos_token": True}, {"clean_up_tokenization_spaces": True}])
def test_settings_the_fast_path_does_not_apply_send_it_to_transformers(tok_dir, tmp_path, setting):
    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, **setting}))
    tok = Tokenizer(directory=str(d))
    assert tok._fast is None and tok._hf is not None


def test_a_template_the_renderer_cannot_serve_falls_back(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    (d / "chat_template.jinja").write_text("{% generation %}{{ messages[0]['content'] }}{% endgeneration %}")
    tok = Tokenizer(directory=str(d))
    hf = AutoTokenizer.from_pretrained(str(d))
    want = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    assert tok.apply_chat_template("hi") == list(want["input_ids"])
