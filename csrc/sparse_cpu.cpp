// dilocox::sparse_encode - the CPU kernel of compress.sparse's encoder (SparseLoCo-style chunked top-k with
// low-bit values; the rule and the byte format are in dilocox/compress/sparse.py, whose vectorised `encode`
// and plain-loop `reference_encode` are this kernel's references; tests/test_compress_sparse.py compares them
// byte for byte).
//
// Per chunk r of c elements (the tensor's tail zero-padded): the k entries of largest |e|, ties to the lower
// index (a radix select of the k-th largest |e| on its fp32 bits, 8 bits per pass, then one ascending scan that
// keeps every entry above it and the lowest-index entries equal to it); s = bf16(max|kept| / h),
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
    std::vector<uint32_t> key(static_cast<size_t>(c));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t base = r * c;
      const int64_t len = std::min(c, n - base);
      // |x| as its fp32 bits: for non-negative floats the integer order is the value order (NaN/inf are refused
      // by the caller); the zero padding of the last chunk is key 0
      uint32_t kmax = 0;
      for (int64_t j = 0; j < len; ++j) {
        key[j] = f32_bits(x[base + j]) & 0x7fffffffu;
        kmax = std::max(kmax, key[j]);
      }
      for (int64_t j = len; j < c; ++j) key[j] = 0;
      // radix select of the k-th largest key, 8 bits at a time from the top: T, and how many entries equal to T
      // are kept (the lowest-index ones: the tie rule of the reference)
      uint32_t prefix = 0, mask = 0;
      int64_t remaining = k;
      for (int shift = 24; shift >= 0; shift -= 8) {
        int64_t hist[256] = {0};
        for (int64_t j = 0; j < c; ++j)
          if ((key[j] & mask) == prefix) ++hist[(key[j] >> shift) & 0xffu];
        int b = 255;
        for (; b > 0 && hist[b] < remaining; --b) remaining -= hist[b];
        prefix |= static_cast<uint32_t>(b) << shift;
        mask |= 0xffu << shift;
      }
      const uint32_t T = prefix;
      const uint16_t sb = f32_to_bf16_bits(bits_f32(kmax) / h);
      const float s = bf16_bits_to_f32(sb);
      uint8_t* irow = p + r * ib_bytes;
      uint8_t* crow = codes_base + r * cb_bytes;
      int64_t taken = 0, eq = 0;
      for (int64_t j = 0; j < c && taken < k; ++j) {
        if (key[j] < T || (key[j] == T && eq++ >= remaining)) continue;
        const float v = j < len ? x[base + j] : 0.0f;
        uint32_t code = static_cast<uint32_t>(off);
        if (s > 0.0f) {
          const float q = std::floor(v / s + off);
          code = q <= 0.0f ? 0u : (q >= static_cast<float>(top) ? top : static_cast<uint32_t>(q));
        }
        put_bits(irow, taken, ib, static_cast<uint32_t>(j));
        put_bits(crow, taken, static_cast<int>(bits), code);
        ++taken;
      }
      scales[2 * r] = static_cast<uint8_t>(sb & 0xff);
      scales[2 * r + 1] = static_cast<uint8_t>(sb >> 8);
    }
  });
}

}  // namespace dilocox
