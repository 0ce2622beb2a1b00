"""``graphrt generate``: answer prompts and print the text and the speed."""

from __future__ import annotations

import argparse
import sys
import time

from graphrt.cli.common import add_model_args, llm_kwargs

DEFAULT_PROMPT = "What is the capital of France?"


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts")
    add_model_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help=f"a prompt (repeatable); default: {DEFAULT_PROMPT!r} with the chat template",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--stream", action="store_true", help="print text as it is produced")
    p.add_argument("--json-schema", default=None, help="a JSON schema file: the output must validate")
    p.add_argument("--regex", default=None, help="the output must match this regular expression")
    p.add_argument("--choice", action="append", default=None, help="the output is one of these (repeatable)")
    p.add_argument("--grammar-backend", default="in-graph", choices=["in-graph", "xgrammar-cpu"])
    p.add_argument("--lora", default=None, metavar="NAME=PATH", help="generate with this PEFT LoRA adapter")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from graphrt.llm import LLM
    from graphrt.runner.graph_cache import CaptureSizes
    from graphrt.sampling_params import SamplingParams

    prompts = args.prompt or [DEFAULT_PROMPT]
    chat = args.chat or args.prompt is None
    kwargs = llm_kwargs(args)
    kwargs["grammar_backend"] = args.grammar_backend
    lora = parse_lora(args.lora) if args.lora else None
    if lora is not None:
        kwargs.update(enable_lora=True, max_loras=1)
    # One-shot generation needs two graphs: the prefill at the token budget and the decode of
    # this many prompts (each cold compile costs tens of seconds on a small CPU; the per-user
    # graph cache keeps them for the next run).
    if not args.graph_cache:  # a shipped graph cache brings its own sizes
        kwargs["max_num_batched_tokens"] = kwargs["max_num_batched_tokens"] or 128
        num_seqs = kwargs["max_num_seqs"] or 8
        kwargs["capture_sizes"] = CaptureSizes(
            decode=(min(num_seqs, len(prompts)),), mixed=(kwargs["max_num_batched_tokens"],)
        )
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    schema = None
    if args.json_schema:
        with open(args.json_schema) as f:
            schema = f.read()
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed if args.temperature > 0 else None,
        json_schema=schema,
        regex=args.regex,
        choice=args.choice,
    )
    t1 = time.perf_counter()
    first_token_s = None
    texts, tokens = [""] * len(prompts), [[] for _ in prompts]
    for ev in llm.generate_stream(prompts, params, chat=chat, lora_request=lora):
        if first_token_s is None and ev.token_ids:
            first_token_s = time.perf_counter() - t1
        tokens[ev.index].extend(ev.token_ids)
        texts[ev.index] += ev.text
        if args.stream:
            prefix = f"[{ev.index}] " if len(prompts) > 1 else ""
            sys.stdout.write(f"{prefix}{ev.text}" if ev.text else "")
            if ev.finish_reason:
                sys.stdout.write("\n")
            sys.stdout.flush()
    if not args.stream:
        for i, text in enumerate(texts):
            if len(prompts) > 1:
                print(f"--- prompt {i}: {prompts[i]!r}")
            print(text if llm.tokenizer is not None else tokens[i])
    gen_s = time.perf_counter() - t1
    num_tokens = sum(len(t) for t in tokens)
    print(summary(llm, num_tokens, gen_s, start_s, first_token_s or 0.0), file=sys.stderr)
    if args.verbose:
        for rec in llm.capture_report():
            print(
                f"[graphrt] graph {rec.key.name}: {rec.how}, ready after {rec.seconds:.1f} s",
                file=sys.stderr,
            )
        for line in llm.pass_report():
            print(f"[graphrt] passes {line}", file=sys.stderr)
        print(f"[graphrt] stats: {llm.stats()}", file=sys.stderr)
    return 0


def summary(llm, num_tokens: int, gen_s: float, start_s: float, first_token_s: float) -> str:
    """One line: speed, then where the start-up went."""
    hows = [r.how for r in llm.capture_report()]
    t = llm.engine.startup_seconds
    graphs = f"{hows.count('loaded')} loaded, {hows.count('compiled')} compiled"
    line = (
        f"[graphrt] {num_tokens} tokens at {num_tokens / max(gen_s, 1e-9):.1f} tokens/s | start-up {start_s:.1f} s: "
        f"load {t['load']:.1f} s, graphs {t['graphs']:.1f} s ({graphs}), first token {first_token_s:.2f} s"
    )
    stats = llm.stats()
    if stats["spec_draft_tokens"]:
        line += (
            f" | drafts accepted {stats['spec_accepted_tokens']}/{stats['spec_draft_tokens']}, "
            f"{stats['spec_mean_accepted_length']:.2f} tokens a verified row"
        )
    return line


def parse_lora(text: str, lora_id: int = 1):
    """``--lora NAME=PATH`` → a LoRARequest with id ``lora_id``."""
    from graphrt.lora.request import LoRARequest

    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"graphrt: --lora {text!r} must be NAME=PATH (a PEFT adapter directory)")
    return LoRARequest(name, lora_id, path)
