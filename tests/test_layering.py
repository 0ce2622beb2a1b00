"""The dependency direction kernels ← passes ← graphrt, checked on the imports themselves, and
imports inside the runtime pointing one way: nothing below the engine imports the top of it."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = {"graphrt.kernels": ROOT / "kernels", "graphrt.passes": ROOT / "passes", "graphrt": ROOT / "graphrt"}
TOP = ("graphrt.llm", "graphrt.engine", "graphrt.engine_startup", "graphrt.cli", "graphrt.bench")


def imported_modules(folder: pathlib.Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                if node.module == "graphrt":  # `from graphrt import x` imports graphrt.x
                    names.update(f"graphrt.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return names


def _graphrt(names: set[str]) -> set[str]:
    return {m for m in names if m == "graphrt" or m.startswith("graphrt.")}


def test_the_layers_are_top_level_folders():
    for folder in FOLDERS.values():
        assert (folder / "__init__.py").is_file(), folder
    assert not (ROOT / "graphrt" / "kernels").exists() and not (ROOT / "graphrt" / "passes").exists()


def test_kernels_import_nothing_else_of_graphrt():
    bad = {m for m in _graphrt(imported_modules(FOLDERS["graphrt.kernels"])) if not m.startswith("graphrt.kernels")}
    assert not bad, bad


def test_passes_import_only_kernels_and_passes():
    allowed = ("graphrt.kernels", "graphrt.passes")
    bad = {m for m in _graphrt(imported_modules(FOLDERS["graphrt.passes"])) if not m.startswith(allowed)}
    assert not bad, bad


@pytest.mark.parametrize("layer", ["artifacts", "compiler", "core", "grammar", "loader", "models", "runner"])
def test_lower_runtime_layers_never_import_the_top(layer):
    names = _graphrt(imported_modules(ROOT / "graphrt" / layer))
    bad = {m for m in names if m == "graphrt" or m.startswith(TOP)}
    assert not bad, bad


def test_the_checker_sees_a_violation(tmp_path):
    (tmp_path / "a.py").write_text("import graphrt\nfrom graphrt import llm\nfrom graphrt.runner import x\n")
    assert _graphrt(imported_modules(tmp_path)) == {"graphrt", "graphrt.llm", "graphrt.runner"}


def test_no_module_torch_in_bookkeeping():
    assert not {m for m in imported_modules(ROOT / "graphrt" / "core") if m.split(".")[0] in ("torch", "numpy")}
