// dilocox::rice_pack / rice_unpack - the CPU kernels of the sparse codec's Rice-coded index block (the format is
// in dilocox/compress/rice.py, whose vectorised torch ops `pack_torch`/`unpack_torch` and plain loops
// `reference_pack`/`reference_unpack` are these kernels' references; tests/test_compress_rice.py compares all three
// byte for byte, on valid rows and on damaged ones).
//
// One row per chunk: the k ascending indices i_j as the gaps d_1 = i_1, d_j = i_j - i_{j-1} - 1, each written as
// d >> b one-bits, a zero, then the b low bits of d (most significant first), bits LSB-first within each byte, the
// rest of the row zero. The torch ops decode the k codes of every row in lock step (k passes of gathers); here each
// row is one sequential scan, rows in parallel (at::parallel_for).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "rice_core.h"

namespace dilocox {

void rice_pack_cpu(const at::Tensor& idx, const at::Tensor& out, int64_t c, int64_t b) {
  TORCH_CHECK(idx.device().is_cpu() && out.device().is_cpu(), "rice_pack: CPU tensors");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.is_contiguous(), "rice_pack: idx (rows, k) int64");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.dim() == 2 && out.is_contiguous(), "rice_pack: out (rows, n) uint8");
  TORCH_CHECK(out.size(0) == idx.size(0) && b >= 0 && b < 32, "rice_pack: shapes or b");
  const int64_t rows = idx.size(0), k = idx.size(1), nbytes = out.size(1), width = 8 * nbytes;
  const int64_t* in = idx.data_ptr<int64_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  std::atomic<bool> bad{false};
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      uint8_t* row = o + r * nbytes;
      std::memset(row, 0, nbytes);
      int64_t pos = 0, prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t i = in[r * k + j], d = i - prev - 1;
        prev = i;
        if (d < 0 || i >= c || pos + (d >> b) + 1 + b > width) {  // not ascending, outside the chunk: refuse
          bad.store(true, std::memory_order_relaxed);
          break;
        }
        pos = put_rice(row, pos, d, static_cast<int>(b));
      }
    }
  });
  TORCH_CHECK(!bad.load(), "rice_pack: indices must be ascending and inside the chunk of ", c);
}

void rice_unpack_cpu(const at::Tensor& raw, const at::Tensor& idx, int64_t c, int64_t b) {
  TORCH_CHECK(raw.device().is_cpu() && idx.device().is_cpu(), "rice_unpack: CPU tensors");
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(), "rice_unpack: raw (rows, n) uint8");
  TORCH_CHECK(idx.scalar_type() == at::kLong && idx.dim() == 2 && idx.is_contiguous(), "rice_unpack: idx (rows, k) int64");
  TORCH_CHECK(idx.size(0) == raw.size(0) && b >= 0 && b < 63, "rice_unpack: shapes or b");
  (void)c;
  const int64_t rows = raw.size(0), k = idx.size(1), nbytes = raw.size(1), width = 8 * nbytes;
  const uint8_t* in = raw.data_ptr<uint8_t>();
  int64_t* o = idx.data_ptr<int64_t>();
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const uint8_t* row = in + r * nbytes;
      auto bit = [&](int64_t p) -> int64_t { return p < width ? (row[p >> 3] >> (p & 7)) & 1 : 0; };  // past: 0
      int64_t pos = 0, prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        int64_t q = 0;
        while (pos < width && bit(pos)) ++q, ++pos;
        ++pos;
        int64_t low = 0;
        for (int64_t t = 0; t < b; ++t, ++pos) low = (low << 1) | bit(pos);
        prev = prev + ((q << b) | low) + 1;
        o[r * k + j] = prev;
      }
    }
  });
}

}  // namespace dilocox
