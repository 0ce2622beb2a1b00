"""The weights cache: a GGUF checkpoint converted once into graphrt's layout, memory-mapped after.

Reading a GGUF means dequantising every tensor, un-permuting q/k and stacking q/k/v and gate/up:
seconds for a small model. The result (graphrt's parameter names, the engine's dtype) is written
once as safetensors beside the model config and the tokenizer, in an entry keyed by the
checkpoint's content hash, the dtype and the loader's own code; later starts map it instead.

Every file of an entry is listed with its SHA-256 (the weights in 64 MiB pieces, hashed on two
threads through the mapping the tensors then use); an entry whose files do not match is never
loaded: it is removed and rebuilt from the checkpoint. Entries are written to a temporary
directory and renamed into place, so concurrent processes publish one complete entry and never
read a partial one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import struct
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from graphrt.artifacts.store import sha256_file
from graphrt.models.config import ModelConfig

log = logging.getLogger("graphrt.loader")
FORMAT = 1
PIECE = 64 << 20  # bytes hashed per task
WEIGHTS = "model.safetensors"


@dataclass
class CachedWeights:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer_dir: str | None


def piece_hashes(path: str) -> list[str]:
    """SHA-256 of each PIECE of a file."""
    if os.path.getsize(path) == 0:
        return []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return buffer_piece_hashes(m)


def buffer_piece_hashes(buffer) -> list[str]:
    """SHA-256 of each PIECE of a buffer, two pieces at a time (hashlib releases the GIL)."""
    view = memoryview(buffer)
    try:
        with ThreadPoolExecutor(2) as pool:
            pieces = range(0, len(view), PIECE)
            return list(pool.map(lambda i: hashlib.sha256(view[i : i + PIECE]).hexdigest(), pieces))
    finally:
        view.release()


SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "U8": torch.uint8,
    "I8": torch.int8,
}


def map_safetensors(mapping: mmap.mmap) -> dict[str, torch.Tensor]:
    """Tensors over a mapped safetensors file (its layout: an 8-byte header length, a JSON header
    of dtypes, shapes and data offsets, then the data). The pages the hashing touched are already
    mapped in, so the first steps do not fault them in one by one."""
    (n,) = struct.unpack("<Q", mapping[:8])
    header = json.loads(mapping[8 : 8 + n])
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=end - start, offset=base + start)
        out[name] = raw.view(SAFETENSORS_DTYPES[info["dtype"]]).view(info["shape"])
    return out


@functools.lru_cache(maxsize=1)
def loader_code_hash() -> str:
    """The loader's source: a change to how checkpoints are converted retires old entries."""
    h = hashlib.sha256(f"format {FORMAT}".encode())
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class WeightsCache:
    def __init__(self, root: str) -> None:
        self.root = root

    def key(self, checkpoint: str, dtype: torch.dtype, quantization: str | None = None) -> str:
        parts = f"{sha256_file(checkpoint)}|{dtype}|{quantization}|{loader_code_hash()}"
        return hashlib.sha256(parts.encode()).hexdigest()[:32]

    def load(self, key: str) -> CachedWeights | None:
        """The entry's weights, mapped, once every file matches its hash; None if there is none
        (a damaged entry is removed, with a warning, for the caller to rebuild)."""
        entry = os.path.join(self.root, key)
        try:
            with open(os.path.join(entry, "entry.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return None
        weights = os.path.join(entry, WEIGHTS)
        try:
            with open(weights, "rb") as f:  # private and writable: tensors need no read-only flag
                mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            mapping = None
        problem = self._check(entry, meta, mapping)
        if problem is not None:
            log.warning("weights cache entry %s: %s; rebuilding it from the checkpoint", entry, problem)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        tokenizer = os.path.join(entry, "tokenizer") if meta.get("tokenizer") else None
        return CachedWeights(ModelConfig.from_dict(meta["config"]), map_safetensors(mapping), tokenizer)

    @staticmethod
    def _check(entry: str, meta: dict, mapping: mmap.mmap | None) -> str | None:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r} is not {FORMAT}"
        if mapping is None:
            return f"{WEIGHTS} cannot be mapped"
        for name, expected in meta["files"].items():
            path = os.path.join(entry, name)
            if not os.path.exists(path):
                return f"{name} is missing"
            if os.path.getsize(path) != expected["size"]:
                return f"{name} has {os.path.getsize(path)} bytes, not {expected['size']} (truncated?)"
            hashes = buffer_piece_hashes(mapping) if name == WEIGHTS else piece_hashes(path)
            if hashes != expected["sha256"]:
                return f"{name} does not match its SHA-256"
        return None

    def store(self, key: str, config: ModelConfig, state: dict[str, torch.Tensor], tokenizer=None) -> None:
        """Write an entry next to its final place and rename it there; a read-only or full disk
        only costs the next start its speed."""
        from safetensors.torch import save_file

        try:
            os.makedirs(self.root, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=self.root)
        except OSError as e:
            log.warning("weights cache %s is not writable (%s); the next start converts again", self.root, e)
            return
        try:
            save_file({k: t.contiguous() for k, t in state.items()}, os.path.join(tmp, WEIGHTS))
            files = [WEIGHTS]
            if tokenizer is not None:
                tokenizer.save_pretrained(os.path.join(tmp, "tokenizer"))
                files += [os.path.join("tokenizer", n) for n in sorted(os.listdir(os.path.join(tmp, "tokenizer")))]
            meta = {
                "format": FORMAT,
                "config": config.to_dict(),
                "tokenizer": tokenizer is not None,
                "files": {
                    n: {"size": os.path.getsize(os.path.join(tmp, n)), "sha256": piece_hashes(os.path.join(tmp, n))}
                    for n in files
                },
            }
            with open(os.path.join(tmp, "entry.json"), "w") as f:
                json.dump(meta, f, indent=1)
            os.rename(tmp, os.path.join(self.root, key))
        except OSError as e:  # another process published the entry first, or the disk is full
            if not os.path.exists(os.path.join(self.root, key, "entry.json")):
                log.warning("weights cache entry %s was not written (%s)", key, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
