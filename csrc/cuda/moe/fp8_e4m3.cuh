// Per-tensor e4m3 quantization, shared by the quantize / gather kernels and the decode GEMM: the
// numbers of the CPU implementation (quantize_fp8 in moe_ops.cpp), bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }

template <class T>
constexpr int kQuantVec = 16 / sizeof(T);

// The amax is a max over the bits of |x|: for non-negative floats the unsigned order is the float
// order and NaN sorts above every number, so NaN propagates. This thread's share: elements first,
// first + stride, ... in 16-byte vectors (x 16-byte aligned), then the last few one by one.
template <class T>
__device__ __forceinline__ unsigned amax_bits_strided(const T* x, int64_t n, int64_t first, int64_t stride) {
  constexpr int V = kQuantVec<T>;
  const int64_t vecs = n / V;
  constexpr int kLoads = 4;  // independent loads in flight per thread
  unsigned m = 0;
  for (int64_t i = first; i < vecs; i += kLoads * stride) {
    uint4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int64_t at = i + u * stride;
      v[u] = at < vecs ? reinterpret_cast<const uint4*>(x)[at] : make_uint4(0, 0, 0, 0);  // zeros: |0| adds nothing
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const T* e = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
      for (int j = 0; j < V; ++j) m = max(m, __float_as_uint(fabsf(load_float(e + j))));
    }
  }
  for (int64_t i = vecs * V + first; i < n; i += stride) m = max(m, __float_as_uint(fabsf(load_float(x + i))));
  return m;
}

// The max of every thread's m, in every thread of the block: all threads call it (a barrier inside);
// warp_max is shared memory of one slot per warp.
__device__ __forceinline__ unsigned block_max_bits(unsigned m, unsigned* warp_max) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  m = __reduce_max_sync(0xffffffffu, m);
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  return __reduce_max_sync(0xffffffffu, lane < int(blockDim.x >> 5) ? warp_max[lane] : 0u);
}

// The amax bits of all of x, in every thread of the block (block_max_bits: all threads call it).
template <class T>
__device__ __forceinline__ unsigned block_amax_bits(const T* x, int64_t n, unsigned* warp_max) {
  return block_max_bits(amax_bits_strided(x, n, threadIdx.x, blockDim.x), warp_max);
}

}  // namespace cake::sm90
