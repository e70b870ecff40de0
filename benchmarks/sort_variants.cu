// Diagnostic microbenchmark (not part of the library): where does moe_sort's time go? A sort step
// (128 routes per warp) costs ~2-3 us per pass in the session-15 profile, so one block over many
// steps loses to three launches (patches/sort-steps-per-warp). This file has the library's
// algorithm (count per warp, scan, place by rank among equal keys; rows of an expert in expanded
// order) in variants that change one thing each:
//   main      1024-thread blocks (32 warps), one step per warp per chunk, match_any in both passes
//   atomic    the count pass by shared-memory atomicAdd (no match_any there; counts are order-free)
//   w8        256-thread blocks (8 warps): 4x the blocks, a quarter of each block's serial scan
//   w8atomic  both
//   steps4    main with four steps per warp per chunk (the rejected candidate: one block to 16384)
// Up to one chunk of routes one kernel does it all; beyond, count / scan / place kernels. Each
// variant's permutation is checked against a host stable sort ("!" after the time: it differs).
//   nvcc -O3 -arch=sm_90a -o /tmp/sort_variants benchmarks/sort_variants.cu && /tmp/sort_variants
#include <numeric>
#include <random>

#include "microbench.cuh"

constexpr int kUnroll = 4;
constexpr int kStep = 32 * kUnroll;  // routes per warp step

struct Args {
  const int32_t* ids;
  int64_t routes;
  int experts;
  int32_t *offsets, *p2e, *e2p;
};

__device__ __forceinline__ void load_keys(const Args& a, int64_t base, int64_t end, int lane, int (&keys)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t r = base + 32 * u + lane;
    const int id = r < end ? a.ids[r] : -1;
    keys[u] = id >= 0 && id < a.experts ? id : -1;
  }
}

struct Segment {
  int64_t begin, end;
};
__device__ __forceinline__ Segment warp_segment(int64_t begin, int64_t end, int warp, int warps) {
  const int64_t len = ((end - begin + warps - 1) / warps + kStep - 1) / kStep * kStep;
  const int64_t b = begin + warp * len;
  return {b, min(end, b + len)};
}

// Per-warp counts of each expert in [begin, end), then each (warp, expert)'s start within the
// chunk; totals[e] = the chunk's rows of expert e.
template <bool kAtomicCount>
__device__ void count_chunk(const Args& a, int64_t begin, int64_t end, int warps, int32_t* warp_base,
                            int32_t* totals) {
  const int E = a.experts, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < warps * E; i += blockDim.x) warp_base[i] = 0;
  __syncthreads();
  if (warp < warps) {
    const Segment seg = warp_segment(begin, end, warp, warps);
    int32_t* mine = warp_base + warp * E;
    for (int64_t base = seg.begin; base < seg.end; base += kStep) {
      int keys[kUnroll];
      load_keys(a, base, seg.end, lane, keys);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if constexpr (kAtomicCount) {
          if (keys[u] >= 0) atomicAdd(mine + keys[u], 1);
        } else {
          const unsigned peers = __match_any_sync(0xffffffffu, keys[u]);
          if (keys[u] >= 0 && lane == __ffs(peers) - 1) mine[keys[u]] += __popc(peers);
        }
      }
    }
  }
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < warps; ++w) {
      const int c = warp_base[w * E + e];
      warp_base[w * E + e] = run;
      run += c;
    }
    totals[e] = run;
  }
  __syncthreads();
}

// Warp 0: offsets from the experts' totals, which become each expert's first row.
__device__ void scan_experts(const Args& a, int32_t* starts) {
  const int E = a.experts, lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int count = e < E ? starts[e] : 0;
      int incl = count;
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += up;
      }
      if (e < E) {
        a.offsets[e + 1] = carry + incl;
        starts[e] = carry + incl - count;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) a.offsets[0] = 0;
  }
  __syncthreads();
}

__device__ void place_chunk(const Args& a, int64_t begin, int64_t end, int warps, int32_t* warp_base,
                            const int32_t* starts) {
  const int E = a.experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp >= warps) return;
  const Segment seg = warp_segment(begin, end, warp, warps);
  int32_t* mine = warp_base + warp * E;
  for (int64_t base = seg.begin; base < seg.end; base += kStep) {
    int keys[kUnroll];
    load_keys(a, base, seg.end, lane, keys);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = base + 32 * u + lane;
      const int key = keys[u];
      const unsigned peers = __match_any_sync(0xffffffffu, key);
      if (key >= 0) {
        const int pos = starts[key] + mine[key] + __popc(peers & ((1u << lane) - 1));
        a.p2e[pos] = static_cast<int32_t>(r);
        a.e2p[r] = pos;
      } else if (r < seg.end) {
        a.e2p[r] = -1;
      }
      __syncwarp();
      if (key >= 0 && lane == __ffs(peers) - 1) mine[key] += __popc(peers);
      __syncwarp();
    }
  }
}

template <bool kAtomicCount>
__global__ void __launch_bounds__(1024) one_block(Args a, int warps) {
  extern __shared__ int32_t smem[];
  int32_t* starts = smem + warps * a.experts;
  count_chunk<kAtomicCount>(a, 0, a.routes, warps, smem, starts);
  scan_experts(a, starts);
  place_chunk(a, 0, a.routes, warps, smem, starts);
}

template <bool kAtomicCount>
__global__ void __launch_bounds__(1024) count_kernel(Args a, int warps, int64_t chunk, int32_t* block_rows) {
  extern __shared__ int32_t smem[];
  const int E = a.experts;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  count_chunk<kAtomicCount>(a, begin, min(a.routes, begin + chunk), warps, smem, smem + warps * E);
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_rows[int64_t(blockIdx.x) * E + e] = smem[warps * E + e];
}

__global__ void __launch_bounds__(1024) scan_kernel(Args a, int blocks, int32_t* block_rows) {
  extern __shared__ int32_t starts[];
  const int E = a.experts;
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int run = 0;
    for (int b = 0; b < blocks; ++b) {
      const int c = block_rows[int64_t(b) * E + e];
      block_rows[int64_t(b) * E + e] = run;
      run += c;
    }
    starts[e] = run;
  }
  __syncthreads();
  scan_experts(a, starts);
  for (int64_t i = threadIdx.x; i < int64_t(blocks) * E; i += blockDim.x) block_rows[i] += starts[i % E];
}

template <bool kAtomicCount>
__global__ void __launch_bounds__(1024) place_kernel(Args a, int warps, int64_t chunk, const int32_t* block_rows) {
  extern __shared__ int32_t smem[];
  const int E = a.experts;
  int32_t* starts = smem + warps * E;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = min(a.routes, begin + chunk);
  count_chunk<kAtomicCount>(a, begin, end, warps, smem, starts);
  for (int e = threadIdx.x; e < E; e += blockDim.x) starts[e] = block_rows[int64_t(blockIdx.x) * E + e];
  __syncthreads();
  place_chunk(a, begin, end, warps, smem, starts);
}

struct Variant {
  const char* name;
  int warps, steps;
  bool atomic_count;
};

template <bool kAtomicCount>
void sort(const Args& a, const Variant& v, int32_t* block_rows) {
  const int64_t chunk = int64_t(v.warps) * kStep * v.steps;
  const size_t smem = sizeof(int32_t) * (size_t(v.warps) * a.experts + a.experts + 1);
  if (a.routes <= chunk) {
    const int warps = static_cast<int>(std::clamp<int64_t>((a.routes + kStep - 1) / kStep, 1, v.warps));
    one_block<kAtomicCount><<<1, 32 * std::max(warps, 4), smem>>>(a, warps);
    return;
  }
  const int blocks = static_cast<int>((a.routes + chunk - 1) / chunk);
  count_kernel<kAtomicCount><<<blocks, 32 * v.warps, smem>>>(a, v.warps, chunk, block_rows);
  scan_kernel<<<1, 1024, sizeof(int32_t) * (a.experts + 1)>>>(a, blocks, block_rows);
  place_kernel<kAtomicCount><<<blocks, 32 * v.warps, smem>>>(a, v.warps, chunk, block_rows);
}

int main() {
  struct Case {
    const char* name;
    int tokens, experts, top_k;
  };
  const Case cases[] = {{"qwen3 T=256", 256, 128, 8},     {"qwen3 T=1024", 1024, 128, 8},
                        {"qwen3 T=4096", 4096, 128, 8},   {"qwen3 T=16384", 16384, 128, 8},
                        {"mixtral T=1024", 1024, 8, 2},   {"mixtral T=16384", 16384, 8, 2},
                        {"stepfun T=8192", 8192, 64, 8}};
  const Variant variants[] = {
      {"main", 32, 1, false}, {"atomic", 32, 1, true}, {"w8", 8, 1, false}, {"w8atomic", 8, 1, true},
      {"steps4", 32, 4, false}};
  MedianTimer timer;
  std::printf("%-16s %8s", "case", "routes");
  for (const Variant& v : variants) std::printf(" %10s", v.name);
  std::printf("   (us, median of 20; each after a 256 MB read)\n");
  std::mt19937 rng(0);
  for (const Case& c : cases) {
    const int64_t routes = int64_t(c.tokens) * c.top_k;
    std::vector<int32_t> ids(routes);
    std::vector<int> pool(c.experts);
    std::iota(pool.begin(), pool.end(), 0);
    for (int t = 0; t < c.tokens; ++t) {
      std::shuffle(pool.begin(), pool.end(), rng);
      for (int j = 0; j < c.top_k; ++j) ids[int64_t(t) * c.top_k + j] = pool[j];
    }
    std::vector<int32_t> want(routes);
    std::iota(want.begin(), want.end(), 0);
    std::stable_sort(want.begin(), want.end(), [&](int32_t l, int32_t r) { return ids[l] < ids[r]; });
    Args a{nullptr, routes, c.experts, nullptr, nullptr, nullptr};
    int32_t *d_ids, *block_rows;
    CHECK(cudaMalloc(&d_ids, routes * 4));
    CHECK(cudaMalloc(&a.offsets, (c.experts + 1) * 4));
    CHECK(cudaMalloc(&a.p2e, routes * 4));
    CHECK(cudaMalloc(&a.e2p, routes * 4));
    CHECK(cudaMalloc(&block_rows, (routes / kStep + 1) * c.experts * 4));
    CHECK(cudaMemcpy(d_ids, ids.data(), routes * 4, cudaMemcpyHostToDevice));
    a.ids = d_ids;
    std::printf("%-16s %8lld", c.name, static_cast<long long>(routes));
    for (const Variant& v : variants) {
      auto run = [&](int) {
        if (v.atomic_count)
          sort<true>(a, v, block_rows);
        else
          sort<false>(a, v, block_rows);
      };
      CHECK(cudaMemset(a.p2e, 0xff, routes * 4));
      run(0);
      CHECK(cudaGetLastError());
      std::vector<int32_t> got(routes);
      CHECK(cudaMemcpy(got.data(), a.p2e, routes * 4, cudaMemcpyDeviceToHost));
      const float med = timer(run);
      std::printf(" %9.1f%s", med * 1e3, got == want ? " " : "!");
    }
    std::printf("\n");
    CHECK(cudaFree(d_ids));
    CHECK(cudaFree(a.offsets));
    CHECK(cudaFree(a.p2e));
    CHECK(cudaFree(a.e2p));
    CHECK(cudaFree(block_rows));
  }
  return 0;
}
