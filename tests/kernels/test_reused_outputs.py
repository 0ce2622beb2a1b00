"""The C entry points a package calls hand back a thread's earlier output when nothing holds it any
more (no malloc a call), and never one that something still holds: a kept result or a view of it.
Called here the way a package calls them: through ctypes, with tensor handles (an output never
becomes a Python tensor, which would hold it for good)."""

import ctypes
import os

import pytest
import torch

from graphrt.kernels import native_library

pytestmark = pytest.mark.skipif(native_library.load() is None, reason="the native kernels are not loaded")

_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_aoti = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))


@pytest.fixture(scope="module")
def lib():
    return ctypes.CDLL(str(native_library.library_path()))


def to_handle(t: torch.Tensor) -> ctypes.c_void_p:
    """A new handle (a new reference) to `t`."""
    return ctypes.c_void_p(_get_pointer(torch._C._aoti.unsafe_alloc_void_ptr_from_tensor(t), None))


def delete(h: ctypes.c_void_p) -> None:
    assert _aoti.aoti_torch_delete_tensor_object(h) == 0


def address(h: ctypes.c_void_p) -> int:
    ptr = ctypes.c_void_p()
    assert _aoti.aoti_torch_get_data_ptr(h, ctypes.byref(ptr)) == 0
    return ptr.value


def values(h: ctypes.c_void_p, shape) -> torch.Tensor:
    """A copy of a float32 output's values, read through its handle."""
    n = int(torch.Size(shape).numel())
    return torch.tensor(list((ctypes.c_float * n).from_address(address(h))), dtype=torch.float32).view(shape)


def view(h: ctypes.c_void_p, size: int) -> ctypes.c_void_p:
    """A handle to a 1-D view of the first `size` elements of h's storage."""
    sizes, strides, out = (ctypes.c_int64 * 1)(size), (ctypes.c_int64 * 1)(1), ctypes.c_void_p()
    assert _aoti.aoti_torch__reinterpret_tensor(h, ctypes.c_int64(1), sizes, strides, ctypes.c_int64(0),
                                                ctypes.byref(out)) == 0
    return out


def call(lib, name: str, *args) -> ctypes.c_void_p:
    """The entry point `name` over `args` (tensors become handles, None a null pointer, a float a
    double); returns the output's handle, which the caller deletes."""
    handles, c_args = [], []
    for a in args:
        if a is None:
            c_args.append(ctypes.c_void_p(None))
        elif isinstance(a, torch.Tensor):
            handles.append(to_handle(a))
            c_args.append(handles[-1])
        else:
            c_args.append(ctypes.c_double(a))
    ret = ctypes.c_void_p()
    assert getattr(lib, f"aoti_torch_cpu_{name}")(*c_args, ctypes.byref(ret)) == 0
    for h in handles:
        delete(h)
    return ret


def operands(seed: int, count: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 64, generator=g) for _ in range(count)], torch.randn(96, 64, generator=g)


def test_an_output_nothing_holds_is_reused_and_rewritten(lib):
    # arrange
    (x1, x2), w = operands(0, 2)
    first = call(lib, "linear", x1, w, None)
    first_address = address(first)
    delete(first)
    other = torch.empty(1, 96)  # would take a freed block of that size
    # act
    second = call(lib, "linear", x2, w, None)
    # assert
    assert address(second) == first_address != other.data_ptr()
    torch.testing.assert_close(values(second, (1, 96)), x2 @ w.T, rtol=1e-5, atol=1e-5)
    delete(second)


def test_a_held_output_or_a_view_of_it_is_never_overwritten(lib):
    # arrange: one output held, another dropped but for a view of it
    (x1, x2, x3), w = operands(1, 3)
    kept = call(lib, "linear", x1, w, None)
    viewed = call(lib, "linear", x2, w, None)
    part = view(viewed, 10)
    delete(viewed)
    # act
    third = call(lib, "linear", x3, w, None)
    # assert
    assert len({address(kept), address(part), address(third)}) == 3
    torch.testing.assert_close(values(kept, (1, 96)), x1 @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values(part, (10,)), (x2 @ w.T)[0, :10], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values(third, (1, 96)), x3 @ w.T, rtol=1e-5, atol=1e-5)
    for h in (kept, part, third):
        delete(h)


def test_the_dispatched_op_never_hands_out_a_kept_output(lib):
    # arrange: an output the entry points keep, free
    (x,), w = operands(2)
    free = call(lib, "linear", x, w, None)
    free_address = address(free)
    delete(free)
    # act
    dispatched = torch.ops.graphrt.linear(x, w, None)
    # assert
    assert dispatched.data_ptr() != free_address
    torch.testing.assert_close(dispatched, x @ w.T, rtol=1e-5, atol=1e-5)


def test_attention_through_its_entry_point_matches_the_op_call_after_call(lib):
    # arrange: one decode row at 20 keys, twice, the first output dropped in between
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 3, 8, 2, 64, generator=g).unbind(0)
    q = torch.randn(2, 1, 4, 64, generator=g)
    tables, lens, starts = torch.tensor([[2, 0, 1]]), torch.tensor([20]), torch.tensor([0, 1])
    want = [torch.ops.graphrt.paged_attention(q[i], None, None, k_cache, v_cache, None, tables, lens, starts, 0.125)
            for i in range(2)]
    # act
    got, addresses, others = [], [], []
    for i in range(2):
        out = call(lib, "paged_attention", q[i], None, None, k_cache, v_cache, None, tables, lens, starts, 0.125)
        got.append(values(out, (1, 4, 64)))
        addresses.append(address(out))
        delete(out)
        others.append(torch.empty(1, 4, 64))  # would take a freed block of that size
    # assert
    assert addresses[0] == addresses[1] != others[0].data_ptr()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_free_output_outlasts_many_held_ones(lib):
    # arrange: one free output kept, then more held outputs of another shape than the list keeps
    (x,), w = operands(5)
    free = call(lib, "linear", x, w, None)
    free_address = address(free)
    delete(free)
    held = [call(lib, "linear", x, w[:80], None) for _ in range(20)]
    # act
    again = call(lib, "linear", x, w, None)
    # assert
    assert address(again) == free_address
    torch.testing.assert_close(values(again, (1, 96)), x @ w.T, rtol=1e-5, atol=1e-5)
    for h in (*held, again):
        delete(h)
