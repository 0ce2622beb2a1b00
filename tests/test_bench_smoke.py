"""Smoke tests of the benchmark harness on a tiny model: the JSON's fields, never its speed."""

import json

import pytest
import torch

from graphrt.bench.roofline import decode_step_bytes, measure_bandwidth, pages_name, read_buffer, streaming_reads
from graphrt.cli import main
from graphrt.runner.huge_pages import huge_pages_available, in_huge_page_block


def test_bench_decode_writes_its_fields(tiny_tok_model, tmp_path):
    out = tmp_path / "decode.json"
    plot = tmp_path / "decode.png"
    profile = tmp_path / "profile.txt"
    rc = main(
        [
            "bench",
            "decode",
            "--model",
            tiny_tok_model,
            "--batch-sizes",
            "2",
            "--prompt-len",
            "8",
            "--gen-len",
            "6",
            "--backend",
            "eager",
            "--json",
            str(out),
            "--plot",
            str(plot),
            "--profile",
            str(profile),
        ]
    )
    assert rc == 0 and plot.stat().st_size > 0 and "aten::" in profile.read_text()
    result = json.loads(out.read_text())
    assert {"machine", "bandwidth_gb_s", "rows", "capture"} <= set(result)
    assert result["kv_pages"] == "touched"  # steady state unless --fresh-kv-pages
    assert result["huge_pages"] is True and result["bandwidth_pages"] == pages_name(True)
    assert result["bandwidth_gb_s"] == max(result["bandwidth_reads_gb_s"].values())  # the faster read
    assert set(result["bandwidth_reads_gb_s"]) == {"sum", "product"}
    row = result["rows"][0]
    assert row["batch"] == 2 and row["same_tokens_as_transformers"] is True
    for engine in ("graphrt", "graphrt_eager", "transformers"):
        assert {"decode_tok_s", "step_ms_median", "step_ms_p90", "step_ms_max", "ttft_s"} <= set(row[engine])
    assert {"ratio_vs_transformers", "roofline_tok_s", "roofline_frac"} <= set(row)
    assert 0 <= row["graphrt"]["overhead_frac"] < 1
    for engine in ("graphrt", "graphrt_eager", "transformers"):  # None where the kernel reports no steal
        steal = row[engine]["steal_frac"]
        assert steal is None or 0 <= steal <= 1
    assert result["profile_shares"] and all(0 <= v < 1 for v in result["profile_shares"].values())
    assert result["machine"]["threads"] >= 1 and result["machine"]["torch"] and result["machine"]["cpu"]
    assert result["machine"]["quantized_layout"] in ("tiles", "plain")  # what a quantized engine holds here


def short_decode_bench(model: str, tmp_path, *flags: str) -> dict:
    """``graphrt bench decode`` at one row of 8 + 6 tokens, eager graphs, no transformers."""
    out = tmp_path / "decode.json"
    args = ["--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "6", "--backend", "eager", "--no-transformers"]
    assert main(["bench", "decode", "--model", model, *args, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bench_decode_over_a_bf16_kv_cache_counts_its_bytes(tiny_tok_model, tmp_path):
    result = short_decode_bench(tiny_tok_model, tmp_path, "--kv-cache-dtype", "bfloat16")
    assert result["kv_cache_dtype"] == "bfloat16"
    row = result["rows"][0]
    # the roofline's step reads the weights and each row's K/V in the cache's dtype
    assert row["roofline_tok_s"] > 0 and row["graphrt"]["decode_tok_s"] > 0

    class Cfg:
        num_layers, num_kv_heads, head_dim = 2, 1, 4

    model = torch.nn.Linear(4, 4, bias=False)
    kv16, kv32 = (decode_step_bytes(model, Cfg, 1, 10, d) - 64 for d in (torch.bfloat16, torch.float32))
    assert (kv16, kv32) == (2 * 2 * 4 * 2 * 10, 2 * 2 * 4 * 4 * 10)


def test_bench_grammar_reports_overhead(tiny_tok_model, tmp_path):
    out = tmp_path / "grammar.json"
    assert (
        main(["bench", "grammar", "--model", tiny_tok_model, "--batch", "2", "--no-compile", "--json", str(out)]) == 0
    )
    assert {"free_step_ms", "constrained_step_ms", "overhead_frac"} <= set(json.loads(out.read_text()))


def test_bench_kernels_reports_both_engines_against_the_bandwidth():
    from graphrt.bench.kernels import bench_kernels

    result = bench_kernels(["float32", "bfloat16"], [1, 3], shapes={"t": (40, 24)}, repeats=1, cold_bytes=1 << 16)
    assert len(result["rows"]) == 4 and result["pages"] == pages_name(True)
    for row in result["rows"]:
        assert row["bandwidth_gb_s"] > 0
        assert row["graphrt_gb_s"] > 0 and row["aten_gb_s"] > 0 and row["graphrt_frac"] > 0
        reads = row["bandwidth_reads_gb_s"]
        # each row's roofline is the mean of the faster read before and after it: at least each read's mean
        assert set(reads) == {"sum", "product"} and row["bandwidth_gb_s"] >= max(reads.values()) * (1 - 1e-9)
        assert row["graphrt_frac_sum"] == pytest.approx(row["graphrt_gb_s"] / reads["sum"])
        assert set(row["shapes"]["t"]) == {"graphrt", "aten"}
        assert row["steal_frac"] is None or 0 <= row["steal_frac"] <= 1


def test_bench_kernels_measures_quantized_matrices_in_the_engines_layout():
    import graphrt.kernels as kernels
    from graphrt.bench.kernels import _matrix, bench_kernels
    from graphrt.kernels import quant_tiles

    tiled = quant_tiles.wanted(kernels.NATIVE_ISA)
    assert len(_matrix(32, 64, "int4")) == (1 if tiled else 3) and len(_matrix(40, 64, "int8")) == 3  # 40: no tiles
    result = bench_kernels(["int4", "int8"], [1, 2], shapes={"t": (32, 64)}, repeats=1, cold_bytes=1 << 16)
    assert result["quantized_layout"] == ("tiles" if tiled else "the plain layouts")
    assert len(result["rows"]) == 4 and all(r["graphrt_gb_s"] > 0 and r["aten_gb_s"] > 0 for r in result["rows"])


def test_bench_spec_reports_speedup_acceptance_and_step_costs(tiny_tok_model, tmp_path):
    out = tmp_path / "spec.json"
    argv = ["bench", "spec", "--model", tiny_tok_model, "--batch-sizes", "1", "--ks", "2", "--gen-len", "8"]
    argv += ["--backend", "eager"]  # the bench's plumbing: graphs captured and replayed, no Inductor compile
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["prompts"], r["engine"]): r for r in data["results"]}
    assert set(rows) == {(p, e) for p in ("repetitive", "ordinary") for e in ("plain", "ngram k=2")}
    assert all(r["same_output"] and r["tokens_per_s"] > 0 for r in rows.values())
    assert 0 <= rows[("repetitive", "ngram k=2")]["acceptance"] <= 1
    assert data["verify_over_main"]["k=2 rows=1"] > 0


def test_bench_kernels_places_its_matrices_in_huge_pages():
    import torch

    from graphrt.bench.kernels import _matrix, _to_huge_pages

    weights = [_matrix(512, 576, "float32") for _ in range(3)] + [_matrix(512, 576, "int4") for _ in range(2)]
    before = [w.clone() for w in weights[:3]] + [tuple(t.clone() for t in w if t is not None) for w in weights[3:]]
    _to_huge_pages(weights)
    parts = [*weights[:3], *(t for w in weights[3:] for t in w if t is not None)]
    assert all(in_huge_page_block(t) == huge_pages_available() for t in parts)
    flat_before = [*before[:3], *(t for w in before[3:] for t in w)]
    assert all(torch.equal(a, b) for a, b in zip(parts, flat_before, strict=True))  # the same values, moved


def test_roofline_reads_the_pages_the_weights_sit_in():
    nbytes = 4 << 20
    huge = read_buffer(nbytes, True)
    assert huge.numel() * 4 == nbytes and bool((huge == 1).all())
    assert in_huge_page_block(huge) == huge_pages_available()
    assert pages_name(True) == ("2 MiB" if huge_pages_available() else "4 KiB") and pages_name(False) == "4 KiB"
    assert read_buffer(nbytes, True) is huge  # kept for the next measurement
    reads = streaming_reads(gib=nbytes / 2**30, repeats=2, huge_pages=True)
    assert set(reads) == {"sum", "product"} and min(reads.values()) > 0
    assert measure_bandwidth(gib=nbytes / 2**30, repeats=2, huge_pages=True) > 0
    small = read_buffer(nbytes, False)  # replaces it
    assert not in_huge_page_block(small) and bool((small == 1).all())
    assert measure_bandwidth(gib=nbytes / 2**30, repeats=2) > 0


def test_bench_roofline_prints_the_read_and_its_pages(tiny_tok_model, tmp_path, capsys):
    out = tmp_path / "roofline.json"
    argv = ["bench", "roofline", "--model", tiny_tok_model, "--batch-sizes", "1", "--prompt-len", "8"]
    assert main([*argv, "--gen-len", "4", "--backend", "eager", "--no-huge-pages", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["bandwidth_pages"] == "4 KiB" and result["huge_pages"] is False
    assert "transformers" not in result["rows"][0]  # the roofline run leaves transformers out
    assert f"(streaming read, {result['bandwidth_pages']} pages)" in capsys.readouterr().out


def test_bench_decode_runs_a_quantized_engine_over_its_bf16_cache(tiny_tok_model, tmp_path):
    result = short_decode_bench(tiny_tok_model, tmp_path, "--quantization", "int8")
    assert result["kv_cache_dtype"] == "float32"  # the float engine's: "auto" is the model's dtype
    q = result["rows"][0]["quantized"]["int8"]
    assert q["kv_cache_dtype"] == "bfloat16"  # "auto" under int8 weights
    assert q["roofline_tok_s"] > 0 and q["decode_tok_s"] > 0 and 0 <= q["same_tokens_as_fp32"] <= 1
