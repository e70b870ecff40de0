// Diagnostic microbenchmark (not part of the library), the second gate of a swap-AB grouped GEMM for
// T >= 4096 (benchmarks/NOTES.md, session 45; wgmma_nsplit.cu is the first): with the operands fed
// by TMA from L2 as a GEMM's mainloop feeds them, does a tile of 128 weight rows x N tokens keep the
// tensor rate when N is an expert's row count split evenly (N ~ 136 for 272 rows) rather than 256?
// A narrow tile reads the same 16 KB of weights per K block for fewer FLOPs: at N = 144, 16 + 18 KB
// per ~570 tensor clocks, near the ~64 B a clock an SM takes from L2 (measured: ~40; NOTES session 46).
//
// One CTA per SM: a producer warp (TMA, 4 stages of W 128 x 64 and X N x 64 bf16, 128-byte
// swizzle) and two consumer warpgroups (64 weight rows each; A = W from shared memory through
// ldmatrix into registers, B = X, wgmma in 64- and 16-wide chunks; a stage released once its
// wgmmas are done). Each CTA runs `tiles` tiles of K = 4096 over W and X tiles that stay in L2
// (W: 16 tiles = 16 MB, X: 4 x 256 rows = 8 MB), no epilogue. Variants: N = 256, 192, 144 (128 +
// 16), 128, 64 on the register-A path, and N = 256 with A from shared memory too (ss, the
// instruction of a standard 128 x 256 tile). Prints TFLOP/s and GB/s from L2 per variant.
// Shares its pieces with swapab_grouped.cu (swapab.cuh).
//   CUTE=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -O3 -std=c++17 -arch=sm_90a -I$CUTE -o /tmp/swapab_feed benchmarks/swapab_feed.cu && /tmp/swapab_feed
#include <string>

#include "swapab.cuh"

using namespace swapab;

constexpr int kK = 4096;
constexpr int kWTiles = 16, kXTiles = 4;

struct FeedArgs {
  int tiles;  // a CTA's
  float* sink;
};

template <bool kSs, int kWide, int kNarrow>
__global__ void __launch_bounds__(kThreads, 1)
    feed_kernel(const __grid_constant__ CUtensorMap tma_w, const __grid_constant__ CUtensorMap tma_x, FeedArgs args) {
  constexpr int kN = 64 * kWide + 16 * kNarrow;
  constexpr int kBlocks = kK / 64;  // K blocks a tile
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t barriers[2 * kStages];
  const Ring ring = make_ring(smem_raw, barriers);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      for (int i = 0; i < args.tiles * kBlocks; ++i) {
        const int s = i % kStages, tile = i / kBlocks, kb = i % kBlocks;
        uint64_t* full = produce_stage(ring, i, kWStage + kN * kRowBytes);
        const int wt = (blockIdx.x + tile * gridDim.x) % kWTiles, xt = (blockIdx.x / 2 + tile) % kXTiles;
        tma_load(tma_w, full, ring.w + s * kWStage, kb * 64, wt * kWRows);
        tma_load(tma_x, full, ring.x + s * kXStage, kb * 64, xt * kXRowsMax);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  float acc[kN / 2];
  float check = 0.0f;
  for (int tile = 0; tile < args.tiles; ++tile) {
    mma_tile<kSs, kWide, kNarrow>(ring, tile * kBlocks, kBlocks, wg - 1, acc);
    // The tile's "epilogue": every accumulator read, or ptxas drops the wgmmas whose results nobody reads.
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) check += acc[j];
  }
  if (check == 1234.5f) args.sink[0] = check;
}

template <bool kSs, int kWide, int kNarrow>
void run(const char* name, int sms, void* w, void* x, float* sink, MedianTimer& timer) {
  constexpr int kN = 64 * kWide + 16 * kNarrow;
  constexpr int kSmemBytes = kRingBytes + 1024;  // + alignment slack
  auto kernel = feed_kernel<kSs, kWide, kNarrow>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const CUtensorMap tma_w = tensor_map(w, kWTiles * kWRows, kK, kWRows);
  const CUtensorMap tma_x = tensor_map(x, kXTiles * kXRowsMax, kK, kN);
  kernel<<<sms, kThreads, kSmemBytes>>>(tma_w, tma_x, FeedArgs{1, sink});  // a fault shows here
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  // ~2-3 ms a run at full rate; no L2 flush between runs: the operands are meant to stay there.
  const int tiles = std::max(4, 40 * 256 / kN);
  const float med = timer([&](int) { kernel<<<sms, kThreads, kSmemBytes>>>(tma_w, tma_x, FeedArgs{tiles, sink}); },
                          10, 3, /*flush_l2=*/false);
  const double flops = 2.0 * sms * tiles * double(kWRows) * kN * kK;
  const double bytes = double(sms) * tiles * (kK / 64) * (kWStage + kN * kRowBytes);
  std::printf("%-14s N %3d  %7.3f ms  %7.1f TFLOP/s  %7.1f GB/s from L2  (%.1f B/clk/SM at 1.755 GHz)\n", name, kN, med,
              flops / med / 1e9, bytes / med / 1e6, bytes / med / 1e-3 / sms / 1.755e9);
}

int main() {
  const int sms =
      print_device(("; tile 128 weight rows x N tokens, K = " + std::to_string(kK) + ", operands in L2").c_str());
  void *w = nullptr, *x = nullptr;
  float* sink = nullptr;
  const int64_t w_elems = int64_t(kWTiles) * kWRows * kK, x_elems = int64_t(kXTiles) * kXRowsMax * kK;
  CHECK(cudaMalloc(&w, w_elems * 2));
  CHECK(cudaMalloc(&x, x_elems * 2));
  CHECK(cudaMalloc(&sink, 4));
  fill_kernel<<<512, 256>>>(static_cast<uint16_t*>(w), w_elems, 1);
  fill_kernel<<<512, 256>>>(static_cast<uint16_t*>(x), x_elems, 2);
  CHECK(cudaDeviceSynchronize());
  MedianTimer timer;
  run<true, 4, 0>("ss 256", sms, w, x, sink, timer);
  run<false, 4, 0>("rs 4x64", sms, w, x, sink, timer);
  run<false, 3, 0>("rs 3x64", sms, w, x, sink, timer);
  run<false, 2, 1>("rs 2x64+16", sms, w, x, sink, timer);
  run<false, 2, 0>("rs 2x64", sms, w, x, sink, timer);
  run<false, 1, 0>("rs 1x64", sms, w, x, sink, timer);
  return 0;
}
