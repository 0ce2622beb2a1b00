import os
import sys

import pytest

from graphrt.cli import main


def test_console_script_is_installed():
    assert os.path.exists(os.path.join(os.path.dirname(sys.executable), "graphrt"))


def test_generate_prints_text_and_speed(tiny_tok_model, capsys):
    rc = main(
        [
            "generate",
            "--no-compile",
            "--model",
            tiny_tok_model,
            "--prompt",
            "Hello",
            "--prompt",
            "Bye",
            "--max-tokens",
            "5",
            "--kv-cache-memory",
            "4000000",
            "--verbose",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert "--- prompt 0: 'Hello'" in out and "--- prompt 1: 'Bye'" in out
    assert "tokens/s" in err and "stats:" in err


def test_generate_stream_and_chat(tiny_tok_model, capsys):
    rc = main(
        [
            "generate",
            "--no-compile",
            "--model",
            tiny_tok_model,
            "--prompt",
            "Hi",
            "--chat",
            "--stream",
            "--max-tokens",
            "4",
            "--temperature",
            "0.8",
            "--top-p",
            "0.9",
            "--seed",
            "3",
            "--kv-cache-memory",
            "4000000",
        ]
    )
    assert rc == 0
    assert "4 tokens" in capsys.readouterr().err


def test_generate_bad_model_is_one_clear_line(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "missing.gguf")])
    err = capsys.readouterr().err
    assert rc == 2 and "does not exist" in err and "Traceback" not in err


def test_generate_with_a_json_schema_file_and_choice(tiny_tok_model, tmp_path, capsys):
    import json

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    rc = main(
        [
            "generate",
            "--no-compile",
            "--model",
            tiny_tok_model,
            "--prompt",
            "Answer:",
            "--max-tokens",
            "20",
            "--kv-cache-memory",
            "4000000",
            "--json-schema",
            str(schema),
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and json.loads(out) in ({"ok": True}, {"ok": False})
    rc = main(
        [
            "generate",
            "--no-compile",
            "--model",
            tiny_tok_model,
            "--prompt",
            "Answer:",
            "--max-tokens",
            "5",
            "--kv-cache-memory",
            "4000000",
            "--choice",
            "yes",
            "--choice",
            "no",
        ]
    )
    assert rc == 0 and capsys.readouterr().out.strip().splitlines()[-1] in ("yes", "no")


def test_generate_with_a_lora_adapter(tiny_tok_model, tmp_path, capsys):
    from graphrt import LoRARequest, SamplingParams
    from tests.helpers import make_llm
    from tests.lora.adapters import make_adapter

    adapter = make_adapter(str(tmp_path), "llama_gqa", ("q_proj", "v_proj"), 4, 8, seed=7)
    argv = ["generate", "--no-compile", "--model", tiny_tok_model, "--prompt", "Hello", "--max-tokens", "6"]
    assert main([*argv, "--kv-cache-memory", "4000000", "--lora", f"mine={adapter}"]) == 0
    out = capsys.readouterr().out
    llm = make_llm(tiny_tok_model, enable_lora=True, kv_cache_memory=4_000_000)
    params = SamplingParams(max_tokens=6, temperature=0)
    want = llm.generate(["Hello"], params, lora_request=LoRARequest("mine", 1, adapter))[0].text
    assert want in out and want != llm.generate(["Hello"], params)[0].text
    with pytest.raises(SystemExit, match="--lora 'no-equals-sign' must be NAME=PATH"):
        main([*argv, "--lora", "no-equals-sign"])


@pytest.mark.parametrize("rounds", ["0", "-2"])
def test_bench_spec_rounds_must_be_positive(rounds, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "spec", "--rounds", rounds])
    assert exit_.value.code == 2
    assert f"--rounds: {rounds!r}: give a whole number of at least 1" in capsys.readouterr().err


def test_huge_pages_are_on_for_serve_and_the_decode_benchmark_and_off_for_generate():
    from graphrt.cli import build_parser
    from graphrt.cli.common import llm_kwargs

    parser = build_parser()
    assert llm_kwargs(parser.parse_args(["serve"]))["huge_pages"] is True
    assert llm_kwargs(parser.parse_args(["serve", "--no-huge-pages"]))["huge_pages"] is False
    assert llm_kwargs(parser.parse_args(["generate"]))["huge_pages"] is False
    assert llm_kwargs(parser.parse_args(["generate", "--huge-pages"]))["huge_pages"] is True
    assert parser.parse_args(["bench", "decode"]).huge_pages is True
    assert parser.parse_args(["bench", "decode", "--no-huge-pages"]).huge_pages is False


def test_serve_prefaults_the_kv_cache_only_when_asked():
    from graphrt.cli import build_parser
    from graphrt.cli.common import llm_kwargs

    parser = build_parser()
    assert llm_kwargs(parser.parse_args(["serve"]))["prefault_kv_cache"] is False
    assert llm_kwargs(parser.parse_args(["serve", "--prefault-kv-cache"]))["prefault_kv_cache"] is True
    assert llm_kwargs(parser.parse_args(["generate"]))["prefault_kv_cache"] is False  # serve's flag alone
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--prefault-kv-cache"])


def test_serve_starts_its_engine_on_a_thread_that_ends_and_keeps_its_errors():
    """graphrt serve builds the LLM off the main thread, so that start-up's OpenMP pool ends with
    that thread (the engine loop's thread then owns the only one)."""
    import threading

    from graphrt.cli.serve import on_a_thread_that_ends

    # Arrange
    seen = []

    def start():
        seen.append(threading.current_thread())
        return 42

    def bad():
        raise ValueError("model 'x' does not exist")

    # Act
    value = on_a_thread_that_ends(start)
    # Assert
    assert value == 42 and seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="model 'x' does not exist"):
        on_a_thread_that_ends(bad)
