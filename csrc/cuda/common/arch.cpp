#include "cuda/common/arch.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

namespace cake {

KernelArch select_kernel_arch(int device, const char* op) {
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  const int cc = prop->major * 10 + prop->minor;
#ifdef CAKE_HAS_SM90
  // sm_90a code runs on compute capability 9.0 exactly (H100, H200, GH200).
  if (cc == 90) return KernelArch::kSm90;
#endif
  TORCH_CHECK(false, op, ": no kernel for this GPU: ", prop->name, " is sm_", cc,
              ", but this build of cake_ops has kernels for [sm_", CAKE_CUDA_ARCHS_STR,
              "] only (set CAKE_CUDA_ARCHS when building; cake_ops has Hopper sm_90a kernels)");
}

}  // namespace cake
