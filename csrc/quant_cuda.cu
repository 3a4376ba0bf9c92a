// dilocox: CUDA cores of the int4/int8 group quantizer with fused error feedback
// (DiLoCoX int4 pseudo-gradient compression; error feedback as in CocktailSGD).
// Same format and bit-exact semantics as quant_cpu.cpp / quant_core.h. Torch-free: the
// launchers take raw device pointers and a cudaStream_t (as void*).
//
// Quantize: one warp per group. Each lane owns chunks of 4 consecutive elements (one float4
// load per array when the group size is a multiple of 4 and the pointers are aligned), so a
// group of 128 fills the warp once. Pass 1 reduces absmax (+ a non-finite flag) with shuffles;
// pass 2 quantizes (from registers for groups of <= 128, else re-reading the group: an L1/L2
// hit) and writes e, 4 nibbles as one uint16 (int4) or 4 bytes as one uint32 (int8).
// (Was 8 elements per lane: half the warp idle at G = 128, 66-72 % of an in-place add on an
// H200 at 16M-64M elements; docs/BENCHMARKS.md "GPU".)
// All float ops use explicit __f*_rn intrinsics: no FMA contraction, IEEE division,
// so the results equal the CPU core and the pure-torch reference bit for bit.
#include <cuda_runtime.h>

#include <cstdint>

#include "quant_core.h"

namespace dilocox {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * 32;

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Loads 8 consecutive floats p[j..j+8) (zeros past len). VEC: 16-byte aligned float4 loads.
template <bool VEC>
__device__ __forceinline__ void load8(const float* __restrict__ p, int64_t j, int64_t len, float (&v)[8]) {
  if (VEC && j + 8 <= len) {
    const float4 a = *reinterpret_cast<const float4*>(p + j);
    const float4 b = *reinterpret_cast<const float4*>(p + j + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (j + k < len) ? p[j + k] : 0.0f;
  }
}

template <bool VEC>
__device__ __forceinline__ void store8(float* __restrict__ p, int64_t j, int64_t len, const float (&v)[8]) {
  if (VEC && j + 8 <= len) {
    *reinterpret_cast<float4*>(p + j) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + j + 4) = make_float4(v[4], v[5], v[6], v[7]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (j + k < len) p[j + k] = v[k];
  }
}

__device__ __forceinline__ float load_scale(const uint8_t* scales, int64_t g) {
  return bf16_bits_to_f32(static_cast<uint16_t>(scales[2 * g] | (static_cast<uint16_t>(scales[2 * g + 1]) << 8)));
}

// Loads 4 consecutive floats p[j..j+4) (zeros past len). VEC: one 16-byte aligned float4 load.
template <bool VEC>
__device__ __forceinline__ void load4(const float* __restrict__ p, int64_t j, int64_t len, float (&v)[4]) {
  if (VEC && j + 4 <= len) {
    const float4 a = *reinterpret_cast<const float4*>(p + j);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = (j + k < len) ? p[j + k] : 0.0f;
  }
}

template <bool VEC>
__device__ __forceinline__ void store4(float* __restrict__ p, int64_t j, int64_t len, const float (&v)[4]) {
  if (VEC && j + 4 <= len) {
    *reinterpret_cast<float4*>(p + j) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (j + k < len) p[j + k] = v[k];
  }
}

// Quantizes, writes the residual and packs one chunk of 4 values t[] at group offset j.
template <int LEVELS, bool SR, bool EF, bool VEC>
__device__ __forceinline__ void quantize_chunk(const float (&t)[4], float s, int64_t start, int64_t j, int64_t len,
                                               float* __restrict__ eg, uint8_t* __restrict__ out, uint64_t sr_base) {
  const float lo = -static_cast<float>(LEVELS), hi = static_cast<float>(LEVELS);
  int q[4];
  float r[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    int qi = 0;
    if (s > 0.0f) {
      float y = __fdiv_rn(t[k], s);
      if (SR) {
        y = __fadd_rn(y, sr_uniform(sr_base, static_cast<uint64_t>(start + j + k)));
        qi = __float2int_rn(floorf(fminf(fmaxf(y, lo), hi)));
      } else {
        qi = __float2int_rn(rintf(fminf(fmaxf(y, lo), hi)));
      }
    }
    q[k] = qi;
    // int -> float gives +0 for q == 0, matching the CPU core's sign of zero.
    if (EF) r[k] = __fsub_rn(t[k], __fmul_rn(s, __int2float_rn(qi)));
  }
  if (EF) store4<VEC>(eg, j, len, r);
  const int64_t cnt = min(int64_t(4), len - j);
  if (LEVELS == 7) {
    uint8_t* pb = out + (start + j) / 2;  // start and j are even
    if (VEC && cnt == 4) {  // element 2k -> low nibble (little endian)
      *reinterpret_cast<uint16_t*>(pb) = static_cast<uint16_t>((q[0] & 15) | ((q[1] & 15) << 4) |
                                                               ((q[2] & 15) << 8) | ((q[3] & 15) << 12));
    } else {
      for (int k = 0; 2 * k < cnt; ++k)  // q beyond len are 0: odd tail gets high nibble 0
        pb[k] = static_cast<uint8_t>((q[2 * k] & 15) | ((q[2 * k + 1] & 15) << 4));
    }
  } else {
    uint8_t* pb = out + start + j;
    if (VEC && cnt == 4) {
      *reinterpret_cast<uint32_t*>(pb) =
          (q[0] & 255) | ((q[1] & 255) << 8) | ((q[2] & 255) << 16) | (uint32_t(q[3] & 255) << 24);
    } else {
      for (int k = 0; k < cnt; ++k) pb[k] = static_cast<uint8_t>(static_cast<int8_t>(q[k]));
    }
  }
}

// One warp per group, 4 consecutive elements per lane (one float4 per array), so a group of 128 - the
// default - keeps all 32 lanes busy and is read once: its values stay in registers between the absmax
// reduction and the quantization. Longer groups loop (pass 2 re-reads the group: an L1/L2 hit).
template <int LEVELS, bool SR, bool EF, bool VEC>
__global__ void __launch_bounds__(kThreads)
quantize_kernel(const float* __restrict__ x, float* __restrict__ e, uint8_t* __restrict__ out,
                uint8_t* __restrict__ scales, int64_t n, int64_t G, int64_t ngroups, uint64_t sr_base,
                unsigned long long* nbad) {
  const int lane = threadIdx.x & 31;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (g >= ngroups) return;  // uniform per warp: the shuffles below see a full warp
  const int64_t start = g * G;
  const int64_t len = min(G, n - start);
  const float* xg = x + start;
  float* eg = EF ? e + start : nullptr;
  const bool one = len <= 128;  // uniform per warp: one chunk per lane, kept in registers

  // Pass 1: absmax of t = x (+ e) and a non-finite flag.
  float amax = 0.0f;
  bool bad = false;
  float t0[4];
  for (int64_t j = int64_t(lane) * 4; j < len; j += 128) {
    float v[4], w[4];
    load4<VEC>(xg, j, len, v);
    if (EF) load4<VEC>(eg, j, len, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float t = EF ? __fadd_rn(v[k], w[k]) : v[k];
      t0[k] = t;
      bad |= !isfinite(t);
      amax = fmaxf(amax, fabsf(t));
    }
  }
  if (__any_sync(0xffffffffu, bad)) {  // leave this group untouched, count it
    if (lane == 0) atomicAdd(nbad, 1ull);
    return;
  }
  amax = warp_max(amax);
  const uint16_t sbits = f32_to_bf16_bits(__fdiv_rn(amax, static_cast<float>(LEVELS)));
  const float s = bf16_bits_to_f32(sbits);
  if (lane == 0) {  // byte stores: the scale area may start at an odd offset
    scales[2 * g] = static_cast<uint8_t>(sbits & 0xff);
    scales[2 * g + 1] = static_cast<uint8_t>(sbits >> 8);
  }

  // Pass 2: quantize, write the residual and the packed values.
  if (one) {
    const int64_t j = int64_t(lane) * 4;
    if (j < len) quantize_chunk<LEVELS, SR, EF, VEC>(t0, s, start, j, len, eg, out, sr_base);
    return;
  }
  for (int64_t j = int64_t(lane) * 4; j < len; j += 128) {
    float v[4], w[4], t[4];
    load4<VEC>(xg, j, len, v);
    if (EF) load4<VEC>(eg, j, len, w);
#pragma unroll
    for (int k = 0; k < 4; ++k) t[k] = EF ? __fadd_rn(v[k], w[k]) : v[k];
    quantize_chunk<LEVELS, SR, EF, VEC>(t, s, start, j, len, eg, out, sr_base);
  }
}

// One thread per 8-element chunk (grid-stride). VEC: G % 8 == 0 (one scale per chunk),
// aligned payload / output pointers.
template <int BITS, bool ACC, bool VEC>
__global__ void __launch_bounds__(kThreads)
dequant_kernel(const uint8_t* __restrict__ in, const uint8_t* __restrict__ scales, float* __restrict__ out,
               int64_t n, int64_t G) {
  const int64_t nchunks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < nchunks; c += stride) {
    const int64_t i0 = c * 8;
    const int64_t cnt = min(int64_t(8), n - i0);
    int q[8];
    if (VEC && cnt == 8) {
      if (BITS == 4) {
        const uint32_t w = __ldg(reinterpret_cast<const unsigned int*>(in + i0 / 2));
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = static_cast<int>(((w >> (4 * k)) & 15) ^ 8) - 8;
      } else {
        const uint2 w = __ldg(reinterpret_cast<const uint2*>(in + i0));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          q[k] = static_cast<int8_t>((w.x >> (8 * k)) & 255);
          q[k + 4] = static_cast<int8_t>((w.y >> (8 * k)) & 255);
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        q[k] = 0;
        if (k < cnt) {
          const int64_t i = i0 + k;
          if (BITS == 4) {
            const int b = in[i / 2];
            q[k] = ((((i & 1) ? (b >> 4) : b) & 15) ^ 8) - 8;
          } else {
            q[k] = static_cast<int8_t>(in[i]);
          }
        }
      }
    }
    float d[8];
    const float s0 = load_scale(scales, i0 / G);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float s = VEC ? s0 : (k < cnt ? load_scale(scales, (i0 + k) / G) : 0.0f);
      d[k] = __fmul_rn(s, __int2float_rn(q[k]));
    }
    if (ACC) {
      float o[8];
      load8<VEC>(out, i0, n, o);
#pragma unroll
      for (int k = 0; k < 8; ++k) d[k] = __fadd_rn(o[k], d[k]);
    }
    store8<VEC>(out, i0, n, d);
  }
}

inline bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

template <int LEVELS, bool SR>
void launch_quant(const float* x, float* e, uint8_t* out, uint8_t* scales, int64_t n, int64_t G,
                  uint64_t base, unsigned long long* nbad, cudaStream_t st) {
  const int64_t ng = num_groups(n, G);
  const dim3 grid(static_cast<unsigned>((ng + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const bool vec = G % 4 == 0 && aligned(x, 16) && (e == nullptr || aligned(e, 16)) &&
                   aligned(out, LEVELS == 7 ? 2 : 4);
#define DILOCOX_LAUNCH_Q(EF, VEC) \
  quantize_kernel<LEVELS, SR, EF, VEC><<<grid, kThreads, 0, st>>>(x, e, out, scales, n, G, ng, base, nbad)
  if (e != nullptr) {
    if (vec) DILOCOX_LAUNCH_Q(true, true);
    else DILOCOX_LAUNCH_Q(true, false);
  } else {
    if (vec) DILOCOX_LAUNCH_Q(false, true);
    else DILOCOX_LAUNCH_Q(false, false);
  }
#undef DILOCOX_LAUNCH_Q
}

template <int BITS, bool ACC>
void launch_deq(const uint8_t* in, const uint8_t* scales, float* out, int64_t n, int64_t G, cudaStream_t st) {
  const int64_t nchunks = (n + 7) / 8;
  int64_t blocks = (nchunks + kThreads - 1) / kThreads;
  if (blocks > 65536) blocks = 65536;  // grid-stride beyond that
  const bool vec = G % 8 == 0 && aligned(out, 16) && aligned(in, BITS == 4 ? 4 : 8);
  if (vec) dequant_kernel<BITS, ACC, true><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(in, scales, out, n, G);
  else dequant_kernel<BITS, ACC, false><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(in, scales, out, n, G);
}

}  // namespace

int ef_quantize_pack(const float* x, float* e, uint8_t* payload, int64_t n, int64_t G, int bits,
                     bool stochastic, uint64_t seed, uint64_t step, unsigned long long* nbad, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaMemsetAsync(nbad, 0, sizeof(unsigned long long), st);
  if (err != cudaSuccess || n <= 0) return static_cast<int>(err);
  uint8_t* scales = payload + (bits == 4 ? packed_bytes_int4(n) : n);
  const uint64_t base = stochastic ? sr_stream_base(seed, step) : 0;
  if (bits == 4) {
    if (stochastic) launch_quant<7, true>(x, e, payload, scales, n, G, base, nbad, st);
    else launch_quant<7, false>(x, e, payload, scales, n, G, base, nbad, st);
  } else {
    if (stochastic) launch_quant<127, true>(x, e, payload, scales, n, G, base, nbad, st);
    else launch_quant<127, false>(x, e, payload, scales, n, G, base, nbad, st);
  }
  return static_cast<int>(cudaGetLastError());
}

int dequantize(const uint8_t* payload, float* out, int64_t n, int64_t G, int bits, bool accumulate,
               void* stream) {
  if (n <= 0) return 0;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const uint8_t* scales = payload + (bits == 4 ? packed_bytes_int4(n) : n);
  if (bits == 4) {
    if (accumulate) launch_deq<4, true>(payload, scales, out, n, G, st);
    else launch_deq<4, false>(payload, scales, out, n, G, st);
  } else {
    if (accumulate) launch_deq<8, true>(payload, scales, out, n, G, st);
    else launch_deq<8, false>(payload, scales, out, n, G, st);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda
}  // namespace dilocox
