"""The incremental detokenizer gives, token by token, the text of one decode of the whole output:
on SmolLM2's byte-level BPE and on a SentencePiece-style tokenizer (a leading space dropped at the
start of a text, bytes as fallback tokens), over real texts and random token ids."""

import random

import pytest

from graphrt.core.stop import Detokenizer, find_stop_string
from graphrt.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "naïve café — 東京 🚀\ttabs\nnewlines\n\n",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x ** 2  # code 🎉🎉",
]


class _Spm:
    """A SentencePiece-style tokenizer built in memory: "▁" for spaces, the first one stripped
    from a decoded text, byte tokens for what the vocabulary lacks."""

    def __init__(self):
        from tokenizers import Tokenizer as Raw
        from tokenizers import decoders, models, normalizers, trainers

        self.raw = Raw(models.BPE(byte_fallback=True))
        self.raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        self.raw.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=[f"<0x{i:02X}>" for i in range(256)], show_progress=False
        )
        self.raw.train_from_iterator(["the quick brown fox jumps over the lazy dog", *TEXTS] * 20, trainer)

    def encode(self, text: str) -> list[int]:
        return self.raw.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.raw.decode(ids, skip_special_tokens=False)

    def vocab_size(self) -> int:
        return self.raw.get_vocab_size()


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece"])
def tokenizer(request, tiny_tok_model):
    if request.param == "smollm2":
        tok = Tokenizer(directory=tiny_tok_model)
        tok.vocab_size = lambda: 49152
        return tok
    return _Spm()


def sequences(tok):
    """Real texts' ids, then random ids: runs of byte tokens that are no character included."""
    for text in TEXTS:
        yield tok.encode(text)
    rng = random.Random(0)
    for _ in range(150):
        yield [rng.randrange(tok.vocab_size()) for _ in range(30)]


def test_each_step_and_the_end_equal_one_decode_of_everything(tokenizer):
    for ids in sequences(tokenizer):
        detok = Detokenizer(tokenizer, ())
        for n in range(1, len(ids) + 1):
            assert detok.update(ids[:n]) is False
            whole = tokenizer.decode(ids[:n])
            if not whole.endswith("\ufffd"):  # (a character's bytes may still be coming)
                assert detok.text == whole, ids[:n]
        detok.finish(ids)
        assert detok.text == tokenizer.decode(ids)


def test_stop_strings_cut_where_a_decode_of_everything_would(tokenizer):
    # sequences that are characters all along (with bytes that are none, a decode of everything
    # may hold a stop string for a step and lose it the next: no cut is then "right")
    clean = [ids for ids in sequences(tokenizer) if "\ufffd" not in tokenizer.decode(ids)]
    assert len(clean) >= 4
    for ids in clean[:40]:
        whole = tokenizer.decode(ids)
        stops = (whole[len(whole) // 2 : len(whole) // 2 + 3],) if len(whole) > 6 else ("zz",)
        detok = Detokenizer(tokenizer, stops)
        stopped_at = None
        for n in range(1, len(ids) + 1):
            if detok.update(ids[:n]):
                stopped_at = n
                break
        # the reference: the first prefix whose full decode holds a stop string, cut before it
        want_at = next(
            (n for n in range(1, len(ids) + 1) if find_stop_string(tokenizer.decode(ids[:n]), stops, 0) is not None),
            None,
        )
        if want_at is None:
            assert stopped_at is None
            continue
        assert stopped_at is not None and stopped_at >= want_at
        text = tokenizer.decode(ids[:want_at])
        assert detok.text == text[: find_stop_string(text, stops, 0)]
