// CUDA kernels for the weight formats (NF4 and NVFP4 quantize / dequantize; int8 and FP8 dequantize) and the
// per-row E4M3 activation quantizer of the FP8 matmul path.
//
// They equal the CPU kernels (csrc/cpu/quant.cpp) and the pure-PyTorch references (trainstream_hf/ops/reference/)
// bit for bit (tests/gpu/test_quant_kernels_cuda.py checks with torch.equal). How:
//   - Every float operation that rounds is written as an IEEE intrinsic (__fmul_rn, __fadd_rn, __fsub_rn,
//     __fdiv_rn, __ddiv_rn, __double2float_rn). nvcc never contracts these into an FMA, and --use_fast_math
//     does not touch them, so the file gives the same bits whatever the build flags.
//   - float8 / bfloat16 / half conversions go through c10's own types (the ones torch's .to() and the CPU kernel
//     use); their device paths round to nearest even, like the host ones, for every finite value. One exception: the
//     per-row E4M3 activation quantizer uses sm_89+'s conversion instruction, shown below to give c10's bits for every
//     value it converts.
//   - Reductions are a max (order-free) or an integer sum (exact): the NF4 absmax mean is summed in int64
//     fixed point exactly as nf4_offset() in csrc/cpu/quant.cpp, so the atomics' order cannot change a bit.
//   - Decodes are exact: int8 -> float, E4M3 -> half (cvt.rn.f16x2.e4m3x2, sm_89+) -> float, E2M1 / NF4 tables.
//
// No host synchronisation: scalars that the CPU kernel reads with .item() (the NF4 absmax offset, the NVFP4
// tensor scale) stay on the device and are read by the kernels. For the same reason the CUDA quantizers do not
// check that the weight is finite (raising would need the flag on the host); a weight with inf / NaN gives
// unspecified codes here, where the CPU kernel raises ValueError.
//
// NF4: QLoRA (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023, arXiv:2305.14314).
// NVFP4: NVIDIA, "Introducing NVFP4 for Efficient and Accurate Low-Precision Inference" (2025).
// FP8 E4M3: OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, 2023; torch.float8_e4m3fn.
// Layouts are documented in trainstream_hf/quant/formats.py.
#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // at::cuda::getCurrentCUDAStream, without ATen/cuda/CUDAContext.h's cuBLAS /
                                    // cuSPARSE headers (a toolkit with nvcc alone can build this file)
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <optional>
#include <torch/library.h>

#include "../include/quant_checks.h"
#include "../include/quant_formats.h"

namespace trainstream {
namespace {

using quant::kNf4Block;
using quant::kNf4Group;
using quant::kNvfp4Block;
using quant::kE4m3Max;
using quant::kE2m1Max;
constexpr int kThreads = 256;

// Same tables as csrc/cpu/quant.cpp (bitsandbytes' NF4 code; E2M1 code -> value, bit 3 the sign).
__constant__ float kNf4Code[16] = TRAINSTREAM_NF4_CODE;
__constant__ float kE2m1Value[16] = TRAINSTREAM_E2M1_VALUES;

// ---------------------------------------------------------------------------------------------------------------
// Element conversions and 16-element loads.

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(c10::Half v) { return static_cast<float>(v); }

// Bits of float(v) rounded to T (nearest even, as the CPU's static_cast<T>), right-aligned in a uint32.
template <typename T>
__device__ __forceinline__ uint32_t out_bits(float v);
template <>
__device__ __forceinline__ uint32_t out_bits<float>(float v) { return __float_as_uint(v); }
template <>
__device__ __forceinline__ uint32_t out_bits<c10::BFloat16>(float v) { return c10::BFloat16(v).x; }
template <>
__device__ __forceinline__ uint32_t out_bits<c10::Half>(float v) { return c10::Half(v).x; }

// x[0..16) as float. kVec: x is 16-byte aligned, so it is read as 16-byte vectors.
template <typename T, bool kVec>
__device__ __forceinline__ void load16(const T* __restrict__ x, float (&v)[16]) {
  if constexpr (kVec) {
    constexpr int kPerVec = 16 / sizeof(T);
    const uint4* p = reinterpret_cast<const uint4*>(x);
#pragma unroll
    for (int j = 0; j < 16 / kPerVec; ++j) {
      const uint4 u = __ldg(p + j);
      const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
      for (int i = 0; i < kPerVec; ++i) v[j * kPerVec + i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = to_float(x[i]);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Block-wide reductions (every thread of the block must call them; the result is valid in every thread).

__device__ __forceinline__ float block_max(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // smem may be reused by the caller
  return v;
}

__device__ __forceinline__ long long block_sum(long long v, long long* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  return v;
}

// Non-negative floats order like their bit patterns, so a max of |x| is an unsigned atomicMax.
__device__ __forceinline__ void atomic_max_nonneg(unsigned int* dst, float v) {
  atomicMax(dst, __float_as_uint(v));
}

// ---------------------------------------------------------------------------------------------------------------
// Encoders (same comparisons as csrc/cpu/quant.cpp).

// Index of the nearest NF4 code: the number of midpoints strictly below v (ties to the lower code).
__device__ __forceinline__ uint32_t nf4_encode(float v, const float (&mid)[15]) {
  int idx = 0;
  idx += (mid[idx + 7] < v) ? 8 : 0;
  idx += (mid[idx + 3] < v) ? 4 : 0;
  idx += (mid[idx + 1] < v) ? 2 : 0;
  idx += (mid[idx] < v) ? 1 : 0;
  return static_cast<uint32_t>(idx);
}

// Nearest E2M1 value, ties to the even code, saturating at +-6; sign from the sign bit.
__device__ __forceinline__ uint32_t e2m1_encode(float v) {
  const float a = fabsf(v);
  const uint32_t c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return c | (signbit(v) ? 8u : 0u);
}

// The NF4 absmax offset from the device-side max and exact fixed-point sum (nf4_offset() in csrc/cpu/quant.cpp).
__device__ __forceinline__ int nf4_offset_shift(float amax) {
  int e = 0;
  frexpf(amax, &e);
  return 32 - e;
}
__device__ __forceinline__ float nf4_offset_value(float amax, long long total, int64_t nb) {
  if (amax == 0.0f) return 0.0f;
  const double mean = __ddiv_rn(static_cast<double>(total), static_cast<double>(nb));
  return __double2float_rn(ldexp(mean, -nf4_offset_shift(amax)));
}

// ---------------------------------------------------------------------------------------------------------------
// NF4 quantize: four kernels (absmax + its max; fixed-point sum; per-group double quantisation; codes).
// Thread layout of the first and last: one thread per 16 consecutive weights, four threads per block of 64.

template <typename T, bool kVec>
__global__ void nf4_absmax_kernel(const T* __restrict__ x, int64_t nchunks, float* __restrict__ absmax,
                                  unsigned int* __restrict__ amax_bits) {
  __shared__ float smem[32];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float m = 0.0f;
  if (c < nchunks) {
    float v[16];
    load16<T, kVec>(x + c * 16, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
  }
  // nchunks is a multiple of 4 and blocks a multiple of 32 threads: a lane quad is all in range or all out.
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  if (c < nchunks && (c & 3) == 0) absmax[c / 4] = m;
  m = block_max(m, smem);
  if (threadIdx.x == 0) atomic_max_nonneg(amax_bits, m);
}

__global__ void nf4_fixed_sum_kernel(const float* __restrict__ absmax, int64_t nb,
                                     const unsigned int* __restrict__ amax_bits,
                                     unsigned long long* __restrict__ total) {
  __shared__ long long smem[32];
  const float amax = __uint_as_float(*amax_bits);
  const int k = nf4_offset_shift(amax);
  long long s = 0;
  if (amax != 0.0f) {
    for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nb;
         b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      s += static_cast<long long>(floor(ldexp(static_cast<double>(absmax[b]), k)));
    }
  }
  s = block_sum(s, smem);
  // Integer addition is associative: the atomics' order cannot change the total.
  if (threadIdx.x == 0) atomicAdd(total, static_cast<unsigned long long>(s));
}

// One block of kNf4Group threads per group; thread i owns absmax block g * 256 + i.
__global__ void nf4_double_quant_kernel(const float* __restrict__ absmax, int64_t nb,
                                        const unsigned int* __restrict__ amax_bits,
                                        const unsigned long long* __restrict__ total,
                                        c10::Float8_e4m3fn* __restrict__ q, float* __restrict__ scale,
                                        float* __restrict__ offset_out, float* __restrict__ dq) {
  __shared__ float smem[32];
  const float offset =
      nf4_offset_value(__uint_as_float(*amax_bits), static_cast<long long>(*total), nb);
  if (blockIdx.x == 0 && threadIdx.x == 0) *offset_out = offset;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kNf4Group + threadIdx.x;
  const bool in = b < nb;
  const float centred = in ? __fsub_rn(absmax[b], offset) : 0.0f;
  const float m = block_max(fabsf(centred), smem);
  const float s = __fdiv_rn(m, kE4m3Max);
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  if (in) {
    const c10::Float8_e4m3fn qb(s > 0.0f ? __fdiv_rn(centred, s) : 0.0f);
    q[b] = qb;
    dq[b] = __fadd_rn(__fmul_rn(static_cast<float>(qb), s), offset);
  }
}

// Codes against the dequantised absmax; the even element in the high nibble. 8 output bytes per thread.
template <typename T, bool kVec>
__global__ void nf4_encode_kernel(const T* __restrict__ x, int64_t nchunks, const float* __restrict__ dq,
                                  uint8_t* __restrict__ out) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= nchunks) return;
  float mid[15];
#pragma unroll
  for (int i = 0; i < 15; ++i) mid[i] = __fmul_rn(__fadd_rn(kNf4Code[i], kNf4Code[i + 1]), 0.5f);
  const float d = dq[c / 4];
  float v[16];
  load16<T, kVec>(x + c * 16, v);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const uint32_t c0 = nf4_encode(d != 0.0f ? __fdiv_rn(v[i], d) : 0.0f, mid);
    const uint32_t c1 = nf4_encode(d != 0.0f ? __fdiv_rn(v[i + 1], d) : 0.0f, mid);
    w[i / 8] |= ((c0 << 4) | c1) << (8 * ((i / 2) % 4));  // little-endian: byte i/2 of the 8
  }
  *reinterpret_cast<uint2*>(out + c * 8) = make_uint2(w[0], w[1]);  // out is fresh: 8-byte aligned
}

// ---------------------------------------------------------------------------------------------------------------
// NVFP4 quantize: two kernels, one thread per block of 16 weights (absmax + its max; scales and codes).

template <typename T, bool kVec>
__global__ void nvfp4_absmax_kernel(const T* __restrict__ x, int64_t nb, float* __restrict__ bmax,
                                    unsigned int* __restrict__ amax_bits) {
  __shared__ float smem[32];
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float m = 0.0f;
  if (b < nb) {
    float v[16];
    load16<T, kVec>(x + b * 16, v);
#pragma unroll
    for (int i = 0; i < 16; ++i) m = fmaxf(m, fabsf(v[i]));
    bmax[b] = m;
  }
  m = block_max(m, smem);
  if (threadIdx.x == 0) atomic_max_nonneg(amax_bits, m);
}

template <typename T, bool kVec>
__global__ void nvfp4_encode_kernel(const T* __restrict__ x, int64_t nb, const float* __restrict__ bmax,
                                    const unsigned int* __restrict__ amax_bits,
                                    c10::Float8_e4m3fn* __restrict__ block_scale, float* __restrict__ tensor_scale,
                                    uint8_t* __restrict__ out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  // amax / (448 * 6): the CPU's constant folds to 2688, exactly representable.
  const float ts = __fdiv_rn(__uint_as_float(*amax_bits), kE4m3Max * kE2m1Max);
  if (b == 0) *tensor_scale = ts;
  const c10::Float8_e4m3fn s(ts > 0.0f ? __fdiv_rn(__fdiv_rn(bmax[b], kE2m1Max), ts) : 0.0f);
  block_scale[b] = s;
  const float t = __fmul_rn(ts, static_cast<float>(s));
  float v[16];
  load16<T, kVec>(x + b * 16, v);
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; i += 2) {
    const uint32_t c0 = t > 0.0f ? e2m1_encode(__fdiv_rn(v[i], t)) : 0u;
    const uint32_t c1 = t > 0.0f ? e2m1_encode(__fdiv_rn(v[i + 1], t)) : 0u;
    w[i / 8] |= (c0 | (c1 << 4)) << (8 * ((i / 2) % 4));  // the even element in the low nibble
  }
  *reinterpret_cast<uint2*>(out + b * 8) = make_uint2(w[0], w[1]);
}

// ---------------------------------------------------------------------------------------------------------------
// Dequantize (the hot path). Both formats pack a multiple of 8 bytes, so the packed data is read as 4-byte words
// (8 weights each) and no word is ever partial. Each thread handles kWordsPerThread words spaced one warp apart:
// word (warp * kWordsPerThread + j) * 32 + lane. Every load instruction then reads 128 contiguous bytes per warp and
// every store instruction writes 8 * 32 contiguous weights (16 bytes per lane, 512 per warp for bf16 / fp16; fp32
// takes two 16-byte stores per word), all loads issued before the first use. The code tables sit in shared memory:
// lanes index them with data-dependent nibbles, which constant memory would serialise and shared memory serves
// without conflict (16 words, 16 banks). kVec: the packed input is 4-byte aligned (a view with a storage offset may
// not be; then each word is assembled from byte loads, same values). The output is fresh, hence 16-byte aligned.
constexpr int kWordsPerThread = 4;

template <bool kVec>
__device__ __forceinline__ uint32_t load_word(const uint8_t* __restrict__ in, int64_t w) {
  if constexpr (kVec) {
    return __ldg(reinterpret_cast<const uint32_t*>(in) + w);
  } else {
    const uint8_t* p = in + 4 * w;
    return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
           (static_cast<uint32_t>(p[3]) << 24);
  }
}

// o[0..8) = v, rounded to T, as one (16-bit T) or two (fp32) 16-byte stores.
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ o, const float (&v)[8]) {
  uint4* p = reinterpret_cast<uint4*>(o);
  if constexpr (sizeof(T) == 4) {
    p[0] = make_uint4(out_bits<T>(v[0]), out_bits<T>(v[1]), out_bits<T>(v[2]), out_bits<T>(v[3]));
    p[1] = make_uint4(out_bits<T>(v[4]), out_bits<T>(v[5]), out_bits<T>(v[6]), out_bits<T>(v[7]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = out_bits<T>(v[2 * i]) | (out_bits<T>(v[2 * i + 1]) << 16);
    p[0] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// First word of this thread; its j-th word is first + 32 * j.
__device__ __forceinline__ int64_t first_word() {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  return warp * (32 * kWordsPerThread) + threadIdx.x % 32;
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) nf4_dequant_kernel(
    const uint8_t* __restrict__ in, int64_t nwords, const c10::Float8_e4m3fn* __restrict__ q,
    const float* __restrict__ scale, const float* __restrict__ offset_ptr, T* __restrict__ o) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = kNf4Code[threadIdx.x];
  __syncthreads();
  const int64_t w0 = first_word();
  uint32_t word[kWordsPerThread];
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) word[j] = w0 + 32 * j < nwords ? load_word<kVec>(in, w0 + 32 * j) : 0u;
  const float offset = __ldg(offset_ptr);
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) {
    const int64_t w = w0 + 32 * j;
    if (w >= nwords) break;
    const int64_t blk = w / (kNf4Block / 8);  // 8 words per block of 64 weights
    const float d = __fadd_rn(__fmul_rn(static_cast<float>(q[blk]), __ldg(scale + blk / kNf4Group)), offset);
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // byte i: the even weight in the high nibble
      const uint32_t byte = (word[j] >> (8 * i)) & 0xFFu;
      v[2 * i] = __fmul_rn(code[byte >> 4], d);
      v[2 * i + 1] = __fmul_rn(code[byte & 0xFu], d);
    }
    store8<T>(o + 8 * w, v);
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) nvfp4_dequant_kernel(
    const uint8_t* __restrict__ in, int64_t nwords, const c10::Float8_e4m3fn* __restrict__ block_scale,
    const float* __restrict__ ts_ptr, T* __restrict__ o) {
  __shared__ float value[16];
  if (threadIdx.x < 16) value[threadIdx.x] = kE2m1Value[threadIdx.x];
  __syncthreads();
  const int64_t w0 = first_word();
  uint32_t word[kWordsPerThread];
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) word[j] = w0 + 32 * j < nwords ? load_word<kVec>(in, w0 + 32 * j) : 0u;
  const float ts = __ldg(ts_ptr);
#pragma unroll
  for (int j = 0; j < kWordsPerThread; ++j) {
    const int64_t w = w0 + 32 * j;
    if (w >= nwords) break;
    const float t = __fmul_rn(ts, static_cast<float>(block_scale[w / (kNvfp4Block / 8)]));  // 2 words per block
    float v[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // byte i: the even weight in the low nibble
      const uint32_t byte = (word[j] >> (8 * i)) & 0xFFu;
      v[2 * i] = __fmul_rn(value[byte & 0xFu], t);
      v[2 * i + 1] = __fmul_rn(value[byte >> 4], t);
    }
    store8<T>(o + 8 * w, v);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// int8 / FP8 dequantize: w[n, k] = T(float(code) * scale[n]), one rounding (dequantize_int8_reference / _fp8_reference).
// One code per byte, so a 16-byte load holds 16 codes. Each thread handles kChunksPerThread chunks of 16 codes spaced
// one warp apart (chunk (warp * kChunksPerThread + j) * 32 + lane): every load instruction reads 512 contiguous bytes
// per warp and every store writes 16 bytes per lane (two 16-byte stores per chunk for bf16 / fp16, four for fp32), all
// loads issued before the first use. The scale is per row and a chunk may straddle one row boundary (in_features >= 16
// on the vector path), so each code picks the scale of its side. kVec: the codes are 16-byte aligned and
// in_features >= 16; otherwise (a view with a storage offset, tiny rows) each thread decodes its 16 codes one by one,
// same values. The output is fresh, hence 16-byte aligned.
constexpr int kChunksPerThread = 2;

template <bool kFp8>
__device__ __forceinline__ float decode_code(uint8_t c) {
  if constexpr (kFp8) {
    return static_cast<float>(c10::Float8_e4m3fn(c, c10::Float8_e4m3fn::from_bits()));
  } else {
    return static_cast<float>(static_cast<int8_t>(c));
  }
}

// The four codes of a little-endian 32-bit word, decoded exactly (E4M3 -> half is exact: every E4M3 value is a half).
template <bool kFp8>
__device__ __forceinline__ void decode_word(uint32_t w, float* v) {
  if constexpr (kFp8) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * h)), __NV_E4M3);
      v[2 * h] = __half2float(__ushort_as_half(r.x));  // the low byte is the low half
      v[2 * h + 1] = __half2float(__ushort_as_half(r.y));
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = static_cast<float>(static_cast<int8_t>((w >> (8 * i)) & 0xFFu));
  }
}

template <typename T, bool kFp8, bool kVec>
__global__ void __launch_bounds__(kThreads) rowwise_dequant_kernel(
    const uint8_t* __restrict__ in, int64_t n, int64_t cols, const float* __restrict__ scale, T* __restrict__ o) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t c0 = warp * (32 * kChunksPerThread) + threadIdx.x % 32;
  const int64_t nfull = n / 16;  // chunks of 16 codes
  uint4 u[kChunksPerThread];
  if constexpr (kVec) {
#pragma unroll
    for (int j = 0; j < kChunksPerThread; ++j) {
      const int64_t c = c0 + 32 * j;
      u[j] = c < nfull ? __ldg(reinterpret_cast<const uint4*>(in) + c) : make_uint4(0u, 0u, 0u, 0u);
    }
  }
  const bool narrow = n <= 0xffffffffll;  // 32-bit division where it suffices (it is ~4x cheaper)
#pragma unroll
  for (int j = 0; j < kChunksPerThread; ++j) {
    const int64_t c = c0 + 32 * j;
    const int64_t e0 = c * 16;
    if (e0 >= n) break;
    if (kVec && c < nfull) {
      float lo[8], hi[8];
      decode_word<kFp8>(u[j].x, lo);
      decode_word<kFp8>(u[j].y, lo + 4);
      decode_word<kFp8>(u[j].z, hi);
      decode_word<kFp8>(u[j].w, hi + 4);
      const int64_t row = narrow ? static_cast<int64_t>(static_cast<uint32_t>(e0) / static_cast<uint32_t>(cols))
                                 : e0 / cols;
      const int64_t next = (row + 1) * cols;  // first element of the next row
      const float s0 = __ldg(scale + row);
      const float s1 = next < e0 + 16 ? __ldg(scale + row + 1) : s0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        lo[i] = __fmul_rn(lo[i], e0 + i < next ? s0 : s1);
        hi[i] = __fmul_rn(hi[i], e0 + 8 + i < next ? s0 : s1);
      }
      store8<T>(o + e0, lo);
      store8<T>(o + e0 + 8, hi);
    } else {
      const int64_t e1 = e0 + 16 < n ? e0 + 16 : n;
      for (int64_t e = e0; e < e1; ++e) {
        o[e] = static_cast<T>(__fmul_rn(decode_code<kFp8>(in[e]), __ldg(scale + e / cols)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Per-row E4M3 quantization (quantize_rows_e4m3_reference): one block per row, a pass for the row's max |x * cs|, then
// a pass that writes the codes. kVec: x and col_scale 16-byte aligned and in_features a multiple of 8, so each thread
// reads 8 elements as 16-byte vectors and writes 8 codes as one 8-byte store. kRegs > 0 (kVec only; the row has at most
// kRegs vectors per thread, which covers rows of up to 8 * 4 * 1024 = 32768 features): each thread keeps its vectors in
// registers from the first pass to the second, so the row is read from memory once. kRegs == 0: the second pass reads
// the row again (from L1 / L2). The launcher sizes blocks for at most 2 vectors per thread up to 1024 threads (rows
// of up to 16384 features): at 256 threads a 14336-feature row held 7 vectors per thread in 89 registers, two blocks per SM,
// and ran at ~1.1 TB/s on the H200 (profile-quant-h200-65319f7.txt).
//
// Each code is e4m3(e), e = clamp(v / s, -448, 448), the division IEEE-rounded (the CPU's `/`, bit for bit). Rows whose
// max m is finite with s = m / 448 >= 2^-90 (every row of real activations) divide by Markstein's sequence with the
// row's correctly rounded reciprocal y = RN(1 / s): q = RN(v y), r = fma(-q, s, v) (exact), e = RN(q + r y). With y
// correctly rounded and q within one ulp of v / s, e is the correctly rounded quotient (Markstein 1990; Handbook of
// Floating-Point Arithmetic, 2nd ed., Theorem 5.8), the same float __fdiv_rn returns, for three instructions instead
// of __fdiv_rn's dozen and its range check. The bound on s keeps r clear of float32 underflow wherever e >= 2^-10
// (smaller e give the code 0 whatever their last bits); |v| <= m keeps |e| <= 448 (1 + 2^-23) and finite, so the clamp
// and the NaN fix below are not needed there either (cvt's .satfinite gives 448 for what lies above). Other rows
// (all-zero, NaN or inf, or tiny) take __fdiv_rn and the clamp, as before.
//
// The E4M3 rounding. c10::Float8_e4m3fn(e) (what the CPU kernel and torch's .to(float8_e4m3fn) use) is a software
// conversion of a dozen integer and float operations per element; sm_89+ converts two floats per instruction
// (cvt.rn.satfinite.e4m3x2.f32, which cuda_fp8.hpp's __nv_cvt_float2_to_fp8x2 emits there). The two give the same
// byte for every e this kernel converts (the clamp leaves only floats in [-448, 448] and NaN) once the sign and NaN
// are set as c10 sets them:
//   - 2^-6 <= |e| <= 448 (E4M3 normals): c10 adds 0x7FFFF plus the low kept mantissa bit to the float's bits and keeps
//     the top bits: round to nearest, ties to even. cvt.rn rounds to nearest even. Nothing reaches c10's carry into
//     0x7F (|e| >= 464) or cvt's .satfinite (above MAX_NORM = 448, which is 0x7E in both).
//   - |e| < 2^-6 (subnormals): c10 adds 2^14 in float32, whose ulp is 2^-9, E4M3's subnormal step, so the float32
//     addition (round to nearest even) rounds |e| to a multiple of 2^-9: 1..7 steps are subnormal codes, 8 steps the
//     smallest normal 0x08, and |e| <= 2^-10 rounds to 0 (the tie at 2^-10 to the even code 0); cvt.rn rounds the same
//     way. Float32 subnormal inputs (|e| < 2^-126) give 0 either way, flushed or not.
//   - sign: c10 converts |e| and ORs the sign bit back in, so -0.0 and a negative value rounding to 0 give 0x80.
//     cvt keeps the sign of nonzero results; for a zero result the ISA does not promise one. Hence the sign bit of e
//     is ORed into cvt's byte too (a no-op wherever cvt's sign is already e's).
//   - NaN: c10 gives 0x7F | sign (0xFF for a NaN with the sign bit set). cvt gives a NaN of unspecified sign
//     (cuda_fp8.hpp's software version canonicalises every NaN input to +NaN, 0x7F). Hence for NaN e the magnitude
//     bits 0x7F are ORed in too, giving 0x7F | sign whatever cvt returned. (A NaN e only arises in a row holding a
//     NaN; its sign is then an artefact of each device's arithmetic, which is why tests compare NaN rows across
//     devices only as NaN.)
// So the byte is cvt(e) | sign(e) | (isnan(e) ? 0x7F : 0) on sm_89+, c10's conversion elsewhere.
// tests/gpu/test_quant_fp8_cuda.py checks every finite bfloat16 value (and random float32 ones) against the CPU.

// max that propagates NaN, as torch.amax does (arguments are |v| >= 0 or NaN).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ float block_nan_max(float v, float* smem) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : 0.0f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  return v;
}

// x[0..8) as float, from 16-byte vectors (x 16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ x, float (&v)[8]) {
  constexpr int kPerVec = 16 / sizeof(T);
  const uint4* p = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int j = 0; j < 8 / kPerVec; ++j) {
    const uint4 u = __ldg(p + j);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < kPerVec; ++i) v[j * kPerVec + i] = to_float(e[i]);
  }
}

// v = x[8c, 8c + 8) of the row, times col_scale (one float32 product each) where there is one.
template <typename T>
__device__ __forceinline__ void load_row8(const T* __restrict__ xr, const float* __restrict__ col_scale, int64_t c,
                                          float (&v)[8]) {
  load8<T>(xr + 8 * c, v);
  if (col_scale != nullptr) {
    float cs[8];
    load8<float>(col_scale + 8 * c, cs);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(v[i], cs[i]);
  }
}

// e = clamp(v / s, -448, 448); 0 where s == 0. A NaN s (a NaN in the row) gives NaN, as the reference; the clamp keeps
// NaN, as torch.clamp does.
__device__ __forceinline__ float e4m3_input(float v, float s) {
  const float e = s != 0.0f ? __fdiv_rn(v, s) : 0.0f;
  return e > kE4m3Max ? kE4m3Max : (e < -kE4m3Max ? -kE4m3Max : e);
}

// E4M3 bytes of a and b (a in the low byte) for a, b in [-448, 448] or NaN: c10::Float8_e4m3fn's bits (see above).
__device__ __forceinline__ uint32_t e4m3x2_bits(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint32_t r = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t fa = ((__float_as_uint(a) >> 24) & 0x80u) | (a != a ? 0x7Fu : 0u);
  const uint32_t fb = ((__float_as_uint(b) >> 24) & 0x80u) | (b != b ? 0x7Fu : 0u);
  return r | fa | (fb << 8);
#else
  return static_cast<uint32_t>(c10::Float8_e4m3fn(a).x) | (static_cast<uint32_t>(c10::Float8_e4m3fn(b).x) << 8);
#endif
}

// The 8 codes of v for row scale s, as one 8-byte store (q 8-byte aligned); byte i is v[i]'s code.
__device__ __forceinline__ void store_codes8(uint8_t* __restrict__ q, const float (&v)[8], float s) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w[h] = e4m3x2_bits(e4m3_input(v[4 * h], s), e4m3_input(v[4 * h + 1], s)) |
           (e4m3x2_bits(e4m3_input(v[4 * h + 2], s), e4m3_input(v[4 * h + 3], s)) << 16);
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
}

// Whether the row of max m takes the fast division (see above): finite m with m / 448 >= 2^-90.
__device__ __forceinline__ bool fast_row(float m, float s) { return m <= 3.0e38f && s >= 8.0779356e-28f; }

// v / s, correctly rounded, for y = RN(1 / s) of a fast row (Markstein). With v's sign put back: for v = -0 the
// sequence gives +0 (q = -0, r = +0 + -0 = +0, e = +0 + -0 = +0) where the IEEE quotient is -0 (the first H200 run
// of this path failed the signed-zero tests); every other e has v's sign already (s, y > 0).
__device__ __forceinline__ float fast_div(float v, float s, float y) {
  const float q = __fmul_rn(v, y);
  return copysignf(__fmaf_rn(__fmaf_rn(-q, s, v), y, q), v);
}

// The 8 codes of v of a fast row (scale s, reciprocal y): cvt plus the sign bits (for results that round to 0).
__device__ __forceinline__ void store_codes8_fast(uint8_t* __restrict__ q, const float (&v)[8], float s, float y) {
  uint32_t w[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float e[4];
    uint32_t sign = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      e[i] = fast_div(v[4 * h + i], s, y);
      sign |= ((__float_as_uint(e[i]) >> 24) & 0x80u) << (8 * i);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(e[0], e[1]), __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(e[2], e[3]), __NV_SATFINITE, __NV_E4M3);
    w[h] = (lo | (hi << 16)) | sign;
#else
    w[h] = e4m3x2_bits(e4m3_input(e[0], 1.0f), e4m3_input(e[1], 1.0f)) |
           (e4m3x2_bits(e4m3_input(e[2], 1.0f), e4m3_input(e[3], 1.0f)) << 16);
    (void)sign;
#endif
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(w[0], w[1]);
}

constexpr int kRowThreads = 1024;  // most threads per row (block) of quantize_rows_e4m3_kernel

template <typename T, bool kVec, int kRegs>
__global__ void __launch_bounds__(kRowThreads) quantize_rows_e4m3_kernel(
    const T* __restrict__ x, int64_t cols, const float* __restrict__ col_scale, uint8_t* __restrict__ q,
    float* __restrict__ row_scale) {
  static_assert(kRegs == 0 || kVec, "the row is held in registers only on the vectorised path");
  __shared__ float smem[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * cols;
  uint8_t* qr = q + row * cols;
  float m = 0.0f;
  if constexpr (kRegs > 0) {
    const int64_t nvec = cols / 8;
    float v[kRegs][8];
#pragma unroll
    for (int j = 0; j < kRegs; ++j) {
      const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
      if (c < nvec) {
        load_row8<T>(xr, col_scale, c, v[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) m = nan_max(fabsf(v[j][i]), m);
      }
    }
    m = block_nan_max(m, smem);
    const float s = __fdiv_rn(m, kE4m3Max);
    if (threadIdx.x == 0) row_scale[row] = s;
    if (fast_row(m, s)) {
      const float y = __frcp_rn(s);
#pragma unroll
      for (int j = 0; j < kRegs; ++j) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (c < nvec) store_codes8_fast(qr + 8 * c, v[j], s, y);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kRegs; ++j) {
        const int64_t c = threadIdx.x + static_cast<int64_t>(j) * blockDim.x;
        if (c < nvec) store_codes8(qr + 8 * c, v[j], s);
      }
    }
  } else if constexpr (kVec) {
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
      float v[8];
      load_row8<T>(xr, col_scale, c, v);
#pragma unroll
      for (int i = 0; i < 8; ++i) m = nan_max(fabsf(v[i]), m);
    }
    m = block_nan_max(m, smem);
    const float s = __fdiv_rn(m, kE4m3Max);
    if (threadIdx.x == 0) row_scale[row] = s;
    const bool fast = fast_row(m, s);
    const float y = fast ? __frcp_rn(s) : 0.0f;
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
      float v[8];
      load_row8<T>(xr, col_scale, c, v);
      if (fast) {
        store_codes8_fast(qr + 8 * c, v, s, y);
      } else {
        store_codes8(qr + 8 * c, v, s);
      }
    }
  } else {
    for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) {
      const float v = to_float(xr[k]);
      m = nan_max(fabsf(col_scale != nullptr ? __fmul_rn(v, __ldg(col_scale + k)) : v), m);
    }
    m = block_nan_max(m, smem);
    const float s = __fdiv_rn(m, kE4m3Max);
    if (threadIdx.x == 0) row_scale[row] = s;
    for (int64_t k = threadIdx.x; k < cols; k += blockDim.x) {
      const float v = to_float(xr[k]);
      const float e = e4m3_input(col_scale != nullptr ? __fmul_rn(v, __ldg(col_scale + k)) : v, s);
      qr[k] = static_cast<uint8_t>(e4m3x2_bits(e, 0.0f) & 0xFFu);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Byte transpose (the FP8 backward's column-major weight). Tiles of 64 x 64 bytes staged in shared memory: each of
// the 256 threads reads 16 contiguous bytes of one input row (a warp reads 8 rows x 64 bytes) and writes 16
// contiguous bytes of one output row, gathered down a column of the tile. The tile's pitch of 68 bytes keeps those
// column reads at most 2-way bank-conflicted. Edge tiles, and rows whose length is not a multiple of 16 bytes, go
// byte by byte (same result).
constexpr int kTile = 64, kTilePitch = 68;

__global__ void __launch_bounds__(kThreads) transpose_bytes_kernel(const uint8_t* __restrict__ in, int64_t rows,
                                                                   int64_t cols, bool vec_in, bool vec_out,
                                                                   uint8_t* __restrict__ out) {
  __shared__ uint32_t tile_words[kTile * kTilePitch / 4];
  uint8_t* tile = reinterpret_cast<uint8_t*>(tile_words);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int a = threadIdx.x / 4, b = (threadIdx.x % 4) * 16;  // tile row a, bytes [b, b + 16)
  {
    const int64_t r = r0 + a, c = c0 + b;
    uint32_t* dst = reinterpret_cast<uint32_t*>(tile + a * kTilePitch + b);
    if (vec_in && r < rows && c + 16 <= cols) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(in + r * cols + c));
      dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) tile[a * kTilePitch + b + i] = (r < rows && c + i < cols) ? in[r * cols + c + i] : 0;
    }
  }
  __syncthreads();
  // Output row c0 + a (input column), bytes [r0 + b, r0 + b + 16) (input rows).
  const int64_t orow = c0 + a, ocol = r0 + b;
  if (orow >= cols) return;
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    w[k] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) w[k] |= static_cast<uint32_t>(tile[(b + 4 * k + i) * kTilePitch + a]) << (8 * i);
  }
  if (vec_out && ocol + 16 <= rows) {
    *reinterpret_cast<uint4*>(out + orow * rows + ocol) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    for (int i = 0; i < 16 && ocol + i < rows; ++i) out[orow * rows + ocol + i] = (w[i / 4] >> (8 * (i % 4))) & 0xFFu;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Host side: checks (same messages and exception types as the CPU kernels), dtype dispatch, launches.

using quant::check_out_dtype;
using quant::check_weight;

void check_buffer(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                  at::IntArrayRef sizes, const at::Device& device) {
  quant::check_buffer(t, op, name, dtype, sizes);
  TORCH_CHECK(t.device() == device, op, ": ", name, " must be on ", device, " like data, got ", t.device());
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of kThreads threads for n threads.
unsigned int grid_for(int64_t n) {
  const int64_t g = ceil_div(n, kThreads);
  TORCH_CHECK(g <= 0x7fffffff, "trainstream: tensor too large for one launch (", n, " work items)");
  return static_cast<unsigned int>(g);
}

// Calls fn(T{}, std::bool_constant<vec>{}) with T the tensor's element type (float / BFloat16 / Half).
template <typename Fn>
void dispatch_float(at::ScalarType t, bool vec, Fn&& fn) {
  auto with_vec = [&](auto tag) {
    if (vec) {
      fn(tag, std::true_type{});
    } else {
      fn(tag, std::false_type{});
    }
  };
  switch (t) {
    case at::kFloat: with_vec(float{}); break;
    case at::kBFloat16: with_vec(c10::BFloat16{}); break;
    case at::kHalf: with_vec(c10::Half{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "unchecked float dtype ", t);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nf4_cuda(const at::Tensor& weight) {
  check_weight(weight, "quantize_nf4", kNf4Block);
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1);
  const int64_t nb = w.numel() / kNf4Block, ng = (nb + kNf4Group - 1) / kNf4Group, nchunks = nb * 4;
  TORCH_CHECK(ng <= 0x7fffffff, "quantize_nf4: weight too large (", w.numel(), " elements)");
  const auto opts = w.options();
  at::Tensor data = at::empty({rows, cols / 2}, opts.dtype(at::kByte));
  at::Tensor absmax_q = at::empty({nb}, opts.dtype(at::kFloat8_e4m3fn));
  at::Tensor absmax_scale = at::empty({ng}, opts.dtype(at::kFloat));
  at::Tensor absmax_offset = at::empty({}, opts.dtype(at::kFloat));
  at::Tensor absmax = at::empty({nb}, opts.dtype(at::kFloat));
  at::Tensor dq = at::empty({nb}, opts.dtype(at::kFloat));
  // [0]: max absmax as float bits; [1..2]: the int64 fixed-point sum. Zeroed on the stream (no host sync).
  at::Tensor scratch = at::zeros({4}, opts.dtype(at::kInt));
  auto* amax_bits = reinterpret_cast<unsigned int*>(scratch.data_ptr<int32_t>());
  auto* total = reinterpret_cast<unsigned long long*>(scratch.data_ptr<int32_t>() + 2);  // 8-byte aligned
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  auto* q = absmax_q.data_ptr<c10::Float8_e4m3fn>();

  dispatch_float(w.scalar_type(), aligned16(w.data_ptr()), [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(vec)::value;
    const T* x = reinterpret_cast<const T*>(w.data_ptr());
    nf4_absmax_kernel<T, kVec><<<grid_for(nchunks), kThreads, 0, stream>>>(x, nchunks, absmax.data_ptr<float>(),
                                                                           amax_bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const unsigned int sum_grid = std::min<unsigned int>(grid_for(nb), 1024u);
    nf4_fixed_sum_kernel<<<sum_grid, kThreads, 0, stream>>>(absmax.data_ptr<float>(), nb, amax_bits, total);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nf4_double_quant_kernel<<<static_cast<unsigned int>(ng), kNf4Group, 0, stream>>>(
        absmax.data_ptr<float>(), nb, amax_bits, total, q, absmax_scale.data_ptr<float>(),
        absmax_offset.data_ptr<float>(), dq.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nf4_encode_kernel<T, kVec><<<grid_for(nchunks), kThreads, 0, stream>>>(x, nchunks, dq.data_ptr<float>(),
                                                                           data.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, absmax_q, absmax_scale, absmax_offset};
}

at::Tensor dequantize_nf4_cuda(const at::Tensor& data, const at::Tensor& absmax_q, const at::Tensor& absmax_scale,
                               const at::Tensor& absmax_offset, at::ScalarType dtype) {
  TORCH_CHECK(data.dim() == 2, "dequantize_nf4: data must be 2-D (out_features, in_features / 2), got shape ",
              data.sizes());
  TORCH_CHECK(data.scalar_type() == at::kByte, "dequantize_nf4: data must be uint8, got ", data.scalar_type());
  TORCH_CHECK((data.size(1) * 2) % kNf4Block == 0, "dequantize_nf4: in_features (", data.size(1) * 2,
              ") must be a multiple of ", kNf4Block);
  check_out_dtype(dtype, "dequantize_nf4");
  TORCH_CHECK(data.is_cuda(), "dequantize_nf4: data must be a CUDA tensor, got ", data.device());
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  const int64_t nb = rows * cols / kNf4Block, ng = (nb + kNf4Group - 1) / kNf4Group;
  check_buffer(absmax_q, "dequantize_nf4", "absmax_q", at::kFloat8_e4m3fn, {nb}, data.device());
  check_buffer(absmax_scale, "dequantize_nf4", "absmax_scale", at::kFloat, {ng}, data.device());
  check_buffer(absmax_offset, "dequantize_nf4", "absmax_offset", at::kFloat, {}, data.device());
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor dc = data.contiguous(), qc = absmax_q.contiguous(), sc = absmax_scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  const int64_t nwords = dc.numel() / 4;  // a multiple of 8 bytes (a block is 32 NF4 / 8 NVFP4 bytes)
  if (nwords == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(dtype, reinterpret_cast<uintptr_t>(dc.data_ptr()) % 4 == 0, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(vec)::value;
    nf4_dequant_kernel<T, kVec><<<grid_for(ceil_div(nwords, kWordsPerThread * 32) * 32), kThreads, 0, stream>>>(
        dc.data_ptr<uint8_t>(), nwords, qc.data_ptr<c10::Float8_e4m3fn>(), sc.data_ptr<float>(),
        absmax_offset.data_ptr<float>(), reinterpret_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4_cuda(const at::Tensor& weight) {
  check_weight(weight, "quantize_nvfp4", kNvfp4Block);
  const c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1), nb = w.numel() / kNvfp4Block;
  const auto opts = w.options();
  at::Tensor data = at::empty({rows, cols / 2}, opts.dtype(at::kByte));
  at::Tensor block_scale = at::empty({rows, cols / kNvfp4Block}, opts.dtype(at::kFloat8_e4m3fn));
  at::Tensor tensor_scale = at::empty({}, opts.dtype(at::kFloat));
  at::Tensor bmax = at::empty({nb}, opts.dtype(at::kFloat));
  at::Tensor amax = at::zeros({1}, opts.dtype(at::kInt));  // max |w| as float bits
  auto* amax_bits = reinterpret_cast<unsigned int*>(amax.data_ptr<int32_t>());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  dispatch_float(w.scalar_type(), aligned16(w.data_ptr()), [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(vec)::value;
    const T* x = reinterpret_cast<const T*>(w.data_ptr());
    nvfp4_absmax_kernel<T, kVec><<<grid_for(nb), kThreads, 0, stream>>>(x, nb, bmax.data_ptr<float>(), amax_bits);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    nvfp4_encode_kernel<T, kVec><<<grid_for(nb), kThreads, 0, stream>>>(
        x, nb, bmax.data_ptr<float>(), amax_bits, block_scale.data_ptr<c10::Float8_e4m3fn>(),
        tensor_scale.data_ptr<float>(), data.data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {data, block_scale, tensor_scale};
}

at::Tensor dequantize_nvfp4_cuda(const at::Tensor& data, const at::Tensor& block_scale,
                                 const at::Tensor& tensor_scale, at::ScalarType dtype) {
  TORCH_CHECK(data.dim() == 2, "dequantize_nvfp4: data must be 2-D (out_features, in_features / 2), got shape ",
              data.sizes());
  TORCH_CHECK(data.scalar_type() == at::kByte, "dequantize_nvfp4: data must be uint8, got ", data.scalar_type());
  TORCH_CHECK((data.size(1) * 2) % kNvfp4Block == 0, "dequantize_nvfp4: in_features (", data.size(1) * 2,
              ") must be a multiple of ", kNvfp4Block);
  check_out_dtype(dtype, "dequantize_nvfp4");
  TORCH_CHECK(data.is_cuda(), "dequantize_nvfp4: data must be a CUDA tensor, got ", data.device());
  const int64_t rows = data.size(0), cols = data.size(1) * 2;
  check_buffer(block_scale, "dequantize_nvfp4", "block_scale", at::kFloat8_e4m3fn, {rows, cols / kNvfp4Block},
               data.device());
  check_buffer(tensor_scale, "dequantize_nvfp4", "tensor_scale", at::kFloat, {}, data.device());
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor dc = data.contiguous(), sc = block_scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  const int64_t nwords = dc.numel() / 4;  // a multiple of 8 bytes (a block is 32 NF4 / 8 NVFP4 bytes)
  if (nwords == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(dtype, reinterpret_cast<uintptr_t>(dc.data_ptr()) % 4 == 0, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(vec)::value;
    nvfp4_dequant_kernel<T, kVec><<<grid_for(ceil_div(nwords, kWordsPerThread * 32) * 32), kThreads, 0, stream>>>(
        dc.data_ptr<uint8_t>(), nwords, sc.data_ptr<c10::Float8_e4m3fn>(), tensor_scale.data_ptr<float>(),
        reinterpret_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

namespace {

template <bool kFp8>
at::Tensor dequantize_rowwise_cuda(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype,
                                   const char* op) {
  const at::ScalarType code_type = kFp8 ? at::kFloat8_e4m3fn : at::kChar;
  TORCH_CHECK(data.dim() == 2, op, ": data must be 2-D (out_features, in_features), got shape ", data.sizes());
  TORCH_CHECK(data.scalar_type() == code_type, op, ": data must be ", code_type, ", got ", data.scalar_type());
  check_out_dtype(dtype, op);
  TORCH_CHECK(data.is_cuda(), op, ": data must be a CUDA tensor, got ", data.device());
  const int64_t rows = data.size(0), cols = data.size(1);
  check_buffer(scale, op, "scale", at::kFloat, {rows}, data.device());
  const c10::cuda::CUDAGuard guard(data.device());
  const at::Tensor dc = data.contiguous(), sc = scale.contiguous();
  at::Tensor out = at::empty({rows, cols}, data.options().dtype(dtype));
  const int64_t n = out.numel();
  if (n == 0) return out;
  const int64_t threads = ceil_div(ceil_div(n, 16), 32 * kChunksPerThread) * 32;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(dtype, aligned16(dc.data_ptr()) && cols >= 16, [&](auto tag, auto vec) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(vec)::value;
    rowwise_dequant_kernel<T, kFp8, kVec><<<grid_for(threads), kThreads, 0, stream>>>(
        reinterpret_cast<const uint8_t*>(dc.data_ptr()), n, cols, sc.data_ptr<float>(),
        reinterpret_cast<T*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

at::Tensor dequantize_int8_cuda(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  return dequantize_rowwise_cuda<false>(data, scale, dtype, "dequantize_int8");
}

at::Tensor dequantize_fp8_cuda(const at::Tensor& data, const at::Tensor& scale, at::ScalarType dtype) {
  return dequantize_rowwise_cuda<true>(data, scale, dtype, "dequantize_fp8");
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_e4m3_cuda(const at::Tensor& x,
                                                           const std::optional<at::Tensor>& col_scale) {
  TORCH_CHECK_VALUE(x.dim() == 2, "quantize_rows_e4m3: x must be 2-D (tokens, features), got shape ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf,
                   "quantize_rows_e4m3: x must be float32, bfloat16 or float16, got ", t);
  TORCH_CHECK(x.is_cuda(), "quantize_rows_e4m3: x must be a CUDA tensor, got ", x.device());
  const int64_t rows = x.size(0), cols = x.size(1);
  TORCH_CHECK_VALUE(cols > 0, "quantize_rows_e4m3: x has no features (shape ", x.sizes(), ")");
  TORCH_CHECK(rows <= 0x7fffffff, "quantize_rows_e4m3: too many rows for one launch (", rows, ")");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor cs;
  if (col_scale.has_value()) {
    check_buffer(*col_scale, "quantize_rows_e4m3", "col_scale", at::kFloat, {cols}, x.device());
    cs = col_scale->contiguous();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({rows, cols}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor row_scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  if (rows == 0) return {q, row_scale};
  const float* c = cs.defined() ? cs.data_ptr<float>() : nullptr;
  const bool vec = cols % 8 == 0 && aligned16(xc.data_ptr()) && (c == nullptr || aligned16(c));
  // Threads for about two vectors (elements off the vector path) each, in whole warps, 32 to kRowThreads.
  const int64_t work = vec ? cols / 8 : cols;
  const int threads = static_cast<int>(
      std::min<int64_t>(kRowThreads, std::max<int64_t>(32, ceil_div(ceil_div(work, 2), 32) * 32)));
  // Vectors per thread, rounded up to a power of two: how many the kernel holds in registers (0: rows too long for
  // that, read twice).
  const int64_t per_thread = ceil_div(work, threads);
  const int regs = !vec ? 0 : per_thread <= 1 ? 1 : per_thread <= 2 ? 2 : per_thread <= 4 ? 4 : 0;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  dispatch_float(t, vec, [&](auto tag, auto v) {
    using T = decltype(tag);
    constexpr bool kVec = decltype(v)::value;
    auto launch = [&](auto held) {
      constexpr int kRegs = decltype(held)::value;
      quantize_rows_e4m3_kernel<T, kVec, kRegs><<<static_cast<unsigned int>(rows), threads, 0, stream>>>(
          reinterpret_cast<const T*>(xc.data_ptr()), cols, c, reinterpret_cast<uint8_t*>(q.data_ptr()),
          row_scale.data_ptr<float>());
    };
    if constexpr (kVec) {
      switch (regs) {
        case 1: launch(std::integral_constant<int, 1>{}); break;
        case 2: launch(std::integral_constant<int, 2>{}); break;
        case 4: launch(std::integral_constant<int, 4>{}); break;
        default: launch(std::integral_constant<int, 0>{}); break;
      }
    } else {
      launch(std::integral_constant<int, 0>{});
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {q, row_scale};
}

at::Tensor transpose_bytes_cuda(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2, "transpose_bytes: x must be 2-D, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.element_size() == 1, "transpose_bytes: x must have 1-byte elements, got ", x.scalar_type());
  TORCH_CHECK(x.is_cuda(), "transpose_bytes: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), cols = xc.size(1);
  at::Tensor out = at::empty({cols, rows}, xc.options());
  if (rows == 0 || cols == 0) return out;
  TORCH_CHECK(ceil_div(rows, kTile) <= 65535, "transpose_bytes: too many rows for one launch (", rows, ")");
  TORCH_CHECK(ceil_div(cols, kTile) <= 0x7fffffff, "transpose_bytes: too many columns for one launch (", cols, ")");
  const dim3 grid(static_cast<unsigned int>(ceil_div(cols, kTile)), static_cast<unsigned int>(ceil_div(rows, kTile)));
  const auto* in = reinterpret_cast<const uint8_t*>(xc.data_ptr());
  auto* o = reinterpret_cast<uint8_t*>(out.data_ptr());
  transpose_bytes_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      in, rows, cols, cols % 16 == 0 && aligned16(in), rows % 16 == 0 && aligned16(o), o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace trainstream


TORCH_LIBRARY_IMPL(trainstream, CUDA, m) {
  m.impl("quantize_nf4", &trainstream::quantize_nf4_cuda);
  m.impl("dequantize_nf4", &trainstream::dequantize_nf4_cuda);
  m.impl("quantize_nvfp4", &trainstream::quantize_nvfp4_cuda);
  m.impl("dequantize_nvfp4", &trainstream::dequantize_nvfp4_cuda);
  m.impl("dequantize_int8", &trainstream::dequantize_int8_cuda);
  m.impl("dequantize_fp8", &trainstream::dequantize_fp8_cuda);
  m.impl("quantize_rows_e4m3", &trainstream::quantize_rows_e4m3_cuda);
  m.impl("transpose_bytes", &trainstream::transpose_bytes_cuda);
}
