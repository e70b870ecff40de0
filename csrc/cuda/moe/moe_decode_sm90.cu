// Decode-sized MoE GEMMs, one GEMM per launch (the building blocks and their design: moe_decode.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cassert>
#include <climits>

#include "cuda/common/pdl.cuh"
#include "cuda/moe/moe_decode.cuh"

namespace cake::sm90 {
namespace {

template <class T, bool kSwiGLU>
__global__ void __launch_bounds__(kThreads, 2) moe_decode_gemm_kernel(DecodeParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;
  uint8_t* b = smem + kRingBytes;
  float* tile = reinterpret_cast<float*>(b + kBBytes);
  pdl_wait();
  pdl_launch_dependents();
  const int64_t kept = min64(p.offsets[p.num_experts], p.rows);
  const int m_tile = blockIdx.x;
  if (kSwiGLU && blockIdx.y == gridDim.y - 1) {
    // The last slot row zeroes the rows that belong to no expert (the op's contract).
    const int inter = p.n / 2;
    for (int64_t i = kept * 16 + threadIdx.x; i < p.rows * 16; i += kThreads) {
      const int64_t row = i / 16;
      *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(p.out) + (row * inter + m_tile * 32) * 2 + (i % 16) * 4) = 0;
    }
    return;
  }
  const int e = nth_expert_with_rows(p.offsets, p.num_experts, blockIdx.y);
  if (e < 0) return;
  const int64_t row_begin = p.offsets[e], row_end = min64(p.offsets[e + 1], kept);
  if constexpr (kSwiGLU) {
    // The gather's indices, checked before any wgmma. A trap, not the gather kernel's assert with
    // its message: any call in the kernel makes ptxas serialize every wgmma (C7510). It stops the
    // kernel all the same ("unspecified launch failure"; test_bad_gather_indices_on_gpu_fail_loudly).
    for (int64_t row = row_begin + threadIdx.x; row < row_end; row += kThreads) {
      const int32_t expanded = p.permuted_to_expanded[row];
      if (expanded < 0 || expanded >= p.a_rows) {
        __trap();
      }
    }
  }
  const uint8_t* warp_rows = warp_weight_rows(p, e, m_tile);
  float a_scale = 1.0f;
  for (int64_t first = row_begin; first < row_end; first += kRowsPerPass) {
    const Pass s = make_pass(p, first, row_end);
    const bool first_pass = first == row_begin;
    if (s.blocks == 1) {
      pass_product<T, kSwiGLU, 1>(p, s, warp_rows, first_pass, a_scale, ring, b, tile);
    } else {
      pass_product<T, kSwiGLU, kNBlocks>(p, s, warp_rows, first_pass, a_scale, ring, b, tile);
    }
    write_pass<T, kSwiGLU>(p, s, e, m_tile, a_scale * (p.w_scale ? p.w_scale[e] : 1.0f), tile);
  }
}

template <class T, bool kSwiGLU>
void launch(const DecodeParams& p, cudaStream_t stream, bool pdl) {
  const int64_t slots = std::min<int64_t>(p.num_experts, p.rows);
  const dim3 grid(p.n / kTileM, static_cast<unsigned>(slots + (kSwiGLU ? 1 : 0)));
  allow_dynamic_smem(reinterpret_cast<const void*>(moe_decode_gemm_kernel<T, kSwiGLU>), kSmemBytes);
  launch_kernel(moe_decode_gemm_kernel<T, kSwiGLU>, grid, dim3(kThreads), kSmemBytes, stream, pdl, p);
}

}  // namespace

bool moe_decode_gemm_fits(int64_t n, int64_t k_bytes, int64_t num_experts) {
  return n > 0 && n % 64 == 0 && n <= INT_MAX && k_bytes > 0 && k_bytes % kMoeDecodeStepBytes == 0 &&
         k_bytes <= INT_MAX / 2 && num_experts < 65535;
}

void moe_decode_gemm(const MoeDecodeGemmArgs& a, MoeDecodeElement element, bool swiglu, cudaStream_t stream,
                     bool pdl) {
  if (a.rows == 0) return;
  DecodeParams p;
  p.a = static_cast<const uint8_t*>(a.a);
  p.a_rows = a.a_rows;
  p.permuted_to_expanded = a.permuted_to_expanded;
  p.top_k = a.top_k;
  p.w = static_cast<const uint8_t*>(a.w);
  p.offsets = a.offsets;
  p.num_experts = a.num_experts;
  p.rows = a.rows;
  p.n = static_cast<int>(a.n);
  p.k_bytes = static_cast<int>(a.k_bytes);
  p.a_scale = a.a_scale;
  p.w_scale = a.w_scale;
  p.limits = a.limits;
  p.w_gate_up = swiglu && a.w_gate_up;
  p.out = a.out;
  p.quantize_a = a.quantize_a;
  p.a_elements = a.a_elements;
  switch (element) {
    case MoeDecodeElement::kBFloat16:
      return swiglu ? launch<__nv_bfloat16, true>(p, stream, pdl) : launch<__nv_bfloat16, false>(p, stream, pdl);
    case MoeDecodeElement::kHalf:
      return swiglu ? launch<__half, true>(p, stream, pdl) : launch<__half, false>(p, stream, pdl);
    case MoeDecodeElement::kE4m3:
      return swiglu ? launch<E4m3, true>(p, stream, pdl) : launch<E4m3, false>(p, stream, pdl);
  }
}

}  // namespace cake::sm90
