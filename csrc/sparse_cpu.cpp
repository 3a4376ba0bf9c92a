// dilocox::sparse_encode - the CPU kernel of compress.sparse's encoder (SparseLoCo-style chunked top-k with
// low-bit values; the rule and the byte format are in dilocox/compress/sparse.py, whose vectorised `encode`
// and plain-loop `reference_encode` are this kernel's references; tests/test_compress_sparse.py compares them
// byte for byte).
//
// Per chunk r of c elements (the tensor's tail zero-padded): the k entries of largest |e|, ties to the lower
// index (one pass builds |e|'s fp32 bits and their max; vectorized counts find a floor with at least k keys above
// it (candidate_floor); nth_element finds the k-th largest |e| exactly among those candidates; an ascending scan of
// the candidates keeps every entry above it and the lowest-index entries equal to it); s = bf16(max|kept| / h),
// h = (2^b - 1)/2, rounded to nearest even; code = clamp(floor(v / s + 2^(b-1)), 0, 2^b - 1) in fp32 (s = 0:
// code 2^(b-1)); indices (ceil(log2 c) bits each, or with rice_b >= 0 the Rice codes of their gaps with that
// parameter, as csrc/rice_cpu.cpp writes them) and codes (b bits) packed LSB-first, one byte-aligned row per
// chunk; the scales as little-endian bf16 after both blocks. Chunks run in parallel (at::parallel_for); the body is
// compiled for the baseline ISA, AVX2 and AVX-512 and picked at run time like the quantizer's (quant_cpu.cpp).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <vector>

#include "quant_core.h"
#include "rice_core.h"

namespace dilocox {

namespace {

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define DILOCOX_SPARSE_DISPATCH 1
#define DILOCOX_SPARSE_INLINE inline __attribute__((always_inline))
#else
#define DILOCOX_SPARSE_DISPATCH 0
#define DILOCOX_SPARSE_INLINE inline
#endif

int index_bits(int64_t c) {
  int b = 0;
  while ((int64_t{1} << b) < c) ++b;
  return std::max(1, b);
}

// v (< 2^nbits, nbits <= 32) as bits [j * nbits, (j + 1) * nbits) of row
inline void put_bits(uint8_t* row, int64_t j, int nbits, uint32_t v) { or_bits(row, j * nbits, v); }

struct Layout {
  const float* x;
  int64_t n, c, k;
  int bits, ib, rice_b;  // rice_b < 0: fixed-width indices of ib bits
  int64_t ib_bytes, cb_bytes;
  uint8_t *p, *codes_base, *scales;
};

DILOCOX_SPARSE_INLINE int32_t count_at_least(const int32_t* __restrict key, int64_t c, int32_t t) {
  int32_t cnt = 0;
  for (int64_t j = 0; j < c; ++j) cnt += key[j] >= t ? 1 : 0;
  return cnt;
}

// The candidates' floor: a key with at least k keys at or above it, and not many more. A ladder |max| * 2^(-i/2)
// (i = 1..8, then 2^-8 a step, in fp32; 0 when it reaches 0: every key is a candidate) finds the first rung with k,
// then three halvings of the key interval between it and the rung above (key order is value order) tighten it. Each
// step is one vectorized count over the chunk (from L1); on a Gaussian chunk the candidates are then about 1.1 k
// instead of 2-5 k, and the append and the exact selection below touch only those. (Keys are < 2^31: int32
// compares, which SSE2 has.)
DILOCOX_SPARSE_INLINE int32_t candidate_floor(const int32_t* __restrict key, int64_t c, int32_t kmax, int64_t k) {
  if (kmax >= 0x7f800000) return 0;  // inf/NaN (refused by the callers; here only a defined, finite answer)
  float f = bits_f32(static_cast<uint32_t>(kmax));
  int32_t hi = kmax;  // a key with fewer than k at or above it: none above kmax, so kmax + 1 works too
  if (count_at_least(key, c, kmax) >= k) return kmax;
  int32_t lo = 0;
  for (int i = 1; f > 0.0f; ++i) {
    f *= i <= 8 ? 0.70710678f : 0.00390625f;
    const int32_t t = static_cast<int32_t>(f32_bits(f));
    if (count_at_least(key, c, t) >= k) {
      lo = t;
      break;
    }
    hi = t;
  }
  for (int step = 0; step < 3 && hi - lo > 1; ++step) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (count_at_least(key, c, mid) >= k)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Chunks [begin, end) of the payload (see the top of this file); compiled per ISA below (runtime dispatch).
DILOCOX_SPARSE_INLINE void encode_rows(const Layout& L, int64_t begin, int64_t end) {
  const int64_t c = L.c, k = L.k;
  const float h = static_cast<float>((1 << L.bits) - 1) / 2.0f;
  const float off = static_cast<float>(1 << (L.bits - 1));
  const uint32_t top = (1u << L.bits) - 1u;
  std::vector<int32_t> key(static_cast<size_t>(c)), ckey(static_cast<size_t>(c) + 1), sel(static_cast<size_t>(c));
  std::vector<int64_t> cidx(static_cast<size_t>(c) + 1);  // (+1: the branchless append writes one slot ahead)
  int32_t* __restrict kp = key.data();
  for (int64_t r = begin; r < end; ++r) {
    const int64_t base = r * c;
    const int64_t len = std::min(c, L.n - base);
    const float* __restrict xr = L.x + base;
    // |x| as its fp32 bits: for non-negative floats the integer order is the value order (NaN/inf are refused by
    // the caller); the zero padding of the last chunk is key 0
    int32_t kmax = 0;
    for (int64_t j = 0; j < len; ++j) {
      const int32_t kj = static_cast<int32_t>(f32_bits(xr[j]) & 0x7fffffffu);
      kp[j] = kj;
      kmax = kj > kmax ? kj : kmax;
    }
    for (int64_t j = len; j < c; ++j) kp[j] = 0;
    const int32_t lo = candidate_floor(kp, c, kmax, k);
    int64_t m = 0;
    // candidates (key >= lo) in ascending index order: blocks of 32 with none are skipped by one vectorized test;
    // the others are appended without branches (a candidate's slot is written and kept, a non-candidate's overwritten)
    int64_t j0 = 0;
    for (; j0 + 32 <= c; j0 += 32) {
      int32_t mx = 0;  // (a max reduction: GCC turns an any-of into byte shuffles through the stack)
      for (int j = 0; j < 32; ++j) mx = kp[j0 + j] > mx ? kp[j0 + j] : mx;
      if (mx < lo) continue;
      for (int64_t j = j0; j < j0 + 32; ++j) {
        cidx[m] = j;
        ckey[m] = kp[j];
        m += kp[j] >= lo ? 1 : 0;
      }
    }
    for (int64_t j = j0; j < c; ++j) {
      cidx[m] = j;
      ckey[m] = kp[j];
      m += kp[j] >= lo ? 1 : 0;
    }
    // the k-th largest key T among the candidates, and how many entries equal to T are kept: the lowest-index ones
    std::copy(ckey.begin(), ckey.begin() + m, sel.begin());
    std::nth_element(sel.begin(), sel.begin() + (k - 1), sel.begin() + m, std::greater<int32_t>());
    const int32_t T = sel[k - 1];
    int64_t greater = 0;
    for (int64_t i = 0; i < m; ++i) greater += ckey[i] > T ? 1 : 0;
    const int64_t remaining = k - greater;
    const uint16_t sb = f32_to_bf16_bits(bits_f32(static_cast<uint32_t>(kmax)) / h);
    const float s = bf16_bits_to_f32(sb);
    uint8_t* irow = L.p + r * L.ib_bytes;
    uint8_t* crow = L.codes_base + r * L.cb_bytes;
    int64_t taken = 0, eq = 0, pos = 0, prev = -1;  // (kept in ascending index order: the Rice gaps are >= 0)
    for (int64_t i = 0; i < m && taken < k; ++i) {
      if (ckey[i] < T || (ckey[i] == T && eq++ >= remaining)) continue;
      const int64_t j = cidx[i];
      const float v = j < len ? xr[j] : 0.0f;
      uint32_t code = static_cast<uint32_t>(off);
      if (s > 0.0f) {
        const float q = std::floor(v / s + off);
        code = q <= 0.0f ? 0u : (q >= static_cast<float>(top) ? top : static_cast<uint32_t>(q));
      }
      if (L.rice_b >= 0)
        pos = put_rice(irow, pos, j - prev - 1, L.rice_b), prev = j;
      else
        put_bits(irow, taken, L.ib, static_cast<uint32_t>(j));
      put_bits(crow, taken, L.bits, code);
      ++taken;
    }
    L.scales[2 * r] = static_cast<uint8_t>(sb & 0xff);
    L.scales[2 * r + 1] = static_cast<uint8_t>(sb >> 8);
  }
}

void encode_rows_base(const Layout& L, int64_t b, int64_t e) { encode_rows(L, b, e); }
#if DILOCOX_SPARSE_DISPATCH
__attribute__((target("avx2"))) void encode_rows_avx2(const Layout& L, int64_t b, int64_t e) { encode_rows(L, b, e); }
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void encode_rows_avx512(const Layout& L, int64_t b,
                                                                                      int64_t e) {
  encode_rows(L, b, e);
}
#endif

}  // namespace

void sparse_encode_cpu(const at::Tensor& e, const at::Tensor& payload, int64_t chunk, int64_t k, int64_t bits,
                       int64_t rice_b) {
  TORCH_CHECK(e.scalar_type() == at::kFloat && e.is_contiguous(), "dilocox::sparse_encode: e must be contiguous fp32");
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.is_contiguous(),
              "dilocox::sparse_encode: payload must be contiguous uint8");
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "dilocox::sparse_encode: bits must be 2, 4 or 8, got ", bits);
  const int64_t n = e.numel();
  TORCH_CHECK(n > 0 && chunk >= 1 && chunk <= n && k >= 1 && k <= chunk && chunk < (int64_t{1} << 31),
              "dilocox::sparse_encode: need 1 <= k <= chunk <= numel and chunk < 2^31, got k=", k, " chunk=", chunk,
              " numel=", n);
  Layout L{};
  L.x = e.data_ptr<float>(), L.n = n, L.c = chunk, L.k = k, L.bits = static_cast<int>(bits);
  const int64_t n_c = (n + chunk - 1) / chunk;
  L.ib = index_bits(chunk);
  TORCH_CHECK(rice_b >= -1 && rice_b <= L.ib, "dilocox::sparse_encode: rice_b must be -1 (fixed) or in [0, ", L.ib,
              "], got ", rice_b);
  L.rice_b = static_cast<int>(rice_b);
  // a Rice row holds any k ascending indices: k (b + 1) + floor((c - k) / 2^b) bits (compress/rice.py)
  const int64_t ibits = rice_b >= 0 ? k * (rice_b + 1) + ((chunk - k) >> rice_b) : k * L.ib;
  L.ib_bytes = (ibits + 7) / 8, L.cb_bytes = (k * bits + 7) / 8;
  TORCH_CHECK(payload.numel() == n_c * (L.ib_bytes + L.cb_bytes + 2), "dilocox::sparse_encode: payload has ",
              payload.numel(), " bytes, expected ", n_c * (L.ib_bytes + L.cb_bytes + 2));
  L.p = payload.data_ptr<uint8_t>();
  std::memset(L.p, 0, static_cast<size_t>(payload.numel()));
  L.codes_base = L.p + n_c * L.ib_bytes;
  L.scales = L.p + n_c * (L.ib_bytes + L.cb_bytes);
  void (*fn)(const Layout&, int64_t, int64_t) = &encode_rows_base;
#if DILOCOX_SPARSE_DISPATCH
  const int isa = current_cpu_isa();  // the quantizer's choice (with its override, which the tests use)
  fn = isa == kIsaAvx512 ? &encode_rows_avx512 : isa == kIsaAvx2 ? &encode_rows_avx2 : &encode_rows_base;
#endif
  at::parallel_for(0, n_c, 1, [&](int64_t begin, int64_t end) { fn(L, begin, end); });
}

}  // namespace dilocox
