// Programmatic Dependent Launch (sm_90+): a kernel launched with `pdl` may start while the
// previous kernel on the stream finishes; it must call pdl_wait() in every CTA before it touches
// global memory, so the chain stays ordered even through kernels that leave early. Kernels call
// pdl_launch_dependents() once the next kernel may start its own prologue.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include <c10/cuda/CUDAException.h>

namespace cake {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Opts `kernel` in to `bytes` of dynamic shared memory (past the default 48 KB) on the current
// device. The attribute belongs to the device, so it is set once per (kernel, device), not at
// every launch.
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mutex);
  if (done.count({kernel, device})) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  done.insert({kernel, device});
}

// CTAs of `kernel` (`threads` and `smem` bytes of dynamic shared memory each, opted in first) resident
// at once on one SM of the current device: what a cooperative grid may hold per SM. Asked of the
// driver once per (kernel, device, threads, bytes), as kernels launched every step need it.
inline int resident_ctas_per_sm(const void* kernel, int threads, size_t smem) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, device, threads, smem);
  if (auto it = known.find(key); it != known.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  return known[key] = per_sm;
}

namespace detail {
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
            bool cooperative, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2];
  unsigned count = 0;
  if (cooperative) {
    attributes[count].id = cudaLaunchAttributeCooperative;
    attributes[count++].val.cooperative = 1;
  }
  if (pdl) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  config.attrs = attributes;
  config.numAttrs = count;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
}  // namespace detail

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute
// when `pdl` (captured into CUDA graphs as a programmatic edge).
template <class... Params, class... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   bool pdl, Args&&... args) {
  detail::launch(kernel, grid, block, smem, stream, pdl, false, std::forward<Args>(args)...);
}

// launch_kernel for a kernel with grid barriers (cooperative_groups::this_grid().sync()): a
// cooperative launch, so every CTA of the grid is resident at once (the caller sizes the grid).
template <class... Params, class... Args>
void launch_cooperative_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                               bool pdl, Args&&... args) {
  detail::launch(kernel, grid, block, smem, stream, pdl, true, std::forward<Args>(args)...);
}

}  // namespace cake
