// Layout constants and code tables of the NF4 and NVFP4 formats, shared by the CPU kernels
// (csrc/cpu/quant.cpp) and the CUDA kernels (csrc/cuda/quant.cu) so the two cannot drift apart. The tables
// are macros because the CPU keeps them in constexpr arrays and CUDA in __constant__ memory.
#pragma once

#include <cstdint>

namespace trainstream {
namespace quant {

constexpr int64_t kNf4Block = 64;    // weights per absmax
constexpr int64_t kNf4Group = 256;   // absmax values per double-quantisation scale
constexpr int64_t kNvfp4Block = 16;  // weights per E4M3 block scale
constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;

}  // namespace quant
}  // namespace trainstream

// bitsandbytes' NF4 code (bitsandbytes/backends/utils.py, _NF4_QUANT_TABLE); same values as ops.NF4_CODE.
#define TRAINSTREAM_NF4_CODE                                                                                  \
  {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,          \
   -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,           \
   0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,                    \
   0.7229568362236023f, 1.0f}

// E2M1 code -> value; bit 3 is the sign.
#define TRAINSTREAM_E2M1_VALUES \
  {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f}
