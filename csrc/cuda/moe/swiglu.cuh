// SwiGLU, and StepFun's SwiGLUStep with a limit, of one (up, gate) pair already rounded to the
// activation type, in float32 with the roundings spelled out (no contraction): every kernel that
// applies it (the SwiGLU kernel, the decode kernel's epilogue, the grouped GEMM's SwiGLU epilogue)
// gives the same bits.
#pragma once

#include <cuda_runtime.h>

namespace cake {

__device__ __forceinline__ float swiglu_value(float up, float gate, bool step, float limit) {
  const float silu = __fdiv_rn(gate, 1.0f + expf(-gate));
  return step ? __fmul_rn(fminf(silu, limit), fmaxf(fminf(up, limit), -limit)) : __fmul_rn(silu, up);
}

}  // namespace cake
