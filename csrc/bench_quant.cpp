// dilocox: micro-benchmark of the CPU quantization cores vs memcpy (torch-free).
// Effective bandwidth = (bytes read + bytes written) / time, the same accounting as
// dilocox/bench/kernels.py. Usage: bench_quant [numel ...]   (threads: OMP_NUM_THREADS)
#include "quant_core.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

using namespace dilocox;

template <class F>
static double best_seconds(F&& f, int repeats) {
  f();  // warm-up (page faults, caches)
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
  }
  return best;
}

int main(int argc, char** argv) {
  std::vector<int64_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::atoll(argv[i]));
  if (sizes.empty()) sizes = {1 << 16, 1 << 20, 1 << 22, 1 << 24};
  const int64_t G = 128;
  int threads = 1;
#ifdef _OPENMP
  threads = omp_get_max_threads();
#endif
  std::printf("threads=%d group_size=%lld\n", threads, (long long)G);
  std::printf("| op | numel | ms | GB/s | %% of memcpy |\n|---|---:|---:|---:|---:|\n");
  for (int64_t n : sizes) {
    std::vector<float> x(n), e(n), dst(n), out(n, 0.f);
    std::mt19937 rng(0);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < n; ++i) x[i] = nd(rng), e[i] = 0.01f * nd(rng);
    std::vector<uint8_t> p(payload_bytes(n, G, 4));
    uint8_t* sc = p.data() + packed_bytes_int4(n);
    const int reps = n >= (1 << 22) ? 10 : 50;
    const double pbytes = double(p.size());

    const double t_copy = best_seconds([&] { std::memcpy(dst.data(), x.data(), n * 4); }, reps);
    const double bw_copy = 8.0 * n / t_copy / 1e9;
    const double t_q = best_seconds(
        [&] { ef_quantize_pack_int4(x.data(), e.data(), p.data(), sc, n, G, threads); }, reps);
    const double bw_q = (12.0 * n + pbytes) / t_q / 1e9;  // read x, e; write e, payload
    const double t_d = best_seconds(
        [&] { dequantize_accumulate_int4(p.data(), sc, out.data(), n, G, threads); }, reps);
    const double bw_d = (8.0 * n + pbytes) / t_d / 1e9;  // read payload, out; write out
    const double t_sr = best_seconds(
        [&] { ef_quantize_pack_sr_int4(x.data(), e.data(), p.data(), sc, n, G, 1, 2, threads); },
        reps);
    const double bw_sr = (12.0 * n + pbytes) / t_sr / 1e9;
    std::printf("| memcpy | %lld | %.3f | %.1f | 100 |\n", (long long)n, t_copy * 1e3, bw_copy);
    std::printf("| ef_quantize_pack_int4 | %lld | %.3f | %.1f | %.0f |\n", (long long)n, t_q * 1e3, bw_q,
                100 * bw_q / bw_copy);
    std::printf("| ef_quantize_pack_sr_int4 | %lld | %.3f | %.1f | %.0f |\n", (long long)n, t_sr * 1e3,
                bw_sr, 100 * bw_sr / bw_copy);
    std::printf("| dequantize_accumulate_int4 | %lld | %.3f | %.1f | %.0f |\n", (long long)n, t_d * 1e3,
                bw_d, 100 * bw_d / bw_copy);
  }
  return 0;
}
