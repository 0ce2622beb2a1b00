"""A GGUF file whose tensor entries do not add up is refused by name before anything is mapped;
quantized types are dequantised with a notice naming them; an unreadable type is named."""

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from graphrt.loader.gguf_file import GGUFCheckpoint
from graphrt.loader.weights import CheckpointError

DOWN = "model.layers.0.mlp.down_proj.weight"


def write(path, tensors, raw_edit=None) -> str:
    """A GGUF with the given (name, float array, type) tensors; ``raw_edit(bytes) -> bytes``
    tampers with the written file."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, x, kind in tensors:
        if kind in (T.F32,):
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if raw_edit is not None:
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(raw_edit(data))
    return str(path)


def x(rows=4, cols=64, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def test_a_truncated_tensor_is_named_with_its_type_and_byte_count(tmp_path):
    path = write(tmp_path / "t.gguf", [("blk.0.ffn_down.weight", x(), T.Q8_0)], lambda d: d[:-40])
    with pytest.raises(
        CheckpointError, match=r"tensor blk\.0\.ffn_down\.weight \(Q8_0, shape \[4, 64\]\) needs 272 bytes"
    ):
        GGUFCheckpoint(path)


def test_a_shape_that_overruns_the_next_tensor_is_refused(tmp_path):
    a, b = x(seed=1), x(seed=2)

    def grow_first_rows(data: bytes) -> bytes:  # the first tensor's dims [64, 4] become [64, 8]
        name = b"blk.0.ffn_down.weight"
        at = data.index(name) + len(name) + 4 + 8  # name, n_dims (u32), dims[0] (u64)
        assert int.from_bytes(data[at : at + 8], "little") == 4
        return data[:at] + (8).to_bytes(8, "little") + data[at + 8 :]

    path = write(
        tmp_path / "o.gguf", [("blk.0.ffn_down.weight", a, T.Q8_0), ("blk.0.ffn_up.weight", b, T.Q8_0)], grow_first_rows
    )
    with pytest.raises(
        CheckpointError,
        match=r"ffn_down\.weight \(Q8_0\) needs 544 bytes of data, but tensor blk\.0\.ffn_up\.weight begins",
    ):
        GGUFCheckpoint(path)


def test_an_unknown_type_code_is_named(tmp_path):
    def retype(data: bytes) -> bytes:
        name = b"blk.0.ffn_down.weight"
        at = data.index(name) + len(name) + 4 + 16  # name, n_dims, two dims
        assert int.from_bytes(data[at : at + 4], "little") == T.Q8_0
        return data[:at] + (250).to_bytes(4, "little") + data[at + 4 :]

    path = write(tmp_path / "u.gguf", [("blk.0.ffn_down.weight", x(), T.Q8_0)], retype)
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.ffn_down\.weight has unknown GGML type code 250"):
        GGUFCheckpoint(path)


def test_quantized_tensors_are_dequantised_with_a_notice(tmp_path, caplog):
    w = x(seed=3)
    path = write(tmp_path / "q.gguf", [("blk.0.ffn_down.weight", w, T.Q8_0), ("blk.0.ffn_up.weight", w, T.F32)])
    with caplog.at_level(logging.WARNING, logger="graphrt.loader"):
        source = GGUFCheckpoint(path).tensors(cfg=None, keep_quantized=False)
    assert any("Q8_0 (1 tensors) are dequantised" in r.message for r in caplog.records)
    got = source.get(DOWN, (4, 64)).numpy()
    np.testing.assert_allclose(got, w, atol=np.abs(w).max() / 100)  # Q8_0: 8-bit blocks
    assert os.path.getsize(path) > 0


def test_q4_q8_stay_quantized_and_other_types_are_dequantised_with_a_notice(tmp_path, caplog):
    from graphrt.loader.quantization import QuantizedTensor

    w = x(seed=4)
    path = write(tmp_path / "k.gguf", [("blk.0.ffn_down.weight", w, T.Q8_0), ("blk.0.ffn_up.weight", w, T.Q5_0)])
    with caplog.at_level(logging.WARNING, logger="graphrt.loader"):
        source = GGUFCheckpoint(path).tensors(cfg=None)
    notices = [r.message for r in caplog.records]
    assert any("Q5_0 (1 tensors) are dequantised" in m for m in notices)
    assert not any("Q8_0" in m for m in notices)
    assert isinstance(source.get(DOWN, (4, 64)), QuantizedTensor)
    up = source.get("model.layers.0.mlp.up_proj.weight", (4, 64))
    assert up.dtype == torch.float32
    np.testing.assert_allclose(up.numpy(), w, atol=np.abs(w).max() / 10)  # Q5_0: 5-bit blocks


def test_a_type_the_gguf_package_cannot_dequantise_is_named(tmp_path, monkeypatch):
    path = write(tmp_path / "n.gguf", [("blk.0.ffn_down.weight", x(), T.Q8_0)])
    checkpoint = GGUFCheckpoint(path)

    def cannot(data, kind):
        raise NotImplementedError(kind)

    monkeypatch.setattr(checkpoint, "_dequantize", cannot)
    with pytest.raises(
        CheckpointError, match=r"tensor blk\.0\.ffn_down\.weight has GGML type Q8_0, which graphrt cannot read"
    ):
        checkpoint.tensors(cfg=None, keep_quantized=False).get(DOWN, (4, 64))
