// Shared by the standalone diagnostic microbenchmarks (stream_pattern.cu, gather_order.cu, the swap-AB ones):
// error checks, the device line and the timing, the same as the Python benchmarks' Timer (median after warm-up, each run
// after a 256 MB read that leaves nothing of the case in L2).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t e = (x);                                                             \
    if (e != cudaSuccess) {                                                          \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

// Reads n 16-byte words (a grid-stride loop, loads through L2 only); keeps them live.
__device__ __forceinline__ void read_words(const uint4* w, int64_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcg(w + i);
    acc ^= v.x ^ v.w;
  }
  if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void read_words_kernel(const uint4* w, int64_t n, uint32_t* sink) { read_words(w, n, sink); }

// Prints device 0's name and SM count, then `setup` (the case's own line); returns the SM count.
inline int print_device(const char* setup = "") {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs%s\n", prop.name, prop.multiProcessorCount, setup);
  return prop.multiProcessorCount;
}

class MedianTimer {
 public:
  MedianTimer() {
    CHECK(cudaMalloc(&flush_, kFlushBytes));
    CHECK(cudaMalloc(&sink_, 4));
    CHECK(cudaMemset(flush_, 2, kFlushBytes));
    CHECK(cudaEventCreate(&start_));
    CHECK(cudaEventCreate(&end_));
  }
  // Median ms of `reps` runs of run() after `warmup` untimed ones. flush_l2 false: no read before the
  // runs, for cases whose operands are meant to stay in L2.
  template <class Run>
  float operator()(Run&& run, int reps = 20, int warmup = 3, bool flush_l2 = true) {
    std::vector<float> ms;
    for (int rep = 0; rep < warmup + reps; ++rep) {
      if (flush_l2) read_words_kernel<<<528, 512>>>(reinterpret_cast<const uint4*>(flush_), kFlushBytes / 16, sink_);
      CHECK(cudaEventRecord(start_));
      run(rep);
      CHECK(cudaEventRecord(end_));
      CHECK(cudaEventSynchronize(end_));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start_, end_));
      if (rep >= warmup) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }

 private:
  static constexpr int64_t kFlushBytes = 256ll << 20;
  uint8_t* flush_ = nullptr;
  uint32_t* sink_ = nullptr;
  cudaEvent_t start_, end_;
};
