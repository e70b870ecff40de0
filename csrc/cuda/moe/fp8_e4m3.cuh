// Per-tensor e4m3 quantization, shared by the quantize / gather kernels and the decode GEMM: the
// numbers of the CPU implementation (quantize_fp8 in moe_ops.cpp), bit for bit.
#pragma once

#include <cuda_fp8.h>

#include "moe_checks.h"

namespace cake::sm90 {

// max(amax, kFp8MinAmax) / 448, correctly rounded, NaN kept.
__device__ __forceinline__ float amax_to_scale(float amax) {
  return isnan(amax) ? amax : __fdiv_rn(fmaxf(amax, kFp8MinAmax), kE4m3Max);
}

// e4m3(clamp(v / scale, -448, 448)), round to nearest even, NaN kept.
__device__ __forceinline__ __nv_fp8_storage_t quantize_e4m3(float v, float scale) {
  float q = __fdiv_rn(v, scale);
  if (!isnan(q)) q = fminf(fmaxf(q, -kE4m3Max), kE4m3Max);
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace cake::sm90
