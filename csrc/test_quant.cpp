// dilocox: torch-free test of the CPU quantization cores against a scalar reference that
// is written here independently, straight from the format spec (quant_core.h /
// ALGORITHMS.md section 6): bit-exact payloads and residuals, odd lengths, zero groups,
// per-element error bound, NaN/inf detection, thread-count independence.
// Exit code 0 = all passed (run by ctest).
#include "quant_core.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace dilocox;

static int g_failures = 0;
#define CHECK(cond, ...)                                  \
  do {                                                    \
    if (!(cond)) {                                        \
      ++g_failures;                                       \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__);    \
      std::printf(__VA_ARGS__);                           \
      std::printf("\n");                                  \
      if (g_failures > 20) std::exit(1);                  \
    }                                                     \
  } while (0)

// Independent scalar reference: plain loops, std::nearbyint / std::floor.
struct RefOut {
  std::vector<uint8_t> payload;
  std::vector<float> e;
};

static float ref_bf16(float f) {  // RNE via the integer formula of c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &u, 4);
  return r;
}

static RefOut reference(const std::vector<float>& x, const std::vector<float>* e, int64_t G, int bits,
                        bool sr, uint64_t seed, uint64_t step) {
  const int64_t n = static_cast<int64_t>(x.size());
  const int L = bits == 4 ? 7 : 127;
  const int64_t qbytes = bits == 4 ? (n + 1) / 2 : n, ng = (n + G - 1) / G;
  RefOut r;
  r.payload.assign(qbytes + 2 * ng, 0);
  r.e.assign(n, 0.f);
  const uint64_t base = mix64(mix64(seed) + step);
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t a = g * G, b = std::min(n, a + G);
    float amax = 0.f;
    for (int64_t i = a; i < b; ++i) amax = std::max(amax, std::fabs(x[i] + (e ? (*e)[i] : 0.f)));
    const float s = ref_bf16(amax / static_cast<float>(L));
    uint32_t sb;
    std::memcpy(&sb, &s, 4);
    r.payload[qbytes + 2 * g] = static_cast<uint8_t>((sb >> 16) & 0xff);
    r.payload[qbytes + 2 * g + 1] = static_cast<uint8_t>(sb >> 24);
    for (int64_t i = a; i < b; ++i) {
      const float v = x[i] + (e ? (*e)[i] : 0.f);
      int q = 0;
      if (s > 0.f) {
        float y = v / s;
        if (sr) {
          const uint64_t z = mix64(base + (uint64_t(i) + 1) * kGolden);
          const float u = static_cast<float>(z >> 40) / 16777216.0f;
          y = std::floor(y + u);
        } else {
          y = std::nearbyint(y);
        }
        q = static_cast<int>(std::min(std::max(y, -float(L)), float(L)));
      }
      r.e[i] = v - s * static_cast<float>(q);
      if (bits == 8) {
        r.payload[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        const uint8_t nib = static_cast<uint8_t>(q & 15);
        r.payload[i / 2] |= (i % 2 == 0) ? nib : static_cast<uint8_t>(nib << 4);
      }
    }
  }
  return r;
}

static int64_t run_quant(const std::vector<float>& x, std::vector<float>* e, std::vector<uint8_t>& p,
                         int64_t G, int bits, bool sr, uint64_t seed, uint64_t step, int threads) {
  const int64_t n = static_cast<int64_t>(x.size());
  p.assign(payload_bytes(n, G, bits), 0xAB);  // garbage: every byte must be overwritten
  uint8_t* sc = p.data() + (bits == 4 ? packed_bytes_int4(n) : n);
  float* ep = e ? e->data() : nullptr;
  if (bits == 4)
    return sr ? ef_quantize_pack_sr_int4(x.data(), ep, p.data(), sc, n, G, seed, step, threads)
              : ef_quantize_pack_int4(x.data(), ep, p.data(), sc, n, G, threads);
  int8_t* q = reinterpret_cast<int8_t*>(p.data());
  return sr ? ef_quantize_pack_sr_int8(x.data(), ep, q, sc, n, G, seed, step, threads)
            : ef_quantize_pack_int8(x.data(), ep, q, sc, n, G, threads);
}

static std::vector<float> run_dequant(const std::vector<uint8_t>& p, int64_t n, int64_t G, int bits,
                                      const std::vector<float>* acc, int threads) {
  std::vector<float> out = acc ? *acc : std::vector<float>(n, -123.f);
  const uint8_t* sc = p.data() + (bits == 4 ? packed_bytes_int4(n) : n);
  const int8_t* q8 = reinterpret_cast<const int8_t*>(p.data());
  if (bits == 4) {
    if (acc) dequantize_accumulate_int4(p.data(), sc, out.data(), n, G, threads);
    else dequantize_int4(p.data(), sc, out.data(), n, G, threads);
  } else {
    if (acc) dequantize_accumulate_int8(q8, sc, out.data(), n, G, threads);
    else dequantize_int8(q8, sc, out.data(), n, G, threads);
  }
  return out;
}

static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

static void test_case(int64_t n, int64_t G, int bits, bool ef, bool sr, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(n), e0(n);
  for (auto& v : x) v = nd(rng) * 1e-3f;
  for (auto& v : e0) v = nd(rng) * 1e-4f;
  if (n > 2 * G) {  // an all-zero group and a group with a single outlier
    for (int64_t i = G; i < 2 * G; ++i) x[i] = 0.f, e0[i] = 0.f;
    x[2 * G] = 50.f;
  }
  const uint64_t seed = 1234567, step = 42;
  const RefOut ref = reference(x, ef ? &e0 : nullptr, G, bits, sr, seed, step);
  for (int threads : {1, 3}) {
    std::vector<float> e = e0;
    std::vector<uint8_t> p;
    const int64_t bad = run_quant(x, ef ? &e : nullptr, p, G, bits, sr, seed, step, threads);
    CHECK(bad == 0, "n=%lld unexpected nonfinite count %lld", (long long)n, (long long)bad);
    CHECK(p == ref.payload, "payload mismatch n=%lld G=%lld bits=%d ef=%d sr=%d t=%d", (long long)n,
          (long long)G, bits, ef, sr, threads);
    if (ef) CHECK(same_bits(e, ref.e), "residual mismatch n=%lld G=%lld bits=%d sr=%d", (long long)n,
                  (long long)G, bits, sr);
    // dequantize: s*q, and v - deq == residual exactly.
    const std::vector<float> d = run_dequant(p, n, G, bits, nullptr, threads);
    for (int64_t i = 0; i < n; ++i) {
      const float v = x[i] + (ef ? e0[i] : 0.f);
      CHECK(v - d[i] == ref.e[i], "deq/residual mismatch at %lld", (long long)i);
      if (g_failures) break;
    }
    // accumulate adds into existing content (product rounded, then one add).
    std::vector<float> acc(n);
    for (int64_t i = 0; i < n; ++i) acc[i] = static_cast<float>(i % 7) - 3.f;
    const std::vector<float> a = run_dequant(p, n, G, bits, &acc, threads);
    for (int64_t i = 0; i < n; ++i) {
      CHECK(a[i] == acc[i] + d[i], "accumulate mismatch at %lld", (long long)i);
      if (g_failures) break;
    }
    // error bound per group: |v - deq| <= s/2 (nearest) or < s (stochastic); s ~ absmax/L.
    const int L = bits == 4 ? 7 : 127;
    for (int64_t g = 0; g * G < n; ++g) {
      float amax = 0.f;
      const int64_t lo = g * G, hi = std::min(n, lo + G);
      for (int64_t i = lo; i < hi; ++i) amax = std::max(amax, std::fabs(x[i] + (ef ? e0[i] : 0.f)));
      const float bound = (sr ? 1.0f : 0.5f) * amax / L * (1.f + 1.f / 128.f) + 1e-30f;
      for (int64_t i = lo; i < hi; ++i)
        CHECK(std::fabs(ref.e[i]) <= bound, "error bound violated g=%lld", (long long)g);
    }
  }
}

static void test_nibble_layout() {
  // x = [7, -7, 1, -1, 0] with absmax 7 -> s = 1 exactly; q = x.
  std::vector<float> x = {7.f, -7.f, 1.f, -1.f, 0.f};
  std::vector<uint8_t> p;
  run_quant(x, nullptr, p, 128, 4, false, 0, 0, 1);
  CHECK(p.size() == 3 + 2, "payload size %zu", p.size());
  CHECK(p[0] == 0x97, "byte0 %02x (7 low, -7=0x9 high)", p[0]);
  CHECK(p[1] == 0xF1, "byte1 %02x (1 low, -1=0xF high)", p[1]);
  CHECK(p[2] == 0x00, "byte2 %02x (odd tail high nibble 0)", p[2]);
  CHECK(p[3] == 0x80 && p[4] == 0x3F, "scale bytes %02x %02x (bf16 1.0 = 0x3F80)", p[3], p[4]);
}

static void test_nonfinite() {
  const float bad_vals[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (float bv : bad_vals)
    for (int bits : {4, 8}) {
      std::vector<float> x(1000, 0.5f), e(1000, 0.f);
      x[300] = bv;
      std::vector<uint8_t> p;
      CHECK(run_quant(x, &e, p, 128, bits, false, 0, 0, 2) == 1, "nonfinite not detected");
      CHECK(e[300] == 0.f, "residual of a bad group must be left untouched");
      // the other groups of the block (the AVX-512 path redoes a block with a bad group group by group) are
      // quantized as in a clean run
      std::vector<float> xc(1000, 0.5f), ec(1000, 0.f);
      std::vector<uint8_t> pc;
      run_quant(xc, &ec, pc, 128, bits, false, 0, 0, 2);
      for (int64_t i = 0; i < 1000; ++i)
        if (i / 128 != 2) CHECK(e[i] == ec[i], "group %lld of a block with a bad group differs", (long long)(i / 128));
      std::vector<float> e2(1000, 0.f);
      e2[5] = bv;  // non-finite coming from the error buffer
      CHECK(run_quant(std::vector<float>(1000, 0.5f), &e2, p, 64, bits, true, 1, 2, 1) == 1,
            "nonfinite in e not detected");
    }
}

static void test_ties(std::mt19937& rng) {
  // Quotients v / s on and a few ulp around every half-integer, for scales with 1, 2, 4 and 8 significant bits and one
  // near the smallest normal: the codes must round as rint(fl(v / s)) does (half to even), for full 128-element
  // groups, groups of a partial chunk (130, 96) and a last group cut short (n not a multiple of G).
  for (int64_t G : {128, 130, 96}) {
  const int64_t ngroups = 64, n = G * ngroups - 37;
  std::uniform_int_distribution<int> ulps(-3, 3);
  const float scales[] = {0.0078125f, 0.01171875f, 0.0859375f, 1.3671875f, 3.0e-38f};
  for (int bits : {4, 8}) {
    const int L = bits == 4 ? 7 : 127;
    std::uniform_int_distribution<int> kd(-L, L - 1);
    std::vector<float> x(n), e0(n, 0.f);
    for (int64_t g = 0; g < ngroups; ++g) {
      const float s = ref_bf16(scales[g % 5]);
      x[g * G] = static_cast<float>(L) * s;  // absmax: the group's scale is s
      for (int64_t i = g * G + 1; i < std::min(n, (g + 1) * G); ++i) {
        float v = (static_cast<float>(kd(rng)) + 0.5f) * s;  // exact: a tie
        for (int u = ulps(rng); u != 0; u += u > 0 ? -1 : 1) v = std::nextafter(v, u > 0 ? 1e30f : -1e30f);
        x[i] = v;
      }
    }
    for (bool ef : {false, true}) {
      const RefOut ref = reference(x, ef ? &e0 : nullptr, G, bits, false, 0, 0);
      std::vector<float> e = e0;
      std::vector<uint8_t> p;
      run_quant(x, ef ? &e : nullptr, p, G, bits, false, 0, 0, 1);
      CHECK(p == ref.payload, "ties: payload mismatch G=%lld bits=%d ef=%d", (long long)G, bits, int(ef));
      if (ef) CHECK(same_bits(e, ref.e), "ties: residual mismatch G=%lld bits=%d", (long long)G, bits);
    }
  }
  }
}

static void test_sr_unbiased() {
  // E[deq] = v for stochastic rounding: average over many steps.
  const int64_t n = 256, G = 128;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> ud(-1.f, 1.f);
  std::vector<float> x(n);
  for (auto& v : x) v = ud(rng);
  std::vector<double> mean(n, 0.0);
  const int draws = 2000;
  for (int t = 0; t < draws; ++t) {
    std::vector<uint8_t> p;
    run_quant(x, nullptr, p, G, 4, true, 99, t, 1);
    const auto d = run_dequant(p, n, G, 4, nullptr, 1);
    for (int64_t i = 0; i < n; ++i) mean[i] += d[i] / draws;
  }
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(mean[i] - x[i]));
  // s ~ 1/7; std of one draw <= s/2, of the mean <= s/(2 sqrt(2000)) ~ 1.6e-3; allow 6 sigma.
  CHECK(worst < 0.01, "stochastic rounding biased: worst |mean - x| = %g", worst);
}

#ifdef DILOCOX_WITH_CUDA
// CUDA core vs CPU core (bit-exact), when built with -DDILOCOX_CUDA=ON and a GPU is present.
#include <cuda_runtime.h>
static void test_cuda_vs_cpu() {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    std::printf("no CUDA device: CUDA comparison skipped\n");
    return;
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int bits : {4, 8})
    for (int64_t G : {6, 32, 128, 130})
      for (int64_t n : {1, 129, 1000, 4097, 100003})
        for (int mode = 0; mode < 4; ++mode) {  // bit 0: error feedback, bit 1: stochastic
          const bool ef = mode & 1, sr = mode & 2;
          std::vector<float> x(n), e(n);
          for (int64_t i = 0; i < n; ++i) x[i] = nd(rng), e[i] = 0.01f * nd(rng);
          if (n > 3 * G) for (int64_t i = G; i < 2 * G; ++i) x[i] = e[i] = 0.f;
          std::vector<float> ec = e;
          std::vector<uint8_t> pc;
          run_quant(x, ef ? &ec : nullptr, pc, G, bits, sr, 77, 3, 2);
          const int64_t pb = payload_bytes(n, G, bits);
          float *dx, *de, *dout;
          uint8_t* dp;
          unsigned long long* dbad;
          cudaMalloc(&dx, n * 4), cudaMalloc(&de, n * 4), cudaMalloc(&dout, n * 4);
          cudaMalloc(&dp, pb), cudaMalloc(&dbad, 8);
          cudaMemcpy(dx, x.data(), n * 4, cudaMemcpyHostToDevice);
          cudaMemcpy(de, e.data(), n * 4, cudaMemcpyHostToDevice);
          int err = cuda::ef_quantize_pack(dx, ef ? de : nullptr, dp, n, G, bits, sr, 77, 3, dbad, nullptr);
          std::vector<uint8_t> pg(pb);
          std::vector<float> eg(n), dg(n), dc = run_dequant(pc, n, G, bits, nullptr, 1);
          unsigned long long bad = 1;
          cudaMemcpy(pg.data(), dp, pb, cudaMemcpyDeviceToHost);
          cudaMemcpy(eg.data(), de, n * 4, cudaMemcpyDeviceToHost);
          cudaMemcpy(&bad, dbad, 8, cudaMemcpyDeviceToHost);
          err |= cuda::dequantize(dp, dout, n, G, bits, false, nullptr);
          cudaMemcpy(dg.data(), dout, n * 4, cudaMemcpyDeviceToHost);
          CHECK(err == 0 && bad == 0, "cuda error %d / nonfinite %llu", err, bad);
          CHECK(pg == pc, "cuda payload mismatch n=%lld G=%lld bits=%d mode=%d", (long long)n, (long long)G, bits, mode);
          if (ef) CHECK(same_bits(eg, ec), "cuda residual mismatch n=%lld G=%lld", (long long)n, (long long)G);
          CHECK(same_bits(dg, dc), "cuda dequantize mismatch n=%lld G=%lld", (long long)n, (long long)G);
          cudaFree(dx), cudaFree(de), cudaFree(dout), cudaFree(dp), cudaFree(dbad);
        }
  std::printf("CUDA core matches the CPU core\n");
}
#endif

int main() {
  const int64_t lengths[] = {1, 2, 3, 31, 127, 128, 129, 255, 1000, 4097, 70001};
  // Every runtime-dispatched code path (baseline / AVX2 / AVX-512) the CPU supports.
  for (int isa = kIsaBaseline; isa <= kIsaAvx512; ++isa) {
    if (select_cpu_isa(isa) != isa) continue;
    std::printf("isa %d\n", isa);
    std::mt19937 rng(2024);
    for (int bits : {4, 8})
      for (int64_t G : {6, 32, 64, 128, 130, 256})
        for (int64_t n : lengths)
          for (bool ef : {false, true})
            for (bool sr : {false, true}) test_case(n, G, bits, ef, sr, rng);
    test_case(1 << 20, 128, 4, true, false, rng);  // large: exercises the parallel path
    test_case(1 << 20, 128, 8, true, true, rng);
    test_nibble_layout();
    test_ties(rng);
    test_nonfinite();
    test_sr_unbiased();
  }
  select_cpu_isa(-1);
#ifdef DILOCOX_WITH_CUDA
  test_cuda_vs_cpu();
#endif
  if (g_failures) {
    std::printf("%d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("test_quant: all passed\n");
  return 0;
}
