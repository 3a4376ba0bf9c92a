// dilocox._C_cuda: CUDA kernels for the torch.ops.dilocox.* schemas defined in
// bindings.cpp (import dilocox._C first). Launches the torch-free cores of quant_cuda.cu
// on the current CUDA stream; no host synchronisation here (the non-finite count stays on
// the device until the caller reads it).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "quant_core.h"

namespace dilocox {
namespace {

void check_cuda_common(const at::Tensor& payload, int64_t n, int64_t group_size, int64_t bits,
                       const char* op) {
  TORCH_CHECK(bits == 4 || bits == 8, "dilocox::", op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 1, "dilocox::", op, ": group_size must be >= 1, got ", group_size);
  TORCH_CHECK(bits != 4 || group_size % 2 == 0, "dilocox::", op,
              ": int4 needs an even group_size, got ", group_size);
  TORCH_CHECK(payload.is_cuda(), "dilocox::", op, ": payload must be a CUDA tensor");
  TORCH_CHECK(payload.scalar_type() == at::kByte, "dilocox::", op, ": payload must be uint8, got ",
              payload.scalar_type());
  TORCH_CHECK(payload.is_contiguous(), "dilocox::", op, ": payload must be contiguous");
  TORCH_CHECK(payload.numel() == payload_bytes(n, group_size, static_cast<int>(bits)), "dilocox::", op,
              ": payload has ", payload.numel(), " bytes, expected ",
              payload_bytes(n, group_size, static_cast<int>(bits)));
}

void check_cuda_f32(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "dilocox::", op, ": ", what, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "dilocox::", op, ": ", what, " must be contiguous");
  TORCH_CHECK(t.device() == like.device(), "dilocox::", op, ": ", what, " is on ", t.device(),
              " but the payload is on ", like.device());
}

at::Tensor ef_quantize_pack_cuda(const at::Tensor& x, const std::optional<at::Tensor>& error,
                                 const at::Tensor& payload, int64_t group_size, int64_t bits,
                                 bool stochastic, int64_t seed, int64_t step) {
  const char* op = "ef_quantize_pack";
  check_cuda_f32(x, payload, "x", op);
  const int64_t n = x.numel();
  check_cuda_common(payload, n, group_size, bits, op);
  float* e = nullptr;
  if (error.has_value() && error->defined()) {
    check_cuda_f32(*error, payload, "error", op);
    TORCH_CHECK(error->numel() == n, "dilocox::", op, ": error has ", error->numel(),
                " elements, x has ", n);
    e = error->data_ptr<float>();
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor nbad = at::empty({}, x.options().dtype(at::kLong));
  const int err = cuda::ef_quantize_pack(
      x.data_ptr<float>(), e, payload.data_ptr<uint8_t>(), n, group_size, static_cast<int>(bits),
      stochastic, static_cast<uint64_t>(seed), static_cast<uint64_t>(step),
      reinterpret_cast<unsigned long long*>(nbad.data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == 0, "dilocox::", op, ": CUDA error: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
  return nbad;
}

void dequantize_into_cuda(const at::Tensor& payload, const at::Tensor& out, int64_t group_size,
                          int64_t bits, bool accumulate) {
  const char* op = "dequantize_into";
  check_cuda_f32(out, payload, "out", op);
  const int64_t n = out.numel();
  check_cuda_common(payload, n, group_size, bits, op);
  const c10::cuda::CUDAGuard guard(out.device());
  const int err = cuda::dequantize(payload.data_ptr<uint8_t>(), out.data_ptr<float>(), n, group_size,
                                   static_cast<int>(bits), accumulate,
                                   c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == 0, "dilocox::", op, ": CUDA error: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace
}  // namespace dilocox

TORCH_LIBRARY_IMPL(dilocox, CUDA, m) {
  m.impl("ef_quantize_pack", &dilocox::ef_quantize_pack_cuda);
  m.impl("dequantize_into", &dilocox::dequantize_into_cuda);
}

static PyModuleDef dilocox_c_cuda_module = {PyModuleDef_HEAD_INIT, "dilocox._C_cuda",
                                 "dilocox CUDA compression kernels (torch.ops.dilocox.*)", -1, nullptr, nullptr, nullptr, nullptr, nullptr};
PyMODINIT_FUNC PyInit__C_cuda(void) { return PyModule_Create(&dilocox_c_cuda_module); }
