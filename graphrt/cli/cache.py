"""``graphrt cache ls | clear``: what the per-user cache holds, and emptying it."""

from __future__ import annotations

import argparse
import sys

from graphrt.user_cache import SECTIONS


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="see or empty the per-user cache (graphs, weights, kernels)")
    kinds = p.add_subparsers(dest="cache", required=True)
    ls = kinds.add_parser("ls", help="list the cache's sections with their sizes, and its graphs")
    ls.set_defaults(func=run_ls)
    clear = kinds.add_parser("clear", help="empty the cache (every section, or those named)")
    clear.add_argument("sections", nargs="*", metavar="SECTION", help="any of: " + ", ".join(SECTIONS))
    clear.set_defaults(func=run_clear)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def run_ls(args: argparse.Namespace) -> int:
    from graphrt.artifacts.cache_key import environment
    from graphrt.artifacts.store import ArtifactStore
    from graphrt.user_cache import cache_root, default_graph_cache_dir, usage

    print(f"graphrt cache: {cache_root()}")
    sections = usage()
    for s in sections:
        print(f"  {s.name:<10} {_size(s.bytes):>10} in {s.files:>4} file(s)  {s.what}")
    print(f"  {'total':<10} {_size(sum(s.bytes for s in sections)):>10}")
    entries = ArtifactStore(default_graph_cache_dir()).entries()
    if entries:
        now = environment()
        print("graphs (stale: built by another graphrt source, torch or compiler; `graphrt cache clear graphs`):")
        for e in sorted(entries, key=lambda e: (e["key"].get("graph", ""), e["file"])):
            key = e["key"]
            stale = any(key.get(k) != now[k] for k in ("graphrt_source", "torch", "compiler", "device"))
            dtype = key.get("model", {}).get("dtype", "?")
            state = "stale" if stale else "current"
            print(f"  {key.get('graph', '?'):<16} {_size(e.get('size', 0)):>10}  {dtype:<14} {state:<8} {e['file']}")
    return 0


def run_clear(args: argparse.Namespace) -> int:
    from graphrt.user_cache import clear

    freed = clear(args.sections or None)
    print(f"freed {_size(freed)} ({', '.join(args.sections or SECTIONS)})", file=sys.stderr)
    return 0
