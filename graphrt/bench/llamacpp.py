"""llama.cpp side by side: the peer people run small models with on CPUs.

``graphrt bench decode --vs-llamacpp`` runs llama.cpp (through ``llama-cpp-python``, the optional
``llamacpp`` extra: it builds llama.cpp from source, minutes on 2 cores, so it is never part of
``make test``) interleaved with graphrt on the same weights: an F32 or F16 GGUF written once from
the embedded GGUF (every tensor dequantised, the same metadata and tokenizer), the same prompt
token ids, greedy, and its decode rate from llama.cpp's own performance counters.
"""

from __future__ import annotations

import contextlib
import os
import pathlib

import numpy as np
import torch

INSTALL = "pip install -c constraints.txt 'graphrt[llamacpp]'  (builds llama.cpp from source: about 5 minutes)"
# graphrt's dtype → the GGUF file type llama.cpp runs it in (llama.cpp has no bf16 matmul path on
# most CPUs; F16 is the half-width format its users run)
FILE_TYPES = {"float32": ("F32", 0), "bfloat16": ("F16", 1)}


class LlamaCppMissing(ValueError):
    """The optional llama.cpp extra is not installed; the message says how to install it."""


def require_llamacpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise LlamaCppMissing(f"--vs-llamacpp needs llama-cpp-python, which is not installed: {INSTALL}") from e
    return llama_cpp


def write_gguf(src: str, dst: str, file_type: str) -> str:
    """Write ``src`` (any GGUF) with every tensor dequantised: ``F32``, or ``F16`` for matrices
    (vectors such as norms stay F32, as llama.cpp's own converter does). Written once: an
    existing ``dst`` is reused. Returns ``dst``."""
    import gguf

    if os.path.exists(dst):
        return dst
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES_BY_NAME[file_type])
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        data = data.reshape([int(d) for d in reversed(t.shape)])
        if file_type == "F16" and data.ndim >= 2:
            data = data.astype(np.float16)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst


FILE_TYPES_BY_NAME = {name: code for name, code in FILE_TYPES.values()}


def gguf_for(src: str, dtype: str, cache_dir: pathlib.Path) -> str:
    file_type = FILE_TYPES[dtype][0]
    cache_dir.mkdir(parents=True, exist_ok=True)
    return write_gguf(src, str(cache_dir / f"{pathlib.Path(src).stem}.{file_type}.gguf"), file_type)


@contextlib.contextmanager
def _plain_buffers(llama_cpp):
    """llama.cpp's model parameter ``use_extra_bufts`` off for one load (the CLI's ``--no-repack``).
    llama-cpp-python (0.3.36) has no argument for it — an unknown keyword is silently dropped —
    so the defaults its ``Llama`` starts from are wrapped while it loads."""
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def plain():
        params = default()
        params.use_extra_bufts = False
        return params

    module.llama_model_default_params = plain
    try:
        yield
    finally:
        module.llama_model_default_params = default


class LlamaCpp:
    """One llama.cpp model, run greedily over token ids, one sequence at a time."""

    def __init__(self, path: str, n_ctx: int, threads: int, repack: bool = True) -> None:
        """``repack=False``: llama.cpp's plain CPU buffers for quantized weights (the CLI's
        ``--no-repack``): its AMX repacking of Q4_1 crashes when built with GCC 12's AMX header."""
        llama_cpp = require_llamacpp()
        self.lib = llama_cpp
        with contextlib.nullcontext() if repack else _plain_buffers(llama_cpp):
            self.llm = llama_cpp.Llama(
                model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
            )

    def run(self, prompt: list[int], gen_len: int) -> dict:
        """Greedy tokens after ``prompt`` (EOS does not stop it, like graphrt's ignore_eos) and
        llama.cpp's own counters: prompt time, decode time and decode tokens/s."""
        ctx = self.llm._ctx.ctx
        self.llm.reset()
        self.lib.llama_perf_context_reset(ctx)
        tokens = []
        for tok in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(tok))
            if len(tokens) == gen_len:
                break
        perf = self.lib.llama_perf_context(ctx)
        return {
            "decode_tok_s": perf.n_eval / (perf.t_eval_ms / 1e3) if perf.t_eval_ms > 0 else float("nan"),
            "prompt_ms": perf.t_p_eval_ms,
            "decode_ms": perf.t_eval_ms,
            "n_eval": perf.n_eval,
            "tokens": tokens,
        }


def _gguf_path(model: str | None) -> str:
    """The model's GGUF (the embedded one by default): llama.cpp reads nothing else."""
    from graphrt.loader import default_model_path

    path = model or default_model_path()
    if not path.endswith(".gguf"):
        raise ValueError(f"--vs-llamacpp needs a .gguf model (llama.cpp reads GGUF only), got {path!r}")
    return path


def start_llamacpp_quantized(model: str | None, n_ctx: int) -> LlamaCpp:
    """llama.cpp on the quantized GGUF itself, without its repacking (see LlamaCpp)."""
    require_llamacpp()
    return LlamaCpp(_gguf_path(model), n_ctx, torch.get_num_threads(), repack=False)


def start_llamacpp(model: str | None, dtype: str, n_ctx: int) -> LlamaCpp:
    """llama.cpp on an F32 (fp32) or F16 (bf16) GGUF written once from the model's own GGUF."""
    from graphrt.kernels.native_library import cache_root

    require_llamacpp()
    path = _gguf_path(model)
    print(f"llama.cpp: writing or reusing a dequantised copy of {os.path.basename(path)}")
    converted = gguf_for(path, dtype, cache_root() / "llamacpp")
    return LlamaCpp(converted, n_ctx, torch.get_num_threads())
