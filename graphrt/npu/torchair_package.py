"""Where TorchAir comes from: ``torch_npu`` on an NPU machine, else its Python package alone.

On a machine with ``torch_npu`` and CANN, TorchAir is ``torch_npu.dynamo.torchair``. Elsewhere
graphrt can still convert its graphs to Ascend IR: TorchAir is pure Python apart from four native
modules, so ``fetch()`` takes its folder out of the pinned ``torch-npu`` wheel (never installing
``torch_npu``, whose import breaks ``import torch`` without CANN), and ``load()`` imports it with
stand-ins for those modules (``graphrt.npu.standins``). Such a TorchAir converts and replays
graphs on the CPU; compiling or running a GE graph needs the hardware and is refused.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
import zipfile

TORCH_NPU_VERSION = "2.13.0"  # the torch-npu release that pairs with torch 2.13.0
_WHEEL_PLATFORM = "manylinux_2_28_x86_64"  # any platform's wheel carries the same pure-Python torchair
_FOLDER_IN_WHEEL = "torch_npu/dynamo/torchair/"


class TorchAirUnavailable(RuntimeError):
    """Neither torch_npu nor an extracted TorchAir package is on this machine."""


def package_root() -> pathlib.Path:
    """The folder holding the extracted ``torchair`` package (inside the environment, by default)."""
    override = os.environ.get("GRAPHRT_TORCHAIR_DIR")
    if override:
        return pathlib.Path(override)
    return pathlib.Path(sys.prefix) / "share" / "graphrt" / f"torchair-{TORCH_NPU_VERSION}"


def has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def fetch(root: pathlib.Path | None = None, quiet: bool = False) -> pathlib.Path:
    """Download the torch-npu wheel (no install) and extract only its ``torchair`` folder into
    ``root``. Returns ``root``; does nothing when it is already there."""
    root = root or package_root()
    if (root / "torchair" / "__init__.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--platform", _WHEEL_PLATFORM,
            f"torch-npu=={TORCH_NPU_VERSION}", "-d", tmp,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(pathlib.Path(tmp).glob("torch_npu-*.whl"))
        if done.returncode != 0 or not wheels:
            raise TorchAirUnavailable(
                f"could not download torch-npu=={TORCH_NPU_VERSION} for its TorchAir package: "
                f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}"
            )
        staged = pathlib.Path(tmp) / "staged"
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith(_FOLDER_IN_WHEEL) and not name.endswith(".so"):
                    wheel.extract(name, staged)
        root.parent.mkdir(parents=True, exist_ok=True)
        target = pathlib.Path(tempfile.mkdtemp(dir=root.parent))
        shutil.move(str(staged / "torch_npu" / "dynamo" / "torchair"), str(target / "torchair"))
        try:
            target.rename(root)
        except OSError:  # another process extracted it first
            shutil.rmtree(target, ignore_errors=True)
    if not quiet:
        print(f"TorchAir {TORCH_NPU_VERSION} (from the torch-npu wheel) is in {root}")
    return root


_loaded: types.ModuleType | None = None


def load() -> types.ModuleType:
    """The ``torchair`` module: torch_npu's on an NPU machine, else the extracted package with
    the stand-ins. Raises TorchAirUnavailable naming the fix when there is neither."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if has_torch_npu():
        import torch_npu  # noqa: F401  (needs CANN; without it, importing torch_npu breaks torch)
        from torch_npu.dynamo import torchair

        _loaded = torchair
        return torchair
    root = package_root()
    if not (root / "torchair" / "__init__.py").exists():
        raise TorchAirUnavailable(
            f"TorchAir is not available: torch_npu is not installed and no TorchAir package is in {root}; "
            "run `python -m graphrt.npu.torchair_package` (part of `make setup-test`) to take it "
            "from the torch-npu wheel"
        )
    from graphrt.npu import standins

    standins.install()
    if str(root) not in sys.path:
        sys.path.append(str(root))
    main_thread = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    import torchair

    # TorchAir installs SIGINT/SIGTERM handlers that shut its graph engine down; there is none here
    for s, h in handlers.items():
        if main_thread and h is not None:
            signal.signal(s, h)
    _loaded = torchair
    return torchair


if __name__ == "__main__":
    fetch()
