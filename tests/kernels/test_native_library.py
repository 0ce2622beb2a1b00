"""The native library: every instruction-set path and the portable torch bodies give the
reference's results (each in a fresh process, since the set is chosen once per process), the
build is cached by its key, and a bad request for an instruction set is named."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from graphrt.kernels import native_library

CHECK = textwrap.dedent("""
    import json, torch
    import graphrt.kernels as kernels
    from graphrt.kernels import reference
    from graphrt.kernels.packed_bf16 import to_packed
    from graphrt.kernels.quant_tiles import to_tiles
    from graphrt.kernels.quantized import dequantize_torch, quantize_int4, quantize_int8
    from tests.kernels.paged_batch import make_batch
    errs = {}
    g, gk = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        # (2..16 rows, K a multiple of 32: AMX tiles where the CPU has them, with ragged row tails)
        # (8 and 16 rows of 1,536 and more: the fp32 tiles in chunks of K where the tuning is AMD's,
        # from a generator of their own, which leaves the other cases' inputs as they were)
        for m, n, k, gen in [(1, 577, 33, g), (5, 7, 577, g), (16, 64, 48, g), (3, 1, 1, g), (2, 64, 64, g),
                             (8, 100, 96, g), (16, 577, 576, g), (8, 37, 1541, gk), (16, 9, 1536, gk)]:
            x, w, b = (torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype),
                       torch.randn(n, generator=gen).to(dtype))
            want = x.double() @ w.double().T + b.double()
            got = kernels.linear(x, w, b).double()
            errs[f"linear {dtype} {m}x{n}x{k}"] = ((got - want).abs().max() / want.abs().max()).item()
        for bits in (4, 8):  # the quantized kernels, every row-count path (6-8 rows: AMX tiles, ragged tails)
            for m, n, k in [(1, 33, 96), (2, 9, 96), (3, 7, 576), (8, 64, 64), (6, 35, 576), (7, 17, 96), (20, 5, 160)]:
                w = torch.randn(n, k, generator=g)
                q = quantize_int4(w) if bits == 4 else (*quantize_int8(w), None)
                x = torch.randn(m, k, generator=g).to(dtype)
                want = x.double() @ dequantize_torch(*q, torch.float64).T
                got = kernels.linear_quantized(x, *q).double()
                errs[f"int{bits} {dtype} {m}x{n}x{k}"] = ((got - want).abs().max() / want.abs().max()).item()
                got = kernels.dequantize(*q, torch.float32).double()
                errs[f"dequantize int{bits} {n}x{k}"] = (got - dequantize_torch(*q, torch.float64)).abs().max().item()
        # int4 and int8 tiles (no VNNI: the plain layout's product over the rows put back; 1-4 rows
        # of three or more groups read two groups at once where the tuning is Intel's)
        for bits in (4, 8):
            for m, n, k in [(1, 48, 96), (3, 64, 96), (4, 16, 576), (6, 32, 64), (20, 16, 160)]:
                w = torch.randn(n, k, generator=g)
                q = quantize_int4(w) if bits == 4 else (*quantize_int8(w), None)
                tiles = to_tiles(*q)
                x = torch.randn(m, k, generator=g).to(dtype)
                want = x.double() @ dequantize_torch(*q, torch.float64).T
                got = kernels.linear_tiles(x, tiles).double()
                errs[f"tiles{bits} {dtype} {m}x{n}x{k}"] = ((got - want).abs().max() / want.abs().max()).item()
                got = kernels.dequantize_tiles(tiles).double()
                errs[f"dequantize tiles{bits} {n}x{k}"] = (got - dequantize_torch(*q, torch.float64)).abs().max().item()
        if dtype == torch.bfloat16:  # packed bf16 (AMX tiles or the bf16 dot product, any rows; elsewhere
            # the row-major product), every row count of a pass of up to 8 and a pass's remainder
            for m, n, k in [(1, 32, 64), (2, 32, 576), (3, 64, 96), (5, 32, 64), (8, 96, 576), (9, 32, 576),
                            (16, 64, 96), (17, 32, 32), (40, 64, 1536)]:
                x, w, b = (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
                           torch.randn(n, generator=g).to(dtype))
                want = x.double() @ w.double().T + b.double()
                got = kernels.linear_packed_bf16(x, to_packed(w), b).double()
                errs[f"packed {dtype} {m}x{n}x{k}"] = ((got - want).abs().max() / want.abs().max()).item()
                errs[f"dequantize packed {n}x{k}"] = float((kernels.unpack_bf16(to_packed(w)) != w).sum())
        # head_dim 64 with 3 heads per KV head and 128 with 2 take the register-held path
        for block_size, head_dim, heads in [(1, 8, 6), (16, 24, 6), (64, 64, 6), (16, 128, 4), (16, 128, 8)]:
            bt = make_batch([(200, 200), (300, 1), (33, 9)], block_size, heads, 2, head_dim, dtype=dtype,
                            pad_tokens=2)
            kc, vc = bt.k_cache.clone(), bt.v_cache.clone()
            got = kernels.paged_attention(bt.q, kc, vc, bt.block_tables, bt.seq_lens, bt.query_start_loc, 0.3,
                                          k=bt.k, v=bt.v, slot_mapping=bt.slots)
            want = reference.paged_attention(bt.q, bt.k, bt.v, bt.k_cache, bt.v_cache, bt.slots, bt.block_tables,
                                             bt.seq_lens, bt.query_start_loc, 0.3)
            assert torch.equal(kc, bt.k_cache) and torch.equal(vc, bt.v_cache)
            err = (got.double() - want.double()).abs().max().item()
            errs[f"attention {dtype} bs{block_size} d{head_dim} h{heads}"] = err
    # greedy sampling (one pass per row slice; vocabularies over 16,384 split across threads)
    for n, v in [(1, 49152), (3, 40000), (2, 17), (5, 1000)]:
        logits = torch.randn(n, v, generator=g) * 4
        logits[0, v // 3] = logits[0].max() + 1
        logits[0, v - 1] = logits[0, v // 3]  # a tie: the first index wins, as in argmax
        z, zi = torch.zeros(n), torch.zeros(n, dtype=torch.long)
        tokens, logprobs = kernels.sample(logits, z, zi, z + 1, z, zi, zi)
        want = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1)[:, None])[:, 0]
        errs[f"greedy float32 tokens {n}x{v}"] = float((tokens != logits.argmax(-1)).sum())
        errs[f"greedy float32 logprobs {n}x{v}"] = ((logprobs - want).abs().max() / want.abs().max()).item()
    b = make_batch([(40, 40), (70, 1), (9, 3)], 16, 2, 2, 8, pad_tokens=2)
    got = kernels.slot_mapping(b.positions, b.token_req, b.block_tables, 16)
    want = reference.slot_mapping(b.positions, b.token_req, b.block_tables, 16)
    errs["slot_mapping float32"] = float((got != want).sum())
    print(json.dumps({"isa": kernels.NATIVE_ISA, "packs": kernels.NATIVE_PACKS_BF16, "errs": errs}))
""")


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            have = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return all(flag in have for flag in flags)


def run_check(env: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "env,isa",
    [
        ({"GRAPHRT_CPU_ISA": "vnni"}, "vnni"),  # without AMX tiles (where the CPU has them)
        ({"GRAPHRT_CPU_ISA": "avx512"}, "avx512"),  # without AMX tiles or the VNNI dot product
        ({"GRAPHRT_CPU_ISA": "avx2"}, "avx2"),
        ({"GRAPHRT_CPU_ISA": "portable"}, "portable"),
        ({"GRAPHRT_NATIVE": "0"}, None),
        ({}, "widest"),
        ({"GRAPHRT_CPU_TUNING": "amd"}, "widest"),  # each vendor's way of streaming weights
        ({"GRAPHRT_CPU_TUNING": "intel"}, "widest"),
    ],
)
def test_each_path_matches_the_reference(env, isa):
    result = run_check(env)
    if isa == "widest":
        assert result["isa"] in native_library.ISAS
        if _cpu_has("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"):  # bf16 products of 2-16 rows on tiles
            assert result["isa"] == "amx"
    elif isa == "vnni" and not _cpu_has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"):
        assert result["isa"] in ("avx512", "avx2", "portable")  # a set the CPU lacks is never chosen
    elif isa == "avx512" and not _cpu_has("avx512f", "avx512bw", "avx512vl", "avx512dq"):
        assert result["isa"] in ("avx2", "portable")
    else:
        assert result["isa"] == isa
    # bf16 matrices are multiplied packed on AMX tiles, or on the bf16 dot product where the set has it
    dot = result["isa"] in ("vnni", "avx512") and _cpu_has("avx512_bf16")
    assert result["packs"] == (result["isa"] == "amx" or dot)
    for name, err in result["errs"].items():
        tol = 1e-5 if "float32" in name or name.startswith("dequantize") else 3e-2
        quantized = re.match(r"int([48]) torch.float32 (\d+)x", name)
        tiled = re.match(r"tiles[48] torch.float32 (\d+)x", name)
        if tiled and result["isa"] in ("vnni", "amx") and int(tiled[1]) <= 16:
            tol = 1e-4  # the tiles' digits, as the VNNI dot product's below
        if quantized:
            bits, rows = int(quantized[1]), int(quantized[2])
            tiles = result["isa"] == "amx" and bits == 8 and 6 <= rows <= 8
            dot = rows <= (5 if result["isa"] == "amx" else 16 if result["isa"] == "vnni" else 0)
            if tiles or dot:
                # int8 tiles (6-8 rows) and the VNNI dot product (1-16 rows, 1-5 beside AMX)
                # carry each block of 32 activations as two int8 digits, within 2^-15 of its
                # largest (test_quantized.py bounds it per element); a lost digit is about 5e-3
                tol = 1e-4
        assert err <= tol, (name, err)


TILE_OUTPUTS = textwrap.dedent("""
    import sys, torch
    import graphrt.kernels as kernels
    from graphrt.kernels.quant_tiles import to_tiles
    from graphrt.kernels.quantized import quantize_int4, quantize_int8
    g = torch.Generator().manual_seed(0)
    out = {}
    for bits in (4, 8):
        for n, k in [(48, 96), (64, 1536)]:
            w = torch.randn(n, k, generator=g)
            tiles = to_tiles(*(quantize_int4(w) if bits == 4 else (*quantize_int8(w), None)))
            for m in range(1, 10):
                out[f"{bits} {n}x{k} {m}"] = kernels.linear_tiles(torch.randn(m, k, generator=g), tiles)
    torch.save({"isa": kernels.NATIVE_ISA, "out": out}, sys.argv[1])
""")


def test_the_amx_tiles_give_the_vector_kernels_outputs(tmp_path):
    # 5-8 activation rows over quantized tiles take AMX-INT8 where the CPU has it, and must give the
    # VNNI kernel's outputs bit for bit (the same integer sums, folded in the same order); a CPU
    # without AMX runs the vector kernel in both processes.
    import torch

    runs = {}
    for name, env in (("widest", {}), ("vnni", {"GRAPHRT_CPU_ISA": "vnni"})):
        path = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", TILE_OUTPUTS, str(path)], env={**os.environ, **env}, check=True)
        runs[name] = torch.load(path)
    if _cpu_has("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16"):
        assert runs["widest"]["isa"] == "amx" and runs["vnni"]["isa"] == "vnni"
    for key, got in runs["widest"]["out"].items():
        assert torch.equal(got, runs["vnni"]["out"][key]), key


@pytest.mark.parametrize("var,value", [("GRAPHRT_CPU_ISA", "sse9"), ("GRAPHRT_CPU_TUNING", "arm")])
def test_an_unknown_instruction_set_or_tuning_is_named(var, value):
    out = subprocess.run(
        [sys.executable, "-c", "import graphrt.kernels"],
        env={**os.environ, var: value},
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and f"{var}={value!r} is not known" in out.stderr


def test_the_build_is_cached_under_its_key(tmp_path, monkeypatch):
    # The compile itself is exercised wherever the sources change (every test above loads the
    # library, and a clean machine builds it on first use); here only where it lands and that it
    # happens once: a stand-in build writes the file (a real one took about a minute of the suite).
    builds = []

    def stand_in(folder):
        builds.append(folder)
        target = folder / native_library.LIBRARY
        target.write_bytes(b"built")
        return target

    monkeypatch.setenv("GRAPHRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_library, "build", stand_in)
    path = native_library.library_path()  # builds into the empty cache
    assert path.parent.parent == tmp_path / "native" and path.read_bytes() == b"built"
    assert native_library.library_path() == path and len(builds) == 1  # not rebuilt
    assert native_library.build_key() in str(path)
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "definitely-not-a-compiler")
    with pytest.raises(native_library.NativeBuildError):
        native_library.build(tmp_path)  # a missing compiler is an error the loader turns into a warning
