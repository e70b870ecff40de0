// Microbenchmark (H200, measure only): the fused finalize's scatter of router-scaled GEMM2 rows into the
// token-order output, written four ways from 64 x 256 tiles of a permuted row order (8 routes a token):
//   red16   one 16-byte red.global.add.noftz.v4.bf16x2 a lane (what scatter_epilogue_sm90.cuh does)
//   st16    plain 16-byte stores (wrong sums: the cost of the scattered writes alone)
//   bulk512 the tile staged in shared memory, then one cp.reduce.async.bulk .add.noftz.bf16 of 512 B a row
//   bulk128 the same, 64 columns (128 B, one L2 line) at a time through a double buffer
// Question: does the L2 take whole-line bulk reductions faster than 16-byte reds (session 41: the reds cost
// ~55 us over scattered stores in Qwen3-235B T=4096's GEMM2)?  nvcc -O3 -arch=sm_90a red_vs_bulk.cu
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <random>

constexpr int kRows = 64, kCols = 256, kThreads = 128;

__device__ __forceinline__ void red16(void* p, const uint32_t (&w)[4]) {
  asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]),
               "r"(w[3]) : "memory");
}
__device__ __forceinline__ void bulk_add(void* dst, const void* src, int bytes) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.bf16 [%0], [%1], %2;" ::"l"(dst), "r"(s),
               "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// rows: permuted row -> route; out [tokens, H]; each CTA walks tiles (64 rows x 256 cols) grid-stride.
template <int kMode>
__global__ void __launch_bounds__(kThreads) scatter(const int32_t* rows, int64_t n_rows, int H, int top_k,
                                                    __nv_bfloat16* out) {
  constexpr int kPad = 8;  // bf16 elements: 16 B a row, so the 16-byte stores of 2 rows miss each other's banks
  __shared__ alignas(128) __nv_bfloat16 stage[2][kRows][64 + kPad];
  __shared__ alignas(128) __nv_bfloat16 whole[kRows][kCols + kPad];
  const int n_tiles = H / kCols;
  const int64_t tiles = (n_rows / kRows) * n_tiles;
  const uint32_t v = 0x3c003c00u;  // bf16 pairs of 2^-7
  const uint32_t w[4] = {v, v, v, v};
  int chunk_count = 0;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row0 = (t / n_tiles) * kRows;
    const int col0 = static_cast<int>(t % n_tiles) * kCols;
    if constexpr (kMode == 0 || kMode == 1) {
      // lane layout of the register epilogue: a quad holds a row, 4 lanes x 16 B = 64 B; 8 rows a warp
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      for (int m = warp * 8 + lane / 4; m < kRows; m += 32) {
        const int32_t route = rows[row0 + m];
        __nv_bfloat16* o = out + int64_t(route / top_k) * H + col0;
        for (int c = (lane % 4) * 8; c < kCols; c += 32) {
          if constexpr (kMode == 0) red16(o + c, w);
          else *reinterpret_cast<uint4*>(o + c) = make_uint4(w[0], w[1], w[2], w[3]);
        }
      }
    } else if constexpr (kMode == 2) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      if (threadIdx.x < kRows) bulk_wait_read<0>();
      __syncthreads();
      for (int m = warp * 8 + lane / 4; m < kRows; m += 32)
        for (int c = (lane % 4) * 8; c < kCols; c += 32)
          *reinterpret_cast<uint4*>(&whole[m][c]) = make_uint4(w[0], w[1], w[2], w[3]);
      fence_async_smem();
      __syncthreads();
      if (threadIdx.x < kRows) {
        const int32_t route = rows[row0 + threadIdx.x];
        bulk_add(out + int64_t(route / top_k) * H + col0, &whole[threadIdx.x][0], kCols * 2);
        bulk_commit();
      }
    } else {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      const int32_t route = threadIdx.x < kRows ? rows[row0 + threadIdx.x] : 0;
      for (int c0 = 0; c0 < kCols; c0 += 64, ++chunk_count) {
        const int buf = chunk_count & 1;
        if (threadIdx.x < kRows) bulk_wait_read<1>();
        __syncthreads();
        for (int m = warp * 8 + lane / 4; m < kRows; m += 32)
          *reinterpret_cast<uint4*>(&stage[buf][m][(lane % 4) * 8]) = make_uint4(w[0], w[1], w[2], w[3]),
          *reinterpret_cast<uint4*>(&stage[buf][m][(lane % 4) * 8 + 32]) = make_uint4(w[0], w[1], w[2], w[3]);
        fence_async_smem();
        __syncthreads();
        if (threadIdx.x < kRows) {
          bulk_add(out + int64_t(route / top_k) * H + col0 + c0, &stage[buf][threadIdx.x][0], 128);
          bulk_commit();
        }
      }
    }
  }
  if (threadIdx.x < kRows) bulk_wait_read<0>();
}

int main() {
  const int top_k = 8;
  const char* names[4] = {"red16", "st16", "bulk512", "bulk128"};
  for (const auto& shape : std::vector<std::pair<int, int>>{{4096, 2048}, {4096, 4096}, {16384, 7168}, {2048, 7168}}) {
    const int tokens = shape.first, H = shape.second;
    const int64_t routes = int64_t(tokens) * top_k;
    std::vector<int32_t> perm(routes);
    for (int64_t i = 0; i < routes; ++i) perm[i] = static_cast<int32_t>(i);
    std::mt19937 rng(0);
    std::shuffle(perm.begin(), perm.end(), rng);
    int32_t* rows;
    __nv_bfloat16* out;
    cudaMalloc(&rows, routes * 4);
    cudaMalloc(&out, int64_t(tokens) * H * 2);
    cudaMemcpy(rows, perm.data(), routes * 4, cudaMemcpyHostToDevice);
    cudaMemset(out, 0, int64_t(tokens) * H * 2);
    int sms;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    const double bytes = double(routes) * H * 2;
    printf("T=%d H=%d routes=%lld top_k=%d: %.1f MB scattered into a %.1f MB output\n", tokens, H, (long long)routes,
           top_k, bytes / 1e6, double(tokens) * H * 2 / 1e6);
    auto launch = [&](int mode, int grid) {
      switch (mode) {
        case 0: scatter<0><<<grid, kThreads>>>(rows, routes, H, top_k, out); break;
        case 1: scatter<1><<<grid, kThreads>>>(rows, routes, H, top_k, out); break;
        case 2: scatter<2><<<grid, kThreads>>>(rows, routes, H, top_k, out); break;
        default: scatter<3><<<grid, kThreads>>>(rows, routes, H, top_k, out); break;
      }
    };
    for (int mode = 0; mode < 4; ++mode) {
      for (int ctas_per_sm : {2, 4}) {
        const int grid = sms * ctas_per_sm;
        for (int i = 0; i < 3; ++i) launch(mode, grid);
        cudaEventRecord(a);
        const int iters = 20;
        for (int i = 0; i < iters; ++i) launch(mode, grid);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms;
        cudaEventElapsedTime(&ms, a, b);
        const double us = ms * 1e3 / iters;
        printf("  %-8s %d CTAs/SM  %8.1f us  %6.2f TB/s of rows\n", names[mode], ctas_per_sm, us, bytes / us / 1e6);
      }
    }
    // correctness of red16 and the two bulk modes: zero, one pass each, every element must be the exact sum
    for (int mode : {0, 2, 3}) {
      cudaMemset(out, 0, int64_t(tokens) * H * 2);
      launch(mode, sms * 2);
      std::vector<uint16_t> host(int64_t(tokens) * H);
      cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost);
      int64_t bad = 0;
      for (uint16_t x : host) bad += x != 0x3d80;  // 8 * 2^-7 = 2^-4 = bf16 0x3d80
      printf("  check %-8s %lld of %lld elements != 8 * 2^-7 (%s)\n", names[mode], (long long)bad,
             (long long)host.size(), cudaGetErrorString(cudaGetLastError()));
    }
    cudaFree(rows);
    cudaFree(out);
  }
  return 0;
}
