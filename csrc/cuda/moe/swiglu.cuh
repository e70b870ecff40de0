// SwiGLU, and StepFun's SwiGLUStep with a limit, of one (up, gate) pair already rounded to the
// activation type, in float32 with the roundings spelled out (no contraction): every kernel that
// applies it (the SwiGLU kernel, the decode kernel's epilogue, the grouped GEMM's SwiGLU epilogue)
// gives the same bits.
#pragma once

#include <cuda_runtime.h>

namespace cake {

// silu with the hardware's exp2 and approximate division (MUFU.EX2, MUFU.RCP; ~2 ulp of float32,
// far below the bfloat16 / float16 rounding that follows): the IEEE expf and division cost ~25
// instructions, a convergence branch and a slow-path call per element, which made the SwiGLU
// epilogue ~10% of a K=4096 GEMM1 tile (benchmarks/NOTES.md, sessions 10-11). A large negative gate
// gives exp = inf and silu = -0, the exact formula's limit.
__device__ __forceinline__ float swiglu_value(float up, float gate, bool step, float limit) {
  const float silu = __fdividef(gate, __fadd_rn(1.0f, __expf(-gate)));
  return step ? __fmul_rn(fminf(silu, limit), fmaxf(fminf(up, limit), -limit)) : __fmul_rn(silu, up);
}

}  // namespace cake
