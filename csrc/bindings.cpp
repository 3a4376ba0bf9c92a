// dilocox._C: thin torch bindings of the CPU quantization cores (quant_cpu.cpp).
// Registers the operator schemas of the `dilocox` namespace and their CPU kernels:
//
//   torch.ops.dilocox.ef_quantize_pack(x, error, payload, group_size, bits,
//                                      stochastic=False, seed=0, step=0) -> Tensor nbad
//       x: contiguous fp32 (any shape, read flat); error: None or fp32 like x, updated in
//       place (error feedback); payload: contiguous uint8 of payload_bytes(n, G, bits),
//       written. Returns a 0-dim int64 tensor (same device) = number of groups that
//       contained NaN/inf (those groups are not written); the caller raises on != 0.
//   torch.ops.dilocox.dequantize_into(payload, out, group_size, bits, accumulate) -> ()
//       out: contiguous fp32 with n elements; out = deq(payload) or out += deq(payload).
//   torch.ops.dilocox.sparse_encode(e, payload, chunk, k, bits, rice_b=-1) -> ()
//       compress.sparse's chunked top-k encoder (csrc/sparse_cpu.cpp; CPU only); rice_b >= 0: Rice-coded indices.
//   torch.ops.dilocox.rice_pack(idx, out, c, b) -> () / rice_unpack(raw, idx, c, b) -> ()
//       compress.sparse's Rice-coded index block of chunks of c, parameter b (csrc/rice_cpu.cpp; CPU only).
//   torch.ops.dilocox.select_cpu_isa(isa) -> int
//       -1: the best the CPU has (default); 0/1/2: force baseline/AVX2/AVX-512 (capped at what the CPU has) for
//       every CPU kernel above. Returns the ISA now in use. -2 / -3 only ask: the best ISA / the one in use.
//       For the tests, which compare every ISA's code path.
//
// CUDA kernels for the same schemas live in bindings_cuda.cpp (extension dilocox._C_cuda,
// which must be imported after this one).
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "quant_core.h"

namespace dilocox {
namespace {

void check_common(const at::Tensor& payload, int64_t n, int64_t group_size, int64_t bits,
                  const char* op) {
  TORCH_CHECK(bits == 4 || bits == 8, "dilocox::", op, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(group_size >= 1, "dilocox::", op, ": group_size must be >= 1, got ", group_size);
  TORCH_CHECK(bits != 4 || group_size % 2 == 0, "dilocox::", op,
              ": int4 needs an even group_size (groups must start on a byte), got ", group_size);
  TORCH_CHECK(payload.scalar_type() == at::kByte, "dilocox::", op, ": payload must be uint8, got ",
              payload.scalar_type());
  TORCH_CHECK(payload.is_contiguous(), "dilocox::", op, ": payload must be contiguous");
  TORCH_CHECK(payload.numel() == payload_bytes(n, group_size, static_cast<int>(bits)), "dilocox::", op,
              ": payload has ", payload.numel(), " bytes, expected ",
              payload_bytes(n, group_size, static_cast<int>(bits)), " for ", n, " int", bits,
              " elements with group_size ", group_size);
}

void check_f32(const at::Tensor& t, const at::Tensor& like, const char* what, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "dilocox::", op, ": ", what, " must be float32, got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "dilocox::", op, ": ", what, " must be contiguous");
  TORCH_CHECK(t.device() == like.device(), "dilocox::", op, ": ", what, " is on ", t.device(),
              " but the payload is on ", like.device());
}

at::Tensor ef_quantize_pack_cpu(const at::Tensor& x, const std::optional<at::Tensor>& error,
                                const at::Tensor& payload, int64_t group_size, int64_t bits,
                                bool stochastic, int64_t seed, int64_t step) {
  const char* op = "ef_quantize_pack";
  check_f32(x, payload, "x", op);
  const int64_t n = x.numel();
  check_common(payload, n, group_size, bits, op);
  float* e = nullptr;
  if (error.has_value() && error->defined()) {
    check_f32(*error, payload, "error", op);
    TORCH_CHECK(error->numel() == n, "dilocox::", op, ": error has ", error->numel(),
                " elements, x has ", n);
    e = error->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  uint8_t* p = payload.data_ptr<uint8_t>();
  const int nt = at::get_num_threads();
  const auto s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  int64_t nbad;
  if (bits == 4) {
    uint8_t* sc = p + packed_bytes_int4(n);
    nbad = stochastic ? ef_quantize_pack_sr_int4(xp, e, p, sc, n, group_size, s, t, nt)
                      : ef_quantize_pack_int4(xp, e, p, sc, n, group_size, nt);
  } else {
    int8_t* q = reinterpret_cast<int8_t*>(p);
    uint8_t* sc = p + n;
    nbad = stochastic ? ef_quantize_pack_sr_int8(xp, e, q, sc, n, group_size, s, t, nt)
                      : ef_quantize_pack_int8(xp, e, q, sc, n, group_size, nt);
  }
  return at::scalar_tensor(nbad, at::TensorOptions().dtype(at::kLong));
}

void dequantize_into_cpu(const at::Tensor& payload, const at::Tensor& out, int64_t group_size,
                         int64_t bits, bool accumulate) {
  const char* op = "dequantize_into";
  check_f32(out, payload, "out", op);
  const int64_t n = out.numel();
  check_common(payload, n, group_size, bits, op);
  const uint8_t* p = payload.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int nt = at::get_num_threads();
  if (bits == 4) {
    const uint8_t* sc = p + packed_bytes_int4(n);
    if (accumulate) dequantize_accumulate_int4(p, sc, o, n, group_size, nt);
    else dequantize_int4(p, sc, o, n, group_size, nt);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(p);
    const uint8_t* sc = p + n;
    if (accumulate) dequantize_accumulate_int8(q, sc, o, n, group_size, nt);
    else dequantize_int8(q, sc, o, n, group_size, nt);
  }
}

}  // namespace

void sparse_encode_cpu(const at::Tensor& e, const at::Tensor& payload, int64_t chunk, int64_t k, int64_t bits,
                       int64_t rice_b);
void rice_pack_cpu(const at::Tensor& idx, const at::Tensor& out, int64_t c, int64_t b);
void rice_unpack_cpu(const at::Tensor& raw, const at::Tensor& idx, int64_t c, int64_t b);

int64_t select_cpu_isa_op(int64_t isa) {
  if (isa == -2) return best_cpu_isa();     // queries: change nothing
  if (isa == -3) return current_cpu_isa();
  return select_cpu_isa(static_cast<int>(isa));
}

}  // namespace dilocox

TORCH_LIBRARY(dilocox, m) {
  m.def(
      "ef_quantize_pack(Tensor x, Tensor(a!)? error, Tensor(b!) payload, int group_size, int bits, "
      "bool stochastic=False, int seed=0, int step=0) -> Tensor");
  m.def("dequantize_into(Tensor payload, Tensor(a!) out, int group_size, int bits, bool accumulate) -> ()");
  m.def("sparse_encode(Tensor e, Tensor(a!) payload, int chunk, int k, int bits, int rice_b=-1) -> ()");
  m.def("rice_pack(Tensor idx, Tensor(a!) out, int c, int b) -> ()");
  m.def("rice_unpack(Tensor raw, Tensor(a!) idx, int c, int b) -> ()");
  m.def("select_cpu_isa(int isa) -> int", &dilocox::select_cpu_isa_op);  // no tensor: one kernel for all keys
}

TORCH_LIBRARY_IMPL(dilocox, CPU, m) {
  m.impl("ef_quantize_pack", &dilocox::ef_quantize_pack_cpu);
  m.impl("dequantize_into", &dilocox::dequantize_into_cpu);
  m.impl("sparse_encode", &dilocox::sparse_encode_cpu);
  m.impl("rice_pack", &dilocox::rice_pack_cpu);
  m.impl("rice_unpack", &dilocox::rice_unpack_cpu);
}

// Minimal Python module so that `import dilocox._C` loads the library (and thereby runs
// the registrations above); no Python-level functions - everything is in torch.ops.
static PyModuleDef dilocox_c_module = {PyModuleDef_HEAD_INIT, "dilocox._C",
                                 "dilocox CPU compression kernels (torch.ops.dilocox.*)", -1, nullptr, nullptr, nullptr, nullptr, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&dilocox_c_module); }
