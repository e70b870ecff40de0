// The MoE ops on CUDA: for now the backend-independent implementations of moe/moe_ops.cpp
// (ATen kernels and the SM90 grouped GEMM, no host synchronisation); the fused SM90 kernels of
// issue 4 replace them here.
#include "moe/moe_ops.h"

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  cake::register_moe_ops(m);
}
