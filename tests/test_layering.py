"""The dependency direction kernels ← passes ← graphrt, checked on the imports themselves."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "graphrt"


def imported_modules(folder: str) -> set[str]:
    names = set()
    for path in (PKG / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return names


def test_kernels_import_nothing_else_of_graphrt():
    bad = {m for m in imported_modules("kernels") if m.startswith("graphrt") and not m.startswith("graphrt.kernels")}
    assert not bad, bad


def test_passes_never_import_the_runtime():
    allowed = ("graphrt.kernels", "graphrt.passes")
    bad = {m for m in imported_modules("passes") if m.startswith("graphrt") and not m.startswith(allowed)}
    assert not bad, bad


def test_no_module_torch_in_bookkeeping():
    assert not {m for m in imported_modules("core") if m.split(".")[0] in ("torch", "numpy")}
