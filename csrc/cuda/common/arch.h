// Which architecture's kernels serve a GPU, with a clear error when this build has none.
#pragma once

namespace cake {

enum class KernelArch {
  kSm90,  // Hopper: wgmma + TMA kernels, compiled for sm_90a
  // kSm100 (Blackwell) joins here with its *_sm100.cu kernels and CAKE_HAS_SM100.
};

// The kernels to run on `device`; throws naming `op`, the GPU and the built targets otherwise.
KernelArch select_kernel_arch(int device, const char* op);

}  // namespace cake
