// dilocox: CPU cores of the int4/int8 group quantizer with fused error feedback.
// See quant_core.h for the format (DiLoCoX int4 pseudo-gradient compression; error
// feedback as in CocktailSGD). One pass over memory: each group is read twice while it
// sits in L1 (absmax, then quantize), x/e are read once from DRAM and e/packed/scales
// are written once. OpenMP-parallel over groups; results do not depend on the thread
// count (each group is independent and written by exactly one thread).
//
// Build with -O3 -ffp-contract=off (no FMA contraction: e = v - s*q must round the
// product first, exactly like the two separate torch ops of the reference).
#include "quant_core.h"

#include <algorithm>
#include <atomic>
#include <cmath>

#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define DILOCOX_X86_DISPATCH 1
// (GCC 12 warns inside its own headers about the undefined vectors that the _mm512_reduce_* and narrowing
// intrinsics start from: a false positive; silenced for these headers only)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#define DILOCOX_X86_DISPATCH 0
#endif
// Bodies are force-inlined into the per-ISA range kernels so that they get vectorized
// with that kernel's target ISA.
#if defined(__GNUC__) || defined(__clang__)
#define DILOCOX_INLINE inline __attribute__((always_inline))
#else
#define DILOCOX_INLINE inline
#endif

namespace dilocox {
namespace {

constexpr int64_t kChunk = 64;  // elements quantized per inner (vectorizable) loop
// 1.5 * 2^23: (y + M) - M == rint(y) (round-half-even, default FP environment) for
// |y| < 2^22 without needing SSE4.1 roundps. Always yields +0.0 for a zero result.
constexpr float kRoundMagic = 12582912.0f;

inline int resolve_threads(int num_threads) {
#ifdef _OPENMP
  return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
  (void)num_threads;
  return 1;
#endif
}

// Threads only pay off once there is enough work (fork/join costs a few microseconds).
inline bool worth_parallel(int64_t n) { return n >= (int64_t(1) << 15); }

inline void store_scale(uint8_t* scales, int64_t g, uint16_t bits) {
  scales[2 * g] = static_cast<uint8_t>(bits & 0xff);
  scales[2 * g + 1] = static_cast<uint8_t>(bits >> 8);
}

inline float load_scale(const uint8_t* scales, int64_t g) {
  const uint16_t bits = static_cast<uint16_t>(scales[2 * g] | (uint16_t(scales[2 * g + 1]) << 8));
  return bf16_bits_to_f32(bits);
}

// Pass 1 of a group: absmax of v = x + e, plus a NaN/inf detector: v - v is +0 for finite v and NaN otherwise, so
// OR-ing its bits (a cheap integer reduction) is non-zero iff some v is bad. N > 0: the group has exactly N elements
// (a constant trip count: no alias checks, peeling or epilogue, which cost as much as the work at N = 128).
template <bool EF, int N>
DILOCOX_INLINE float group_absmax(const float* __restrict x, const float* __restrict e, int64_t len, uint32_t& chk) {
  const int64_t n = N > 0 ? N : len;
  float amax = 0.0f;
  uint32_t bad = 0;
#pragma omp simd reduction(max : amax) reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) {
    const float v = EF ? x[j] + e[j] : x[j];
    const float a = std::fabs(v);
    amax = a > amax ? a : amax;
    bad |= f32_bits(v - v);
  }
  chk = bad;
  return amax;
}

// One chunk of M (> 0: exactly M, else m) elements of a group with scale s > 0: the codes, packed to `pc`, and the
// residual. A constant trip count (full chunks) lets the loops vectorize without alias checks, peeling or epilogue.
template <int LEVELS, bool SR, bool EF, int M>
DILOCOX_INLINE void quant_chunk(const float* __restrict xc, float* __restrict ec, int64_t m_dyn, float s,
                                uint64_t sr_base, uint64_t i0, uint8_t* __restrict pc) {
  const int64_t m = M > 0 ? M : m_dyn;
  const float lo = -static_cast<float>(LEVELS), hi = static_cast<float>(LEVELS);
  alignas(64) int8_t q8[kChunk];
  alignas(64) float rbuf[kChunk];
  alignas(64) float ubuf[SR ? kChunk : 1];
  if (SR) {  // the hash in its own (integer-only) loop so both loops vectorize
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) ubuf[j] = sr_uniform(sr_base, i0 + static_cast<uint64_t>(j));
  }
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) {
    const float v = EF ? xc[j] + ec[j] : xc[j];
    float y = v / s;  // true IEEE division, like the reference's tensor division
    float r;
    if (SR) {
      y = y + ubuf[j];
      y = std::min(std::max(y, lo), hi);  // clamp first: floor is monotone, bounds integral
      const float t = (y + kRoundMagic) - kRoundMagic;  // rint(y) ...
      r = t > y ? t - 1.0f : t;                          // ... -> floor(y)
    } else {
      y = std::min(std::max(y, lo), hi);
      r = (y + kRoundMagic) - kRoundMagic;  // rint, half to even
    }
    rbuf[j] = r;
    if (EF) ec[j] = v - s * r;  // s*r exact (8-bit x 7-bit mantissas), then one rounding
  }
  // (the narrowing in its own loop: mixed with the fp32 work above, the vectorizer picks int8's 64 lanes per step
  // and spends more on unpacking than the conversion costs; measured 20 % slower)
#pragma omp simd
  for (int64_t j = 0; j < m; ++j) q8[j] = static_cast<int8_t>(static_cast<int32_t>(rbuf[j]));
  if (LEVELS == 7) {
    const int64_t pairs = m / 2;  // (the chunk starts on an even element: a byte boundary)
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    // two int8 codes as one little-endian 16-bit word: low nibble from its low byte, high from its high byte
    uint16_t w16[kChunk / 2];
    std::memcpy(w16, q8, static_cast<size_t>(2 * pairs));
#pragma omp simd
    for (int64_t k = 0; k < pairs; ++k) pc[k] = static_cast<uint8_t>((w16[k] & 0x0fu) | ((w16[k] >> 4) & 0xf0u));
#else
    for (int64_t k = 0; k < pairs; ++k) pc[k] = static_cast<uint8_t>((q8[2 * k] & 15) | ((q8[2 * k + 1] & 15) << 4));
#endif
    if (m & 1) pc[pairs] = static_cast<uint8_t>(q8[m - 1] & 15);  // odd tail: high nibble 0
  } else {
    std::memcpy(pc, q8, static_cast<size_t>(m));
  }
}

// Quantize one group [x, x+len) (element offset `start` in the tensor); N > 0: len == N. LEVELS = 7 (int4) or 127
// (int8). Writes the packed bytes of the group to `out`, its scale to scales[g] and (EF) the new residual to e.
// Returns false, writing nothing, if v has a NaN/inf.
template <int LEVELS, bool SR, bool EF, int N>
DILOCOX_INLINE bool quantize_group(const float* __restrict x, float* __restrict e, int64_t len,
                                   int64_t start, uint64_t sr_base, uint8_t* __restrict out,
                                   uint8_t* scales, int64_t g) {
  uint32_t chk = 0;
  const float amax = group_absmax<EF, N>(x, e, len, chk);
  if (chk != 0) return false;

  const uint16_t sbits = f32_to_bf16_bits(amax / static_cast<float>(LEVELS));
  const float s = bf16_bits_to_f32(sbits);
  store_scale(scales, g, sbits);
  if (!(s > 0.0f)) {  // all-zero group (or absmax/L underflows bf16): q = 0, residual keeps v
    if (EF)
      for (int64_t j = 0; j < len; ++j) e[j] = x[j] + e[j];
    std::memset(out, 0, static_cast<size_t>(LEVELS == 7 ? (len + 1) / 2 : len));
    return true;
  }
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int64_t m = std::min<int64_t>(kChunk, len - c0);
    uint8_t* pc = out + (LEVELS == 7 ? c0 / 2 : c0);  // c0 and the group start are even
    const uint64_t i0 = static_cast<uint64_t>(start + c0);
    if (m == kChunk)
      quant_chunk<LEVELS, SR, EF, kChunk>(x + c0, EF ? e + c0 : nullptr, m, s, sr_base, i0, pc);
    else
      quant_chunk<LEVELS, SR, EF, 0>(x + c0, EF ? e + c0 : nullptr, m, s, sr_base, i0, pc);
  }
  return true;
}

#if DILOCOX_X86_DISPATCH
#define DILOCOX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
constexpr int64_t kBlock = 16;  // groups of 128 per block of the AVX-512 path (16 KB of x and e: in L1)

// v = x + e of 16 floats
template <bool EF>
DILOCOX_AVX512 inline __m512 load_v16(const float* x, const float* e) {
  return EF ? _mm512_add_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(e)) : _mm512_loadu_ps(x);
}

// A block of nb <= kBlock full groups of 128 (round to nearest) with AVX-512 intrinsics: the same IEEE ops in the same
// order as quantize_group (v = x + e, absmax, s = bf16(absmax / L), y = v / s, clamp, rint by the magic constant,
// e = v - s*r; s*r is exact: a bf16 times an integer <= 127), so the bits are identical. Two passes over the block
// instead of two per group: the scales of all its groups first (independent chains, so the absmax reduction, the
// division and the bf16 rounding of one group overlap with the next instead of stalling the quantize pass, which
// the per-group version did), then the codes, packed in registers: for int4 the 16 int32 codes of a register become
// 8 bytes (lane 2k+1's nibble shifted onto lane 2k inside each 64-bit lane, then one vpmovqb). Returns false, writing
// nothing, if the block holds a NaN/inf (the caller redoes it group by group to flag the bad groups).
template <int LEVELS, bool EF>
DILOCOX_AVX512 bool quantize_block128_avx512(const float* __restrict x, float* __restrict e, uint8_t* __restrict out,
                                             uint8_t* scales, int64_t g0, int64_t nb, bool more) {
  const __m512i absm = _mm512_set1_epi32(0x7fffffff);
  __m512i bad = _mm512_setzero_si512();
  float sv[kBlock];
  // phase 2 computes from L1 only; it prefetches the next block (if this thread has one) so that memory keeps
  // streaming meanwhile (without it the two phases serialize memory and compute: 16M elements took 30 % longer)
  const float* pf = nb == kBlock && more ? x + 128 * kBlock : nullptr;
  const float* pfe = pf && EF ? e + 128 * kBlock : nullptr;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 128 * b;
    const float* eb = EF ? e + 128 * b : nullptr;
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      const __m512 v = load_v16<EF>(xb + 16 * i, EF ? eb + 16 * i : nullptr);
      amax = _mm512_max_ps(amax, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), absm)));
      bad = _mm512_or_si512(bad, _mm512_castps_si512(_mm512_sub_ps(v, v)));  // +0 unless v is NaN/inf
    }
    sv[b] = _mm512_reduce_max_ps(amax);
  }
  if (_mm512_test_epi32_mask(bad, bad) != 0) return false;
  const __m512 lo = _mm512_set1_ps(-static_cast<float>(LEVELS)), hi = _mm512_set1_ps(static_cast<float>(LEVELS)),
               magic = _mm512_set1_ps(kRoundMagic);
  const __m512i nib = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 128 * b;
    float* eb = EF ? e + 128 * b : nullptr;
    uint8_t* ob = out + (LEVELS == 7 ? 64 : 128) * b;
    const uint16_t sbits = f32_to_bf16_bits(sv[b] / static_cast<float>(LEVELS));
    const float s = bf16_bits_to_f32(sbits);
    store_scale(scales, g0 + b, sbits);
    if (!(s > 0.0f)) {  // all-zero group (or absmax/L underflows bf16): q = 0, residual keeps v
      for (int i = 0; i < 8 && EF; ++i) _mm512_storeu_ps(eb + 16 * i, load_v16<EF>(xb + 16 * i, eb + 16 * i));
      std::memset(ob, 0, LEVELS == 7 ? 64 : 128);
      continue;
    }
    const __m512 vs = _mm512_set1_ps(s);
    // A normal scale needs no clamp: s = bf16(fl(absmax / L)) >= absmax / L / (1 + 2^-8) (half a bf16 ulp; the
    // absolute error of a subnormal fl(absmax / L) adds at most 2^-24 relative to s >= 2^-126), so |v / s| <= 7.03
    // (int4) or 127.497 (int8), below L + 0.5: rint gives the clamped value's code and residual exactly. A subnormal
    // bf16 scale can be off by a third (tests/test_kernels.py::test_cpu_kernel_at_the_absmax_of_a_rounded_down_scale).
    const bool clamp = (sbits & 0x7f80) == 0;
    for (int i = 0; i < 8; ++i) {
      if (pf) {  // the next block's lines, one of x (and e) per register of this one
        _mm_prefetch(reinterpret_cast<const char*>(pf + 128 * b + 16 * i), _MM_HINT_T0);
        if (EF) _mm_prefetch(reinterpret_cast<const char*>(pfe + 128 * b + 16 * i), _MM_HINT_T0);
      }
      const __m512 v = load_v16<EF>(xb + 16 * i, EF ? eb + 16 * i : nullptr);
      __m512 y = _mm512_div_ps(v, vs);
      if (clamp) y = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
      const __m512 r = _mm512_sub_ps(_mm512_add_ps(y, magic), magic);
      if (EF) _mm512_storeu_ps(eb + 16 * i, _mm512_sub_ps(v, _mm512_mul_ps(vs, r)));
      const __m512i q = _mm512_cvtps_epi32(r);  // integral already: exact
      if (LEVELS == 7) {
        const __m512i t = _mm512_and_si512(q, nib);
        const __m512i w = _mm512_or_si512(t, _mm512_srli_epi64(t, 28));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(ob + 8 * i), _mm512_cvtepi64_epi8(w));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ob + 16 * i), _mm512_cvtepi32_epi8(q));
      }
    }
  }
  return true;
}
#endif

// Group bodies for the other two ops, written once and instantiated per ISA below.
template <bool ACC>
DILOCOX_INLINE void dequant_int4_group(const uint8_t* __restrict pg, float s, float* __restrict og,
                                       int64_t len) {
  const int64_t pairs = len / 2;
#pragma omp simd
  for (int64_t k = 0; k < pairs; ++k) {
    const int32_t b = pg[k];
    const float q0 = static_cast<float>(((b & 15) ^ 8) - 8);  // sign-extend the nibbles
    const float q1 = static_cast<float>(((b >> 4) ^ 8) - 8);
    og[2 * k] = ACC ? og[2 * k] + s * q0 : s * q0;
    og[2 * k + 1] = ACC ? og[2 * k + 1] + s * q1 : s * q1;
  }
  if (len & 1) {
    const float q0 = static_cast<float>(((pg[pairs] & 15) ^ 8) - 8);
    og[len - 1] = ACC ? og[len - 1] + s * q0 : s * q0;
  }
}

template <bool ACC>
DILOCOX_INLINE void dequant_int8_group(const int8_t* __restrict qg, float s, float* __restrict og,
                                       int64_t len) {
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) {
    const float d = s * static_cast<float>(qg[j]);
    og[j] = ACC ? og[j] + d : d;
  }
}

struct Args {
  const float* x;
  float* e;
  uint8_t* out;          // packed int4 / int8 bytes
  const uint8_t* in;     // same, for dequantize
  uint8_t* scales;       // 2 bytes per group, little-endian bf16
  float* dst;            // dequantize output
  int64_t n, G;
  uint64_t sr_base;
};

// Serial kernels over a range of groups [g0, g1). The same source is compiled for the
// baseline ISA and, on x86 with GCC/Clang, for AVX2 and AVX-512 via function-level
// target attributes (runtime dispatch, no -march: the binary still runs on any x86-64).
// All variants are bit-identical: only exact IEEE ops, no FMA (-ffp-contract=off).
#define DILOCOX_RANGE_KERNELS(SUF, ATTR, FAST128)                                                 \
  template <int LEVELS, bool SR, bool EF>                                                         \
  ATTR int64_t quant_range_##SUF(const Args& a, int64_t g0, int64_t g1) {                         \
    int64_t bad = 0;                                                                              \
    for (int64_t g = g0; g < g1; ++g) {                                                           \
      const int64_t st = g * a.G, len = std::min(a.G, a.n - st);                                  \
      float* eg = EF ? a.e + st : nullptr;                                                        \
      uint8_t* og = a.out + (LEVELS == 7 ? st / 2 : st);                                          \
      if (FAST128(LEVELS, SR, EF, a.G) && len == 128) { /* a run of full groups: blocks of kBlock */      \
        const int64_t nb = std::min({kBlock, g1 - g, (a.n - st) / 128});                          \
        const bool more = (g + 2 * nb <= g1) && (a.n - st) / 128 >= 2 * nb; /* a full next block */  \
        if (quantize_block128_avx512<LEVELS, EF>(a.x + st, eg, og, a.scales, g, nb, more)) {     \
          g += nb - 1;                                                                            \
          continue;                                                                               \
        }                                                                                         \
        const int64_t gend = g + nb; /* a NaN/inf in the block: group by group, as below */       \
        for (; g < gend; ++g) {                                                                   \
          const int64_t s2 = g * a.G;                                                             \
          bad += quantize_group<LEVELS, SR, EF, 128>(a.x + s2, EF ? a.e + s2 : nullptr, 128, s2,  \
                                                      a.sr_base, a.out + (LEVELS == 7 ? s2 / 2 : s2), \
                                                      a.scales, g) ? 0 : 1;                       \
        }                                                                                         \
        --g;                                                                                      \
        continue;                                                                                 \
      }                                                                                           \
      const bool ok = len == 128                                                                  \
          ? quantize_group<LEVELS, SR, EF, 128>(a.x + st, eg, len, st, a.sr_base, og, a.scales, g) \
          : quantize_group<LEVELS, SR, EF, 0>(a.x + st, eg, len, st, a.sr_base, og, a.scales, g);  \
      bad += ok ? 0 : 1;                                                                          \
    }                                                                                             \
    return bad;                                                                                   \
  }                                                                                               \
  template <int BITS, bool ACC>                                                                   \
  ATTR int64_t deq_range_##SUF(const Args& a, int64_t g0, int64_t g1) {                           \
    for (int64_t g = g0; g < g1; ++g) {                                                           \
      const int64_t st = g * a.G, len = std::min(a.G, a.n - st);                                  \
      const float s = load_scale(a.scales, g);                                                    \
      if (BITS == 4)                                                                              \
        dequant_int4_group<ACC>(a.in + st / 2, s, a.dst + st, len);                               \
      else                                                                                        \
        dequant_int8_group<ACC>(reinterpret_cast<const int8_t*>(a.in) + st, s, a.dst + st, len);  \
    }                                                                                             \
    return 0;                                                                                     \
  }

// Which runs take the hand-vectorized AVX-512 blocks: group size 128, round to nearest (the stochastic variant,
// other group sizes and a short last group keep the autovectorized body).
#define DILOCOX_NO_FAST(L, SR, EF, LEN) false
#define DILOCOX_FAST_AVX512(L, SR, EF, G) (!(SR) && (G) == 128)
#if !DILOCOX_X86_DISPATCH
constexpr int64_t kBlock = 16;
template <int LEVELS, bool EF>  // never called (no AVX-512 path off x86)
bool quantize_block128_avx512(const float*, float*, uint8_t*, uint8_t*, int64_t, int64_t, bool) { return false; }
#endif
DILOCOX_RANGE_KERNELS(base, , DILOCOX_NO_FAST)
#if DILOCOX_X86_DISPATCH
DILOCOX_RANGE_KERNELS(avx2, __attribute__((target("avx2"))), DILOCOX_NO_FAST)
DILOCOX_RANGE_KERNELS(avx512, DILOCOX_AVX512, DILOCOX_FAST_AVX512)
#endif

using RangeFn = int64_t (*)(const Args&, int64_t, int64_t);

int detect_isa() {
#if DILOCOX_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kIsaAvx512;
  if (__builtin_cpu_supports("avx2")) return kIsaAvx2;
#endif
  return kIsaBaseline;
}

std::atomic<int> g_isa_override{-1};

int active_isa() {
  static const int detected = detect_isa();
  const int o = g_isa_override.load(std::memory_order_relaxed);
  return (o >= 0 && o <= detected) ? o : detected;
}

#if DILOCOX_X86_DISPATCH
#define DILOCOX_PICK(NAME, ...)                                  \
  (active_isa() == kIsaAvx512 ? &NAME##_avx512<__VA_ARGS__>      \
   : active_isa() == kIsaAvx2 ? &NAME##_avx2<__VA_ARGS__>        \
                              : &NAME##_base<__VA_ARGS__>)
#else
#define DILOCOX_PICK(NAME, ...) (&NAME##_base<__VA_ARGS__>)
#endif

// Static partition of the groups over threads; each group is touched by one thread, so
// the result is independent of the thread count.
int64_t run_groups(RangeFn fn, const Args& a, int num_threads) {
  if (a.n <= 0) return 0;
  const int64_t ng = num_groups(a.n, a.G);
  const int nt = resolve_threads(num_threads);
  if (nt <= 1 || !worth_parallel(a.n)) return fn(a, 0, ng);
  int64_t bad = 0;
#pragma omp parallel num_threads(nt) reduction(+ : bad)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
#else
    const int64_t t = 0, T = 1;
#endif
    const int64_t per = (ng + T - 1) / T;
    const int64_t g0 = std::min(ng, t * per), g1 = std::min(ng, g0 + per);
    if (g0 < g1) bad += fn(a, g0, g1);
  }
  return bad;
}

template <int LEVELS, bool SR>
int64_t quantize_impl(const float* x, float* e, uint8_t* out, uint8_t* scales, int64_t n, int64_t G,
                      uint64_t seed, uint64_t step, int num_threads) {
  Args a{};
  a.x = x, a.e = e, a.out = out, a.scales = scales, a.n = n, a.G = G;
  a.sr_base = SR ? sr_stream_base(seed, step) : 0;
  const RangeFn fn = e ? DILOCOX_PICK(quant_range, LEVELS, SR, true)
                       : DILOCOX_PICK(quant_range, LEVELS, SR, false);
  return run_groups(fn, a, num_threads);
}

template <int BITS, bool ACC>
void dequant_impl(const uint8_t* in, const uint8_t* scales, float* dst, int64_t n, int64_t G,
                  int num_threads) {
  Args a{};
  a.in = in, a.scales = const_cast<uint8_t*>(scales), a.dst = dst, a.n = n, a.G = G;
  run_groups(DILOCOX_PICK(deq_range, BITS, ACC), a, num_threads);
}

}  // namespace

int select_cpu_isa(int isa) {
  g_isa_override.store(isa, std::memory_order_relaxed);
  return active_isa();
}

int current_cpu_isa() { return active_isa(); }

int best_cpu_isa() {
  static const int detected = detect_isa();
  return detected;
}

int64_t ef_quantize_pack_int4(const float* x, float* e, uint8_t* packed, uint8_t* scales, int64_t n,
                              int64_t G, int num_threads) {
  return quantize_impl<7, false>(x, e, packed, scales, n, G, 0, 0, num_threads);
}
int64_t ef_quantize_pack_int8(const float* x, float* e, int8_t* q, uint8_t* scales, int64_t n,
                              int64_t G, int num_threads) {
  return quantize_impl<127, false>(x, e, reinterpret_cast<uint8_t*>(q), scales, n, G, 0, 0,
                                   num_threads);
}
int64_t ef_quantize_pack_sr_int4(const float* x, float* e, uint8_t* packed, uint8_t* scales,
                                 int64_t n, int64_t G, uint64_t seed, uint64_t step, int num_threads) {
  return quantize_impl<7, true>(x, e, packed, scales, n, G, seed, step, num_threads);
}
int64_t ef_quantize_pack_sr_int8(const float* x, float* e, int8_t* q, uint8_t* scales, int64_t n,
                                 int64_t G, uint64_t seed, uint64_t step, int num_threads) {
  return quantize_impl<127, true>(x, e, reinterpret_cast<uint8_t*>(q), scales, n, G, seed, step,
                                  num_threads);
}

void dequantize_int4(const uint8_t* packed, const uint8_t* scales, float* out, int64_t n, int64_t G,
                     int num_threads) {
  dequant_impl<4, false>(packed, scales, out, n, G, num_threads);
}
void dequantize_accumulate_int4(const uint8_t* packed, const uint8_t* scales, float* out, int64_t n,
                                int64_t G, int num_threads) {
  dequant_impl<4, true>(packed, scales, out, n, G, num_threads);
}
void dequantize_int8(const int8_t* q, const uint8_t* scales, float* out, int64_t n, int64_t G,
                     int num_threads) {
  dequant_impl<8, false>(reinterpret_cast<const uint8_t*>(q), scales, out, n, G, num_threads);
}
void dequantize_accumulate_int8(const int8_t* q, const uint8_t* scales, float* out, int64_t n,
                                int64_t G, int num_threads) {
  dequant_impl<8, true>(reinterpret_cast<const uint8_t*>(q), scales, out, n, G, num_threads);
}

}  // namespace dilocox
