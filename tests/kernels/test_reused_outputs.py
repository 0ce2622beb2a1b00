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


def sample(lib, logits: torch.Tensor, temperature: float):
    """The sample entry point over one greedy-or-not row set; returns (tokens, logprobs) handles."""
    handles = [to_handle(a) for a in (logits, *sample_args(logits.shape[0], temperature)[:-1])]
    tokens, logprobs = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.aoti_torch_cpu_sample(*handles, ctypes.c_void_p(None), ctypes.byref(tokens), ctypes.byref(logprobs)) == 0
    for h in handles:
        delete(h)
    return tokens, logprobs


def long_values(h: ctypes.c_void_p, n: int) -> list[int]:
    return list((ctypes.c_int64 * n).from_address(address(h)))


def test_greedy_samples_reuse_their_outputs_and_never_a_held_one(lib):
    # arrange: three steps' logits; the first step's outputs dropped, the second's held
    g = torch.Generator().manual_seed(6)
    logits = [torch.randn(2, 300, generator=g) for _ in range(3)]
    want = [torch.ops.graphrt.sample(x, *sample_args(2)) for x in logits]
    # act
    first = sample(lib, logits[0], 0.0)
    first_addresses = [address(h) for h in first]
    for h in first:
        delete(h)
    others = [torch.empty(2, dtype=torch.long), torch.empty(2)]  # would take freed blocks of those sizes
    second = sample(lib, logits[1], 0.0)
    third = sample(lib, logits[2], 0.0)
    # assert: the second step took the first's memory, the third did not take the held second's
    assert [address(h) for h in second] == first_addresses
    assert not {o.data_ptr() for o in others} & set(first_addresses)
    assert not {address(h) for h in third} & set(first_addresses)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip((second, third), want[1:]):
        assert long_values(tokens, 2) == want_tokens.tolist()
        torch.testing.assert_close(values(logprobs, (2,)), want_logprobs, rtol=0, atol=0)
    for h in (*second, *third):
        delete(h)


def test_a_random_sample_still_goes_to_the_body(lib):
    # a row with a temperature is not greedy: the op's own body samples it, from the same stream
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(7))
    tokens, logprobs = sample(lib, logits, 0.8)
    want_tokens, want_logprobs = torch.ops.graphrt.sample(logits, *sample_args(1, 0.8))
    assert long_values(tokens, 1) == want_tokens.tolist()
    torch.testing.assert_close(values(logprobs, (1,)), want_logprobs, rtol=0, atol=0)
    for h in (tokens, logprobs):
        delete(h)


def sample_args(r: int, temperature: float = 0.0):
    """The op's arguments after the logits: temperature, top_k, top_p, min_p, seeds, offsets, no
    bitmask."""
    zeros = torch.zeros(r, dtype=torch.long)
    return torch.full((r,), temperature), zeros, torch.ones(r), torch.zeros(r), zeros, zeros, None
