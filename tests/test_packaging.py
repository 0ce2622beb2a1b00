"""The packaging metadata names every package folder, and the source hash covers the moved folders."""

import pathlib

import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_and_mapped():
    conf = _setuptools()
    mapping = conf["package-dir"]
    assert mapping == {"graphrt.kernels": "kernels", "graphrt.passes": "passes"}
    found = set()
    for init in ROOT.glob("graphrt/**/__init__.py"):
        found.add(".".join(init.parent.relative_to(ROOT).parts))
    for name, folder in mapping.items():
        for init in (ROOT / folder).glob("**/__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(ROOT / folder).parts]))
    assert found == set(conf["packages"])
    # a folder of .py files without __init__.py would be left out of a non-editable install
    for folder in [ROOT / "graphrt", ROOT / "kernels", ROOT / "passes"]:
        for sub in [folder, *[p for p in folder.rglob("*") if p.is_dir() and p.name != "__pycache__"]]:
            if any(sub.glob("*.py")):
                assert (sub / "__init__.py").exists(), sub


def test_an_installed_package_carries_the_native_sources():
    # a wheel holds only what package-data names beside the Python files: the native kernels are
    # compiled from these on first use, so each must be named
    import fnmatch

    patterns = _setuptools()["package-data"]["graphrt.kernels"]
    sources = [p.relative_to(ROOT / "kernels").as_posix() for p in (ROOT / "kernels" / "native").iterdir()]
    assert sources
    for name in sources:
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


def test_imports_resolve_to_the_top_level_folders():
    import graphrt.kernels
    import graphrt.passes

    assert pathlib.Path(graphrt.kernels.__file__).parent == ROOT / "kernels"
    assert pathlib.Path(graphrt.passes.__file__).parent == ROOT / "passes"


def test_source_hash_covers_kernels_and_passes(tmp_path, monkeypatch):
    from graphrt import version

    real = version.package_dirs()
    assert real["graphrt.kernels"] == ROOT / "kernels" and real["graphrt.passes"] == ROOT / "passes"
    # the same tree copied, then one pass edited: the hash changes
    import shutil

    dirs = {}
    for name, src in real.items():
        dirs[name] = tmp_path / name
        shutil.copytree(src, dirs[name], ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(version, "package_dirs", lambda: dirs)
    version.source_hash.cache_clear()
    try:
        before = version.source_hash()
        version.source_hash.cache_clear()
        assert version.source_hash() == before
        path = dirs["graphrt.passes"] / "fuse_attention.py"
        path.write_text(path.read_text() + "\n# edited\n")
        version.source_hash.cache_clear()
        edited_pass = version.source_hash()
        assert edited_pass != before
        path = dirs["graphrt.kernels"] / "attention.py"
        path.write_text(path.read_text() + "\n# edited\n")
        version.source_hash.cache_clear()
        edited_kernel = version.source_hash()
        assert edited_kernel not in (before, edited_pass)
        # the engine and the runtime below it are covered; the server, CLI, benchmarks and drafters are not
        edits = (("engine.py", True), ("server/app.py", False), ("cli/serve.py", False), ("spec/drafter.py", False))
        for rel, changes in edits:
            path = dirs["graphrt"] / rel
            path.write_text(path.read_text() + "\n# edited\n")
            version.source_hash.cache_clear()
            assert (version.source_hash() != edited_kernel) == changes, rel
            edited_kernel = version.source_hash()
    finally:
        version.source_hash.cache_clear()
