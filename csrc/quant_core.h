// dilocox: torch-free cores of the pseudo-gradient compression kernels.
//
// Format (ALGORITHMS.md section 6; DiLoCoX paper, "adaptive gradient compression" with
// int4 group quantization of pseudo-gradients + error feedback; the error-feedback
// accumulator follows CocktailSGD / EF-SGD: send Q(x + e), keep e' = (x + e) - Q(x + e)):
//
//   * flat fp32 input, groups of G elements (last group may be partial);
//   * per group: s = absmax / 7 (int4) or absmax / 127 (int8), rounded to bf16
//     (round-to-nearest-even of the fp32 bits, like torch's .to(torch.bfloat16)),
//     and that ROUNDED scale is the one used to quantize;
//   * q = clamp(rint(v / s), -L, L) with rint = round-half-to-even, L = 7 or 127;
//     a group with s == 0 gives q == 0 (no division by zero);
//   * stochastic rounding: q = clamp(floor(v / s + u), -L, L), u in [0,1) from a
//     counter-based splitmix64 hash of (seed, step, element index) - see sr_uniform();
//   * int4: two's-complement nibbles, element 2k in the LOW nibble of byte k, 2k+1 in
//     the HIGH nibble (odd length: last high nibble is 0). int8: one int8 per element;
//   * wire payload = [packed bytes | scales as little-endian bf16 bytes].
//
// The scale area starts at byte offset ceil(n/2) (int4) or n (int8), which can be odd,
// so scales are passed as a BYTE pointer (uint8_t*, 2 bytes per group, little-endian
// bf16 bits) and are written/read with byte stores - never as an aligned uint16_t*.
//
// Every function here is exact IEEE fp32 arithmetic with no FMA contraction (compile
// with -ffp-contract=off; the CUDA version uses __f*_rn intrinsics), so the CPU core,
// the CUDA core and the pure-torch reference (dilocox/compress/kernels.py) agree bit
// for bit, including the stochastic-rounding variant.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DILOCOX_HD __host__ __device__ __forceinline__
#else
#define DILOCOX_HD inline
#endif

namespace dilocox {

// --- bf16 helpers (shared by host and device code) -----------------------------------

DILOCOX_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

DILOCOX_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// Round-to-nearest-even fp32 -> bf16 bits; same formula as c10::BFloat16
// (round_to_nearest_even). NaN maps to the canonical quiet NaN 0x7FC0.
DILOCOX_HD uint16_t f32_to_bf16_bits(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

DILOCOX_HD float bf16_bits_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

// --- counter-based RNG for stochastic rounding ---------------------------------------
// splitmix64 (Steele, Lea, Flood 2014) finalizer. A stream is selected by
// base = mix64(mix64(seed) + step); element i draws mix64(base + (i + 1) * GOLDEN),
// i.e. the (i+1)-th output of a splitmix64 generator started at `base`. Pure 64-bit
// wrapping integer arithmetic, so C++, CUDA and torch int64 ops give the same bits.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

DILOCOX_HD uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

DILOCOX_HD uint64_t sr_stream_base(uint64_t seed, uint64_t step) { return mix64(mix64(seed) + step); }

// u in [0, 1): top 24 bits of the hash, exactly representable in fp32.
DILOCOX_HD float sr_uniform(uint64_t base, uint64_t index) {
  const uint64_t z = mix64(base + (index + 1) * kGolden);
  // (int32 conversion: the value is < 2^24, and signed int->float vectorizes everywhere)
  return static_cast<float>(static_cast<int32_t>(z >> 40)) * 5.9604644775390625e-08f;  // 2^-24
}

// --- CPU entry points (quant_cpu.cpp) --------------------------------------------------
// Shapes: n elements, G = group size (int4 requires G even, so groups start on a byte
// boundary and groups can be processed in parallel), ngroups = ceil(n / G).
// `e` may be null (no error feedback); when given it is read (v = x + e) and overwritten
// with the new residual v - s*q in the same pass.
// Return value of the quantizers: number of groups whose v = x (+ e) contains a
// non-finite value. Such groups are NOT written (packed bytes, scale and e of that group
// are left as they were); the caller must treat a non-zero return as an error.
// num_threads <= 0 means "OpenMP default".

int64_t ef_quantize_pack_int4(const float* x, float* e, uint8_t* packed, uint8_t* scales, int64_t n,
                              int64_t G, int num_threads);
int64_t ef_quantize_pack_int8(const float* x, float* e, int8_t* q, uint8_t* scales, int64_t n,
                              int64_t G, int num_threads);
// Stochastic rounding variants: q = clamp(floor(v/s + u(seed, step, i)), -L, L).
int64_t ef_quantize_pack_sr_int4(const float* x, float* e, uint8_t* packed, uint8_t* scales,
                                 int64_t n, int64_t G, uint64_t seed, uint64_t step, int num_threads);
int64_t ef_quantize_pack_sr_int8(const float* x, float* e, int8_t* q, uint8_t* scales, int64_t n,
                                 int64_t G, uint64_t seed, uint64_t step, int num_threads);

// out[i] = s * q[i]
void dequantize_int4(const uint8_t* packed, const uint8_t* scales, float* out, int64_t n, int64_t G,
                     int num_threads);
void dequantize_int8(const int8_t* q, const uint8_t* scales, float* out, int64_t n, int64_t G,
                     int num_threads);
// out[i] += s * q[i]   (receive side of a quantized all-reduce; product rounded first)
void dequantize_accumulate_int4(const uint8_t* packed, const uint8_t* scales, float* out, int64_t n,
                                int64_t G, int num_threads);
void dequantize_accumulate_int8(const int8_t* q, const uint8_t* scales, float* out, int64_t n,
                                int64_t G, int num_threads);

// CPU code paths (runtime-dispatched per function; all produce identical bits).
// select_cpu_isa(-1) = auto (best supported); 0/1/2 force baseline/AVX2/AVX-512 (capped at
// what the CPU supports). Returns the ISA now in use. Meant for tests and benchmarks.
enum { kIsaBaseline = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
int select_cpu_isa(int isa);
int current_cpu_isa();  // the ISA the CPU kernels run (the detected one, or the override)
int best_cpu_isa();     // the best ISA this CPU has (what select_cpu_isa(-1) runs)

// Helpers for the wire layout.
inline int64_t num_groups(int64_t n, int64_t G) { return (n + G - 1) / G; }
inline int64_t packed_bytes_int4(int64_t n) { return (n + 1) / 2; }
inline int64_t payload_bytes(int64_t n, int64_t G, int bits) {
  return (bits == 4 ? packed_bytes_int4(n) : n) + 2 * num_groups(n, G);
}

}  // namespace dilocox

// --- CUDA entry points (quant_cuda.cu); declared without CUDA headers -----------------
// `stream` is a cudaStream_t passed as void*. `nbad` is a DEVICE pointer to one
// unsigned long long that receives the number of non-finite groups (zeroed here on
// the stream). Return value: cudaError_t of the launch, as int (0 = success).
namespace dilocox {
namespace cuda {
int ef_quantize_pack(const float* x, float* e, uint8_t* payload, int64_t n, int64_t G, int bits,
                     bool stochastic, uint64_t seed, uint64_t step, unsigned long long* nbad,
                     void* stream);
int dequantize(const uint8_t* payload, float* out, int64_t n, int64_t G, int bits, bool accumulate,
               void* stream);
}  // namespace cuda
}  // namespace dilocox
