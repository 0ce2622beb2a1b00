"""Stand-ins for TorchAir's native modules, so that its Python converter runs without an NPU.

TorchAir's ``import`` loads four extension modules that talk to CANN's graph engine. Converting
an FX graph into Ascend IR (a protobuf ``GraphDef`` built in Python) needs none of them; these
stand-ins answer the few calls the converter makes (version checks, the IR registry, engine
start-up) and refuse the ones that would need the hardware (loading or running a GE graph).

Nothing here is installed or used on a machine with ``torch_npu``: there the real modules load.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import types

import torch


class NoNPU(RuntimeError):
    """A call that needs an Ascend NPU and CANN reached a stand-in."""


def _refuse(what: str):
    def call(*args, **kwargs):
        raise NoNPU(f"{what} needs an Ascend NPU with CANN; this process converts graphs only")

    return call


class TorchDataType(enum.IntEnum):
    """The data-type enum TorchAir's ``llm_datadist`` reads at import."""

    BOOL = 0
    UINT8 = 1
    INT8 = 2
    INT16 = 3
    UINT16 = 4
    INT32 = 5
    UINT32 = 6
    INT64 = 7
    UINT64 = 8
    BF16 = 9
    FLOAT16 = 10
    FLOAT32 = 11
    FLOAT64 = 12
    COMPLEX64 = 13
    COMPLEX128 = 14


class TorchNpuGraphBase:
    """What a GE graph would be loaded into on an NPU: loading it is refused."""

    def __init__(self, name: str = "") -> None:
        self.name = name

    load = _refuse("loading a GE graph")
    compile = _refuse("compiling a GE graph")
    run = _refuse("running a GE graph")


def _torchair_module() -> types.ModuleType:
    m = types.ModuleType("torchair.core._torchair")
    m.TorchDataType = TorchDataType
    m.TorchNpuGraphBase = TorchNpuGraphBase
    m.check_cann_compat = lambda optype, inputs, attrs: ""  # "" = compatible
    # the IR registry of installed Ascend ops: unknown here, so custom GE ops are not pre-registered
    m.get_registered_ir_def = lambda op_type: ("ERROR", [], [], [])
    m.InitializeGraphEngine = lambda options: None
    m.FinalizeGraphEngine = lambda: None
    m.SetDebugLogPath = lambda path: None
    m.InitDeviceStdoutChannel = lambda device: None
    m.StupidRepeat = lambda word, times: word * times
    m.GetSocName = lambda: "none"
    m.export = _refuse("exporting an Ascend model")
    m.as_torch_tensors = _refuse("reading device tensors")
    for name in ("AclopStartDumpArgs", "AclopStopDumpArgs", "AclmdlSetDump"):
        setattr(m, name, _refuse(name))
    return m


def _plain(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def install() -> None:
    """Put the stand-ins in ``sys.modules`` (before TorchAir is imported). Idempotent."""
    modules = {
        "torchair.core._torchair": _torchair_module(),
        "torchair.core._npu_graph_executor": _plain("torchair.core._npu_graph_executor"),
        "torchair.core._abi_compat_ge_apis": _plain("torchair.core._abi_compat_ge_apis"),
        "torchair.core._npu_utils": _plain(
            "torchair.core._npu_utils", NpuFormatCastViaCpu=_refuse("casting weights to NPU formats")
        ),
    }
    for name, module in modules.items():
        sys.modules.setdefault(name, module)


class _Stream:
    """A stream that orders nothing: the replay is eager, on the CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _Conf:
    allow_hf32 = False


def _npu_namespace() -> types.SimpleNamespace:
    """What TorchAir's ACL path reads of ``torch.npu`` while it prepares a graph for an eager replay."""
    return types.SimpleNamespace(
        graph_pool_handle=lambda: (0, 0),
        current_device=lambda: 0,
        current_stream=lambda device=None: _Stream(),
        Stream=_Stream,
        Event=_Event,
        ExternalEvent=_Event,
        stream=lambda stream=None: contextlib.nullcontext(),
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        is_initialized=lambda: False,
        _get_deterministic_level=lambda: 0,
        matmul=_Conf(),
        conv=_Conf(),
        NPUGraph=_refuse("capturing an ACL graph"),
    )


@contextlib.contextmanager
def acl_replay_stand_ins():
    """``torch_npu`` and ``torch.npu`` stand-ins while TorchAir prepares a reduce-overhead graph for
    an eager replay (its ACL path imports torch_npu even then); removed again afterwards."""
    npu = _npu_namespace()
    module = types.ModuleType("torch_npu")
    module.npu = npu
    module.__spec__ = None
    had_torch_npu, had_npu = "torch_npu" in sys.modules, hasattr(torch, "npu")
    previous = sys.modules.get("torch_npu"), getattr(torch, "npu", None)
    sys.modules["torch_npu"] = module
    torch.npu = npu
    try:
        yield
    finally:
        if had_torch_npu:
            sys.modules["torch_npu"] = previous[0]
        else:
            sys.modules.pop("torch_npu", None)
        if had_npu:
            torch.npu = previous[1]
        else:
            del torch.npu
