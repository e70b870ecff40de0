// Diagnostic microbenchmark (not part of the library): does wgmma keep the tensor cores' rate when a
// 64 x 256 product is issued as several narrower ones? The question behind a swap-AB grouped GEMM
// for T >= 4096 (benchmarks/NOTES.md, sessions 44-45): with the tokens as wgmma's N, a tile could
// stop at the expert's last token in steps of 32 or 16 rows (skip the N chunks past it) instead of
// padding the expert's rows to 64 (~12% of the MMA rows at ~256 rows per expert). That only pays if
// the narrow instructions run at the wide one's rate, so A comes from registers (one ldmatrix per
// k16, reused by every chunk) and only B is read from shared memory per instruction.
//
// One CTA per SM, two warpgroups (64 weight rows each, sharing B), compute only: A (2 x 64 x 64)
// and B (256 x 64) bf16 sit in shared memory, 128-byte swizzled, K-major; each iteration is one K =
// 64 block (4 k16 steps) of a 128 x 256 output tile; two iterations in flight (wait<1>).
//   ss256     SS m64n256k16 (A and B from shared memory: the 64x256 grouped GEMM tile's instruction)
//   rs256     A from registers (ldmatrix.x4 per k16), one m64n256k16
//   rs64x4    A from registers, 4 x m64n64k16 at B rows 0, 64, 128, 192
//   rs32x8    8 x m64n32k16
//   rs16x16   16 x m64n16k16
//   rs32x7    7 of the 8 m64n32k16 (a tile ending 32 rows early): the FLOPs issued are counted, so
//             the same TFLOP/s as rs32x8 means the skipped chunk cost nothing
//   rs32x8 rt7, rs16x16 rt13: the same with the chunk count a kernel argument (7 of 8, 13 of 16):
//             a branch per chunk, as a kernel choosing each tile's width at run time would have.
//             ptxas then puts a warpgroup.arrive before each wgmma (C7519: it cannot prove the
//             registers untouched across the branches); rs32x7 is the other way, a compiled
//             mainloop per width chosen once a tile
//   ss64x4    SS 4 x m64n64k16 (A read from shared memory by each: the shared-memory-bound case)
//   rs64x3+16x2, rs64x3+8x5, rs64x2+16x1: a tile's tokens as wide chunks then a few narrow ones to the
//             last token (224, 232 and 144 of 256 columns): the mixed issue a swap-AB tail tile would use
// Prints TFLOP/s per variant (median of 20 runs).
//   CUTE=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -O3 -std=c++17 -arch=sm_90a -I$CUTE -o /tmp/wgmma_nsplit benchmarks/wgmma_nsplit.cu && /tmp/wgmma_nsplit
#include "swapab.cuh"

using namespace swapab;

constexpr int kNsplitThreads = 256;  // two warpgroups, no producer
constexpr int kABytes = 2 * 64 * kRowBytes;
constexpr int kBBytes = 256 * kRowBytes;

// Descriptor offsets in 16-byte units.
__device__ __forceinline__ uint64_t k16_offset(int kk) { return uint64_t(kk * 32 >> 4); }
__device__ __forceinline__ uint64_t row_offset(int rows) { return uint64_t(rows * kRowBytes >> 4); }

// Chunks [0, kChunks) of width kN from column kCol0 (kCol0 + kChunks * kN <= 256) for one k16 step.
template <bool kRs, int kN, int kChunks, int kCol0 = 0, bool kRuntime = false, int kChunk = 0>
__device__ __forceinline__ void step_chunks(const uint32_t* a, uint64_t da, uint64_t db, float (&acc)[128],
                                            gmma::ScaleOut scale, int active = 256) {
  if constexpr (kChunk < kChunks) {
    if (kRuntime && kChunk >= active) return;  // a run-time chunk count (uniform: the warpgroup branches)
    // The accumulator floats per thread before this chunk: an m64nN fragment holds 4 floats a thread
    // per 8 columns in column order, so a narrow chunk's registers are the wide tile's at its columns.
    constexpr int kOff = (kCol0 + kChunk * kN) / 2;
    const uint64_t b = db + row_offset(kCol0 + kChunk * kN);
    if constexpr (kRs) {
      rs<Rs<kN>, kOff>(a, b, acc, scale, std::make_index_sequence<kN / 2>{});
    } else {
      ss<Ss<kN>, kOff>(da, b, acc, scale, std::make_index_sequence<kN / 2>{});
    }
    step_chunks<kRs, kN, kChunks, kCol0, kRuntime, kChunk + 1>(a, da, db, acc, scale, active);
  }
}

// One K = 64 block's wgmmas, committed; the accumulators fenced on both sides (as CUTLASS's
// mainloops do) so that no other instruction touches them inside the wgmma pipeline.
template <bool kRs, int kN, int kChunks, int kTailN, int kTailChunks, bool kRuntime>
__device__ __forceinline__ void block_mma(const uint32_t (&a)[16], uint64_t da, uint64_t db, float (&acc)[128],
                                          bool first, int active) {
  fence_acc(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const gmma::ScaleOut scale = first && kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
    step_chunks<kRs, kN, kChunks, 0, kRuntime>(a + 4 * kk, da + k16_offset(kk), db + k16_offset(kk), acc, scale,
                                               active);
    step_chunks<kRs, kTailN, kTailChunks, kN * kChunks>(a + 4 * kk, da + k16_offset(kk), db + k16_offset(kk), acc,
                                                        scale);
  }
  cute::warpgroup_commit_batch();
  fence_acc(acc);
}

template <bool kRs, int kN, int kChunks, int kTailN, int kTailChunks, bool kRuntime>
__global__ void __launch_bounds__(kNsplitThreads, 1) nsplit_kernel(int iters, int active, float* sink) {
  __shared__ __align__(1024) uint8_t smem[kABytes + kBBytes];
  // Values like real data's (the tensor cores' power, and so their clock, depends on them): small
  // bf16 from a hash, none zero.
  for (int i = threadIdx.x; i < (kABytes + kBBytes) / 2; i += kNsplitThreads) {
    const uint32_t h = (i * 2654435761u + blockIdx.x) >> 16;
    reinterpret_cast<uint16_t*>(smem)[i] = static_cast<uint16_t>(0x3c00u | (h & 0x3ffu)) ^ (h & 0x8000u);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t a_base = base + wg * 64 * kRowBytes;
  const uint64_t da = sw128_descriptor(a_base), db = sw128_descriptor(base + kABytes);
  float acc[128];  // written first by a ScaleOut::Zero wgmma
  uint32_t a0[16], a1[16];
  for (int it = 0; it < iters; it += 2) {
    if constexpr (kRs) load_a(a_base, a0);  // swapab.cuh's: a 128-byte-swizzled tile
    block_mma<kRs, kN, kChunks, kTailN, kTailChunks, kRuntime>(a0, da, db, acc, it == 0, active);
    cute::warpgroup_wait<1>();  // the previous block's wgmmas (which read a1) are done
    if constexpr (kRs) load_a(a_base, a1);
    block_mma<kRs, kN, kChunks, kTailN, kTailChunks, kRuntime>(a1, da, db, acc, false, active);
    cute::warpgroup_wait<1>();
  }
  cute::warpgroup_wait<0>();
  fence_acc(acc);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 128; ++i) s += acc[i];
  if (s == 1234.5f) sink[0] = s;
}

// kRuntime: the kernel issues only the first `active` wide chunks, a kernel argument.
template <bool kRs, int kN, int kChunks, int kTailN = 8, int kTailChunks = 0, bool kRuntime = false>
void run(const char* name, int sms, int iters, float* sink, MedianTimer& timer, int active = 256) {
  auto kernel = nsplit_kernel<kRs, kN, kChunks, kTailN, kTailChunks, kRuntime>;
  kernel<<<sms, kNsplitThreads>>>(2, active, sink);  // a fault shows here, not in the timing
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  const float ms = timer([&](int) { kernel<<<sms, kNsplitThreads>>>(iters, active, sink); });
  CHECK(cudaGetLastError());
  // FLOPs issued: 2 warpgroups x 64 rows x the columns issued x K = 64 per iteration.
  const int cols = kN * std::min(kChunks, active) + kTailN * kTailChunks;
  const double flops = 2.0 * sms * iters * 2 * 64 * double(cols) * 64;
  std::printf("%-12s %3d cols %8.3f ms %8.1f TFLOP/s\n", name, cols, ms, flops / ms / 1e9);
}

int main() {
  const int sms = print_device(", one CTA of 2 warpgroups per SM");
  float* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4));
  MedianTimer timer;
  const int iters = 4096;
  run<false, 256, 1>("ss256", sms, iters, sink, timer);
  run<true, 256, 1>("rs256", sms, iters, sink, timer);
  run<true, 64, 4>("rs64x4", sms, iters, sink, timer);
  run<true, 32, 8>("rs32x8", sms, iters, sink, timer);
  run<true, 16, 16>("rs16x16", sms, iters, sink, timer);
  run<true, 32, 7>("rs32x7", sms, iters, sink, timer);
  run<true, 32, 8, 8, 0, true>("rs32x8 rt7", sms, iters, sink, timer, 7);
  run<true, 16, 16, 8, 0, true>("rs16x16 rt13", sms, iters, sink, timer, 13);
  run<false, 64, 4>("ss64x4", sms, iters, sink, timer);
  run<true, 64, 3, 16, 2>("rs64x3+16x2", sms, iters, sink, timer);
  run<true, 64, 3, 8, 5>("rs64x3+8x5", sms, iters, sink, timer);
  run<true, 64, 2, 16, 1>("rs64x2+16x1", sms, iters, sink, timer);
  return 0;
}
