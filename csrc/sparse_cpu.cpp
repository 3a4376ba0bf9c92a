// dilocox::sparse_encode - the CPU kernel of compress.sparse's encoder (SparseLoCo-style chunked top-k with
// low-bit values; the rule and the byte format are in dilocox/compress/sparse.py, whose vectorised `encode`
// and plain-loop `reference_encode` are this kernel's references; tests/test_compress_sparse.py compares them
// byte for byte).
//
// Per chunk r of c elements (the tensor's tail zero-padded): the k entries of largest |e|, ties to the lower
// index (std::nth_element with that total order, then the k indices sorted ascending); s = bf16(max|kept| / h),
// h = (2^b - 1)/2, rounded to nearest even; code = clamp(floor(v / s + 2^(b-1)), 0, 2^b - 1) in fp32 (s = 0:
// code 2^(b-1)); indices (ceil(log2 c) bits) and codes (b bits) packed LSB-first, one byte-aligned row per
// chunk; the scales as little-endian bf16 after both blocks. Chunks run in parallel (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant_core.h"

namespace dilocox {

namespace {

int index_bits(int64_t c) {
  int b = 0;
  while ((int64_t{1} << b) < c) ++b;
  return std::max(1, b);
}

inline void put_bits(uint8_t* row, int64_t j, int nbits, uint32_t v) {
  int64_t pos = j * nbits;
  for (int t = 0; t < nbits; ++t, ++pos)
    if ((v >> t) & 1u) row[pos >> 3] |= static_cast<uint8_t>(1u << (pos & 7));
}

}  // namespace

void sparse_encode_cpu(const at::Tensor& e, const at::Tensor& payload, int64_t chunk, int64_t k, int64_t bits) {
  TORCH_CHECK(e.scalar_type() == at::kFloat && e.is_contiguous(), "dilocox::sparse_encode: e must be contiguous fp32");
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.is_contiguous(),
              "dilocox::sparse_encode: payload must be contiguous uint8");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "dilocox::sparse_encode: bits must be 2, 4 or 8, got ", bits);
  const int64_t n = e.numel();
  TORCH_CHECK(n > 0 && chunk >= 1 && chunk <= n && k >= 1 && k <= chunk,
              "dilocox::sparse_encode: need 1 <= k <= chunk <= numel, got k=", k, " chunk=", chunk, " numel=", n);
  const int64_t c = chunk, n_c = (n + c - 1) / c;
  const int ib = index_bits(c);
  const int64_t ib_bytes = (k * ib + 7) / 8, cb_bytes = (k * bits + 7) / 8;
  TORCH_CHECK(payload.numel() == n_c * (ib_bytes + cb_bytes + 2), "dilocox::sparse_encode: payload has ",
              payload.numel(), " bytes, expected ", n_c * (ib_bytes + cb_bytes + 2));
  const float* x = e.data_ptr<float>();
  uint8_t* p = payload.data_ptr<uint8_t>();
  std::memset(p, 0, static_cast<size_t>(payload.numel()));
  uint8_t* codes_base = p + n_c * ib_bytes;
  uint8_t* scales = p + n_c * (ib_bytes + cb_bytes);
  const float h = static_cast<float>((1 << bits) - 1) / 2.0f;
  const float off = static_cast<float>(1 << (bits - 1));
  const uint32_t top = (1u << bits) - 1u;
  at::parallel_for(0, n_c, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> idx(static_cast<size_t>(c));
    std::vector<float> mag(static_cast<size_t>(c));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * c;
      for (int64_t j = 0; j < c; ++j) {
        idx[j] = static_cast<int32_t>(j);
        mag[j] = base + j < n ? std::fabs(x[base + j]) : 0.0f;
      }
      auto before = [&](int32_t a, int32_t b) { return mag[a] > mag[b] || (mag[a] == mag[b] && a < b); };
      if (k < c) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), before);
      std::sort(idx.begin(), idx.begin() + k);
      float amax = 0.0f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, mag[idx[j]]);
      const uint16_t sb = f32_to_bf16_bits(amax / h);
      const float s = bf16_bits_to_f32(sb);
      uint8_t* irow = p + r * ib_bytes;
      uint8_t* crow = codes_base + r * cb_bytes;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t g = base + idx[j];
        const float v = g < n ? x[g] : 0.0f;
        uint32_t code = static_cast<uint32_t>(off);
        if (s > 0.0f) {
          const float q = std::floor(v / s + off);
          code = q <= 0.0f ? 0u : (q >= static_cast<float>(top) ? top : static_cast<uint32_t>(q));
        }
        put_bits(irow, j, ib, static_cast<uint32_t>(idx[j]));
        put_bits(crow, j, static_cast<int>(bits), code);
      }
      scales[2 * r] = static_cast<uint8_t>(sb & 0xff);
      scales[2 * r + 1] = static_cast<uint8_t>(sb >> 8);
    }
  });
}

}  // namespace dilocox
