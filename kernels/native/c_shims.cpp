// The C entry points an AOTInductor package calls for graphrt's native ops.
//
// Without them a package reaches a custom op through the proxy executor: each call rebuilds the
// op's argument list from the package's serialized call, boxes it onto a stack and dispatches
// (autograd fallback, then the CPU kernel) — about 5% of a batch-1 decode step's main thread,
// which makes about 150 such calls. A package built with these declared
// (kernels/native_library.py, AOTI_C_SHIMS) calls the op's function directly. Inductor names
// the entry point aoti_torch_cpu_<op> and passes a Tensor as a handle, a Tensor? as a pointer to
// one (null for None), a ScalarType as its int32 code, and a pointer for the result.
//
// The package resolves these symbols when it is loaded, from this library (loaded with
// RTLD_GLOBAL first). A failure is reported the way the shim layer reports one: the exception's
// message is kept and the call returns AOTI_TORCH_FAILURE, which the package raises.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <tuple>

#include "ops.h"

namespace {

const at::Tensor& tensor(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }

at::Tensor& mutable_tensor(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }

std::optional<at::Tensor> optional_tensor(AtenTensorHandle* h) {
  return torch::aot_inductor::pointer_to_optional<at::Tensor>(h);
}

AtenTensorHandle handle(at::Tensor&& t) { return torch::aot_inductor::new_tensor_handle(std::move(t)); }

// A profiler sees each call under the op's name, as it sees a dispatched one (no cost without one).
#define GRAPHRT_RECORD(op) RECORD_FUNCTION(op, c10::ArrayRef<const c10::IValue>{})

}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                     AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::linear");
  graphrt_native::ReusedOutputs reused;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret = handle(graphrt_native::linear(tensor(x), tensor(weight), optional_tensor(bias))); });
}

AOTITorchError aoti_torch_cpu_linear_quantized(AtenTensorHandle x, AtenTensorHandle qweight, AtenTensorHandle scales,
                                               AtenTensorHandle* mins, AtenTensorHandle* bias, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::linear_quantized");
  graphrt_native::ReusedOutputs reused;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret = handle(graphrt_native::linear_quantized(tensor(x), tensor(qweight), tensor(scales), optional_tensor(mins),
                                                   optional_tensor(bias)));
  });
}

AOTITorchError aoti_torch_cpu_dequantize(AtenTensorHandle qweight, AtenTensorHandle scales, AtenTensorHandle* mins,
                                         int32_t dtype, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::dequantize");
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret = handle(graphrt_native::dequantize(tensor(qweight), tensor(scales), optional_tensor(mins),
                                             static_cast<at::ScalarType>(dtype)));
  });
}

AOTITorchError aoti_torch_cpu_linear_tiles(AtenTensorHandle x, AtenTensorHandle tiles, AtenTensorHandle* bias,
                                           AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::linear_tiles");
  graphrt_native::ReusedOutputs reused;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret = handle(graphrt_native::linear_tiles(tensor(x), tensor(tiles), optional_tensor(bias))); });
}

AOTITorchError aoti_torch_cpu_dequantize_tiles(AtenTensorHandle tiles, int32_t dtype, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::dequantize_tiles");
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret = handle(graphrt_native::dequantize_tiles(tensor(tiles), static_cast<at::ScalarType>(dtype))); });
}

AOTITorchError aoti_torch_cpu_linear_packed_bf16(AtenTensorHandle x, AtenTensorHandle packed, AtenTensorHandle* bias,
                                                 AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::linear_packed_bf16");
  graphrt_native::ReusedOutputs reused;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { *ret = handle(graphrt_native::linear_packed_bf16(tensor(x), tensor(packed), optional_tensor(bias))); });
}

AOTITorchError aoti_torch_cpu_unpack_bf16(AtenTensorHandle packed, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::unpack_bf16");
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret = handle(graphrt_native::unpack_bf16(tensor(packed))); });
}

AOTITorchError aoti_torch_cpu_slot_mapping(AtenTensorHandle positions, AtenTensorHandle token_req,
                                           AtenTensorHandle block_tables, int64_t block_size, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::slot_mapping");
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret = handle(graphrt_native::slot_mapping(tensor(positions), tensor(token_req), tensor(block_tables), block_size));
  });
}

AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle* k, AtenTensorHandle* v,
                                              AtenTensorHandle k_cache, AtenTensorHandle v_cache,
                                              AtenTensorHandle* slot_mapping, AtenTensorHandle block_tables,
                                              AtenTensorHandle seq_lens, AtenTensorHandle query_start_loc,
                                              double scale, AtenTensorHandle* ret) {
  GRAPHRT_RECORD("graphrt::paged_attention");
  graphrt_native::ReusedOutputs reused;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *ret = handle(graphrt_native::paged_attention(tensor(q), optional_tensor(k), optional_tensor(v),
                                                  mutable_tensor(k_cache), mutable_tensor(v_cache),
                                                  optional_tensor(slot_mapping), tensor(block_tables),
                                                  tensor(seq_lens), tensor(query_start_loc), scale));
  });
}

// graphrt::sample: an all-greedy step with no grammar bit cleared (the usual one) is sampled
// here, as the op's body would first do; any other goes to that body (kernels/sampling.py)
// through the dispatcher.
AOTITorchError aoti_torch_cpu_sample(AtenTensorHandle logits, AtenTensorHandle temperature, AtenTensorHandle top_k,
                                     AtenTensorHandle top_p, AtenTensorHandle min_p, AtenTensorHandle seeds,
                                     AtenTensorHandle offsets, AtenTensorHandle* bitmask, AtenTensorHandle* tokens,
                                     AtenTensorHandle* logprobs) {
  GRAPHRT_RECORD("graphrt::sample");
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    const std::optional<at::Tensor> mask = optional_tensor(bitmask);
    at::Tensor t, l;
    {
      graphrt_native::ReusedOutputs reused;  // the greedy outputs only, not the body's
      std::tie(t, l) = graphrt_native::greedy_sample_plain(tensor(logits), tensor(temperature), mask);
    }
    if (t.size(0) != tensor(logits).size(0)) {
      static const auto body =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("graphrt::sample", "")
              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const std::optional<at::Tensor>&)>();
      std::tie(t, l) = body.call(tensor(logits), tensor(temperature), tensor(top_k), tensor(top_p), tensor(min_p),
                                 tensor(seeds), tensor(offsets), mask);
    }
    *tokens = handle(std::move(t));
    *logprobs = handle(std::move(l));
  });
}

}  // extern "C"
