// Grouped GEMM forward, bf16 -> bf16: 128x128x64 cooperative tiles, 2x1 clusters.
#include "cuda/grouped_gemm/grouped_gemm_sm90.cuh"

namespace cake::sm90 {

using FwdBf16 = GroupedGemmConfig<Kind::kFwd, cutlass::bfloat16_t, Shape<_128, _128, _64>,
                                  Shape<_2, _1, _1>>;

void grouped_gemm_fwd_bf16(const GroupedGemmParams& p, cudaStream_t stream) {
  run_grouped_gemm<FwdBf16>(p, stream);
}

}  // namespace cake::sm90
