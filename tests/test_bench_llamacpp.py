"""The llama.cpp comparison's own pieces, without llama.cpp (an optional extra, never in
`make test`): the dequantised GGUF copy it runs on, the message when the extra is missing, and
how a load without llama.cpp's weight repacking is asked for."""

import sys
import types

import gguf
import numpy as np
import pytest

from graphrt.bench.llamacpp import LlamaCpp, LlamaCppMissing, require_llamacpp, write_gguf


@pytest.fixture
def quantized_gguf(tmp_path):
    path = str(tmp_path / "src.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    matrix = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)


@pytest.mark.parametrize("file_type,matrix_dtype", [("F32", np.float32), ("F16", np.float16)])
def test_the_copy_holds_dequantised_tensors_and_the_metadata(quantized_gguf, tmp_path, file_type, matrix_dtype):
    src, dequantised = quantized_gguf
    dst = write_gguf(src, str(tmp_path / f"copy.{file_type}.gguf"), file_type)
    r = gguf.GGUFReader(dst)
    assert r.fields["general.name"].contents() == "tiny"
    assert r.fields["llama.block_count"].contents() == 2
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert r.fields["general.file_type"].contents() == {"F32": 0, "F16": 1}[file_type]
    tensors = {t.name: t for t in r.tensors}
    q = tensors["blk.0.attn_q.weight"]
    assert q.data.dtype == matrix_dtype and list(q.shape) == [64, 4]
    np.testing.assert_array_equal(np.asarray(q.data), dequantised.astype(matrix_dtype))
    norm = tensors["blk.0.attn_norm.weight"]
    assert norm.data.dtype == np.float32  # vectors stay F32, as llama.cpp's converter keeps them
    np.testing.assert_array_equal(np.asarray(norm.data), np.arange(64, dtype=np.float32))


def test_a_missing_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(LlamaCppMissing, match=r"pip install .*graphrt\[llamacpp\]"):
        require_llamacpp()


def test_no_repack_loads_with_llamacpps_extra_buffers_off(monkeypatch):
    """llama-cpp-python has no argument for `use_extra_bufts`; LlamaCpp(repack=False) turns it off
    in the model parameters its Llama starts from, for that load only."""
    seen = []

    def default_params():
        return types.SimpleNamespace(use_extra_bufts=True)

    bindings = types.SimpleNamespace(llama_model_default_params=default_params)

    class Llama:  # reads its parameters as llama-cpp-python's does
        def __init__(self, **kwargs):
            seen.append(bindings.llama_model_default_params().use_extra_bufts)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(llama_cpp=bindings, Llama=Llama))
    LlamaCpp("model.gguf", n_ctx=64, threads=2, repack=False)
    LlamaCpp("model.gguf", n_ctx=64, threads=2)
    assert seen == [False, True]
    assert bindings.llama_model_default_params is default_params
