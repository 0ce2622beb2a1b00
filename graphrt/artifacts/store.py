"""ArtifactStore: the on-disk graph cache a deployment ships.

Layout: ``DIR/manifest.json`` lists every artifact (``DIR/graphs/<id>.pt2``) with its key, its
SHA-256 and size, and how to call it. An entry's id is the hash of its key, so an edited key no
longer names its entry. Artifacts are written to a temporary file and renamed into place, and the
manifest is updated under a lock: concurrent writers leave one good entry and no torn file.
Nothing is loaded that the manifest does not vouch for: a missing, stale, truncated or tampered
artifact is rebuilt with a warning, or refused under ``strict=True``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import Any

from graphrt.artifacts.cache_key import entry_id

log = logging.getLogger("graphrt.artifacts")
MANIFEST_FORMAT = 1


class ArtifactError(RuntimeError):
    """A graph cache entry cannot be trusted (strict mode)."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class ArtifactStore:
    def __init__(self, root: str, strict: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.strict = strict
        self.rejected: list[str] = []  # why entries were not loaded, for reports and tests

    @property
    def manifest_path(self) -> str:
        return os.path.join(self.root, "manifest.json")

    def _problem(self, message: str) -> None:
        self.rejected.append(message)
        if self.strict:
            raise ArtifactError(f"graph cache {self.root}: {message} (strict mode refuses to rebuild)")
        log.warning("graph cache %s: %s; rebuilding", self.root, message)

    def read_manifest(self) -> dict[str, Any]:
        if not os.path.exists(self.manifest_path):
            return {"format": MANIFEST_FORMAT, "entries": {}}
        try:
            with open(self.manifest_path) as f:
                manifest = json.load(f)
            if manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("entries"), dict):
                raise ValueError(f"unknown manifest format {manifest.get('format')!r}")
            return manifest
        except (OSError, ValueError) as e:
            self._problem(f"manifest.json is unreadable ({e})")
            return {"format": MANIFEST_FORMAT, "entries": {}}

    def has(self, key: dict) -> bool:
        """Whether an entry of the right size is filed under this key (no hashing, no reports)."""
        entry = self.read_manifest()["entries"].get(entry_id(key))
        if entry is None or entry.get("key") != key:
            return False
        path = os.path.join(self.root, entry["file"])
        return os.path.exists(path) and os.path.getsize(path) == entry["size"]

    def explain_miss(self, key: dict) -> None:
        """Report why a key has no entry when entries for the same graph exist (a stale cache)."""
        stale = [e for e in self.entries() if e.get("key", {}).get("graph") == key.get("graph")]
        if stale:
            diff = sorted(k for k in key if stale[0].get("key", {}).get(k) != key[k])
            self._problem(f"no entry for graph {key.get('graph')}: cached entries differ in {diff}")

    def lookup(self, key: dict, quiet: bool = False) -> tuple[str, dict] | None:
        """The verified artifact path and its entry for this key, or None. ``quiet``: a key with
        no entry is not reported (a damaged entry always is)."""
        eid = entry_id(key)
        entries = self.read_manifest()["entries"]
        entry = entries.get(eid)
        if entry is None:
            if not quiet:
                self.explain_miss(key)
            return None
        if entry.get("key") != key:
            self._problem(f"entry {eid[:12]} does not hold the key it is filed under (edited manifest)")
            return None
        path = os.path.join(self.root, entry["file"])
        if not os.path.exists(path):
            self._problem(f"artifact {entry['file']} is missing")
            return None
        if not self._matches(path, entry):
            self._problem(f"artifact {entry['file']} does not match its SHA-256 (truncated or tampered)")
            return None
        return path, entry

    def entries(self) -> list[dict]:
        return list(self.read_manifest()["entries"].values())

    @contextlib.contextmanager
    def _locked(self):
        os.makedirs(os.path.join(self.root, "graphs"), exist_ok=True)
        with open(os.path.join(self.root, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _write_manifest(self, manifest: dict) -> None:
        """Replace the manifest atomically; call under the lock."""
        fd, tmp = tempfile.mkstemp(prefix=".manifest-", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, self.manifest_path)

    def reserve(self, key: dict) -> str:
        """A temporary file beside the artifacts for this key's build (``publish`` renames it)."""
        os.makedirs(os.path.join(self.root, "graphs"), exist_ok=True)
        fd, tmp = tempfile.mkstemp(
            prefix=f".{entry_id(key)[:12]}-", suffix=".pt2", dir=os.path.join(self.root, "graphs")
        )
        os.close(fd)
        return tmp

    def publish(self, key: dict, tmp: str, extra: dict) -> tuple[str, dict]:
        """Move a built artifact into place and file its entry, atomically under the lock.

        Where another process published the same key first and its file is intact, that file
        stays and this build is dropped: the other process may be loading it (two processes
        racing on an empty cache once failed with the loader reading an empty file, most likely
        the package replaced under it)."""
        eid = entry_id(key)
        rel = os.path.join("graphs", f"{eid}.pt2")
        dest = os.path.join(self.root, rel)
        try:
            entry = {"key": key, "file": rel, "sha256": sha256_file(tmp), "size": os.path.getsize(tmp), **extra}
            with self._locked():
                manifest = self.read_manifest()
                standing = manifest["entries"].get(eid)
                intact = standing is not None and os.path.exists(dest) and self._matches(dest, standing)
                if intact and standing.get("key") == key:
                    return dest, standing
                os.replace(tmp, dest)
                manifest["entries"][eid] = entry
                self._write_manifest(manifest)
        finally:
            self.discard(tmp)
        return dest, entry

    @staticmethod
    def _matches(path: str, entry: dict) -> bool:
        """Whether the file at ``path`` has the size and SHA-256 its entry filed."""
        return os.path.getsize(path) == entry.get("size") and sha256_file(path) == entry.get("sha256")

    @staticmethod
    def discard(tmp: str) -> None:
        if os.path.exists(tmp):
            os.remove(tmp)

    def put(self, key: dict, build: Callable[[str], None], extra: dict) -> tuple[str, dict]:
        """Build an artifact into a temporary file, then publish file and entry atomically."""
        tmp = self.reserve(key)
        try:
            build(tmp)
        except BaseException:
            self.discard(tmp)
            raise
        return self.publish(key, tmp, extra)

    # --- the serving settings a shipped cache was built with ------------------------------------

    def settings(self) -> dict | None:
        """The engine settings recorded by the build that filled this directory, if any."""
        return self.read_manifest().get("settings")

    def record_settings(self, settings: dict) -> None:
        with self._locked():
            manifest = self.read_manifest()
            manifest["settings"] = settings
            self._write_manifest(manifest)

    # --- housekeeping ---------------------------------------------------------------------------

    def size_bytes(self) -> int:
        return sum(e.get("size", 0) for e in self.entries())

    def clear(self) -> int:
        """Remove every entry and artifact; returns the bytes freed."""
        with self._locked():
            freed = 0
            graphs = os.path.join(self.root, "graphs")
            for name in os.listdir(graphs):
                if name.startswith("."):  # another process's artifact being written
                    continue
                path = os.path.join(graphs, name)
                freed += os.path.getsize(path)
                os.remove(path)
            self._write_manifest({"format": MANIFEST_FORMAT, "entries": {}})
        return freed
