"""A tiny LLaVA against transformers: image + text prompts, eager and in graphs, mixed with
text-only prompts; images in the prefix cache's keys; the encoder cache; bad input named at
submission while the engine keeps serving."""

import functools

import numpy as np
import pytest
import torch

from graphrt import SamplingParams
from graphrt.runner.graph_cache import CaptureSizes
from graphrt.sampling_params import InvalidRequestError
from tests.helpers import make_llm
from tests.tiny_models import LLAVA_IMAGE_TOKEN, save_tiny_llava

IMG = LLAVA_IMAGE_TOKEN
GREEDY = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
PLAIN = SamplingParams(max_tokens=8, temperature=0)  # prompt log-probabilities take no cached prefix


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_tiny_llava(str(tmp_path_factory.mktemp("llava")))


def image(seed: int, shape=(40, 50, 3)) -> np.ndarray:
    return (np.random.default_rng(seed).random(shape) * 255).astype(np.uint8)


@functools.lru_cache(maxsize=2)
def hf(path):
    from transformers import CLIPImageProcessor, LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(path).eval(), CLIPImageProcessor.from_pretrained(path)


def hf_reference(path, ids, img, max_new_tokens=8):
    """transformers' greedy tokens and prompt log-probabilities (ids with the placeholders expanded)."""
    model, proc = hf(path)
    kwargs = {} if img is None else {"pixel_values": proc(images=[img], return_tensors="pt")["pixel_values"]}
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, **kwargs,
        )  # fmt: skip
        logprobs = torch.log_softmax(model(input_ids=t, **kwargs).logits[0].float(), -1)
    return out[0, len(ids) :].tolist(), torch.tensor([logprobs[p - 1, ids[p]].item() for p in range(1, len(ids))])


def prompt_logprobs(out):
    return torch.tensor([e[t] for t, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])


def check_against_transformers(path, outs, images):
    for out, img in zip(outs, images):
        tokens, want = hf_reference(path, out.prompt_token_ids, img)
        assert out.token_ids == tokens
        if out.prompt_logprobs is not None:
            assert (prompt_logprobs(out) - want).abs().max().item() < 1e-4


PROMPTS = [
    ({"prompt_token_ids": [1, 5, 6, IMG, 7, 8, 9], "multi_modal_data": {"image": image(0)}}, image(0)),
    ([1, 40, 41, 42, 43], None),  # text only, in the same batch
    (
        {"prompt_token_ids": [1, IMG, 70, 71], "multi_modal_data": {"image": image(1, (64, 48, 3))}},
        image(1, (64, 48, 3)),
    ),
]


def test_image_prompts_match_transformers_eagerly_beside_text_prompts(llava):
    llm = make_llm(llava, max_model_len=128, kv_cache_memory=2_000_000)
    outs = llm.generate([p for p, _ in PROMPTS], GREEDY)
    assert len(outs[0].prompt_token_ids) == 7 - 1 + 16  # one placeholder expanded to 16 patches
    check_against_transformers(llava, outs, [img for _, img in PROMPTS])


def test_image_prompts_in_captured_graphs(llava):
    """The merge is inside the step graph: prefill graphs take the image embeddings through the
    model's buffers; replayed by the eager inner backend (Inductor's code is the end-to-end tests')."""
    llm = make_llm(
        llava, compile=True, backend="eager", max_num_seqs=4, max_num_batched_tokens=64,
        capture_sizes=CaptureSizes(decode=(4,), mixed=(64,)), max_model_len=128, kv_cache_memory=2_000_000,
    )  # fmt: skip
    outs = llm.generate([p for p, _ in PROMPTS], GREEDY)
    check_against_transformers(llava, outs, [img for _, img in PROMPTS])
    assert llm.stats()["graph_misses"] == 0


def test_blocks_holding_an_image_are_keyed_by_it_and_a_repeated_image_is_encoded_once(llava):
    llm = make_llm(llava, max_model_len=128, kv_cache_memory=2_000_000, block_size=4)
    encoder = llm.engine.loaded.encoder
    text = [1, 5, 6, 7, IMG, 8, 9, 10, 11]  # block 0 is text; the image's 16 patches fill blocks 1-4
    a = llm.generate({"prompt_token_ids": text, "multi_modal_data": {"image": image(3)}}, PLAIN)[0]
    hits = llm.stats()["prefix_cache_hits"]
    b = llm.generate({"prompt_token_ids": text, "multi_modal_data": {"image": image(4)}}, PLAIN)[0]
    assert llm.stats()["prefix_cache_hits"] == hits + 1  # the text block only: no block of the image
    assert a.token_ids != b.token_ids
    check_against_transformers(llava, [a, b], [image(3), image(4)])
    misses = encoder.misses
    again = llm.generate({"prompt_token_ids": text, "multi_modal_data": {"image": image(3)}}, PLAIN)[0]
    assert encoder.misses == misses and encoder.hits >= 1  # the same image: embeddings reused
    assert llm.stats()["prefix_cache_hits"] == hits + 1 + 5  # and every full block of the prompt shared
    assert again.token_ids == a.token_ids


def test_bad_image_input_is_named_at_submission_and_the_engine_keeps_serving(llava, tiny_model):
    llm = make_llm(llava, max_model_len=128, kv_cache_memory=2_000_000)
    ok = {"prompt_token_ids": [1, IMG, 5], "multi_modal_data": {"image": image(5)}}
    cases = [
        ({"prompt_token_ids": [1, IMG, IMG, 5], "multi_modal_data": {"image": image(5)}}, "2 image placeholder tokens"),
        ({"prompt_token_ids": [1, 5], "multi_modal_data": {"image": image(5)}}, "0 image placeholder tokens"),
        ({"prompt_token_ids": [1, IMG] * 5, "multi_modal_data": {"image": [image(i) for i in range(5)]}},
         "5 images; limit_mm_per_prompt allows 4"),
        ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"image": np.zeros((4, 4, 7))}}, r"shape \(4, 4, 7\)"),
        ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"image": "cat.png"}}, "got str"),
        ({"prompt_token_ids": [1, IMG], "multi_modal_data": {"video": image(5)}}, "the key 'image'"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "'prompt' \\(text\\) or 'prompt_token_ids'"),
    ]  # fmt: skip
    rid = llm.engine.add_request([1, 9, 9, 9], SamplingParams(max_tokens=6, temperature=0))
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([ok, prompt], GREEDY)  # the whole call is refused, nothing queued
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(llm.engine.output(rid).token_ids) == 6
    assert llm.generate(ok, GREEDY)[0].token_ids  # still serving
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image(6)).save(buf, format="PNG")
    corrupt = Image.open(io.BytesIO(buf.getvalue()[:60]))
    with pytest.raises(InvalidRequestError, match="image 0 cannot be read"):
        llm.generate({"prompt_token_ids": [1, IMG], "multi_modal_data": {"image": corrupt}}, GREEDY)
    text_only = make_llm(tiny_model("llama_gqa"), max_model_len=64, kv_cache_memory=1_000_000)
    with pytest.raises(InvalidRequestError, match="this model takes text only; the prompt has 1 image"):
        text_only.generate({"prompt_token_ids": [1, 5], "multi_modal_data": {"image": image(7)}}, GREEDY)


def test_the_memory_profile_counts_the_encoder(llava):
    """Sizing the KV cache from free memory: the worst-case step's peak, or encoding
    limit_mm_per_prompt images if that is larger, plus the encoder cache's bound."""
    llm = make_llm(llava, max_model_len=64, limit_mm_per_prompt=2)
    encoder = llm.engine.loaded.encoder
    assert encoder.profile(2) > 0
    assert llm.engine.activation_peak >= encoder.cache_bytes


def test_image_prompts_in_one_inductor_graph(llava):
    """Inductor's code for the merge: one mixed graph serves the prefills and the decodes."""
    llm = make_llm(
        llava, compile=True, max_num_seqs=2, max_num_batched_tokens=32,
        capture_sizes=CaptureSizes(decode=(), mixed=(32,)), max_model_len=96, kv_cache_memory=2_000_000,
    )  # fmt: skip
    outs = llm.generate([p for p, _ in PROMPTS[:2]], GREEDY)
    check_against_transformers(llava, outs, [img for _, img in PROMPTS[:2]])
    assert llm.stats()["graph_misses"] == 0 and llm.stats()["graph_hits"] > 0


def test_an_image_split_across_prefill_chunks(llava):
    """8-token prefill chunks: the 16 patches reach the model in three steps, each its slice."""
    llm = make_llm(llava, max_model_len=128, kv_cache_memory=2_000_000, max_num_batched_tokens=8, max_num_seqs=2)
    outs = llm.generate([p for p, _ in PROMPTS], GREEDY)
    check_against_transformers(llava, outs, [img for _, img in PROMPTS])
