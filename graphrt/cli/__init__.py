"""The ``graphrt`` command line: generate, precompile, bench, cache, serve."""

from __future__ import annotations

import argparse
import sys

from graphrt.cli import bench, cache, generate, precompile, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphrt", description="graphrt: a graph-compiled LLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    precompile.add_parser(sub)
    bench.add_parser(sub)
    cache.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        print(f"graphrt {args.command}: error: {e}", file=sys.stderr)
        return 2
