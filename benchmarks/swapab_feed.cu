// Diagnostic microbenchmark (not part of the library), the second gate of a swap-AB grouped GEMM for
// T >= 4096 (benchmarks/NOTES.md, session 45; wgmma_nsplit.cu is the first): with the operands fed
// by TMA from L2 as a GEMM's mainloop feeds them, does a tile of 128 weight rows x N tokens keep the
// tensor rate when N is an expert's row count split evenly (N ~ 136 for 272 rows) rather than 256?
// A narrow tile reads the same 16 KB of weights per K block for fewer FLOPs: at N = 144, 16 + 18 KB
// per ~570 tensor clocks, near the ~64 B a clock an SM takes from L2.
//
// One CTA per SM: a producer warp (TMA, 4 stages of W 128 x 64 and X N x 64 bf16, 128-byte
// swizzle) and two consumer warpgroups (64 weight rows each; A = W from shared memory through
// ldmatrix into registers, B = X, wgmma in 64- and 16-wide chunks; a stage released once its
// wgmmas are done). Each CTA runs `tiles` tiles of K = 4096 over W and X tiles that stay in L2
// (W: 16 tiles = 16 MB, X: 4 x 256 rows = 8 MB), no epilogue. Variants: N = 256, 192, 144 (128 +
// 16), 128, 64 on the register-A path, and N = 256 with A from shared memory too (ss, the
// instruction of a standard 128 x 256 tile). Prints TFLOP/s and GB/s from L2 per variant.
//   CUTE=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -O3 -std=c++17 -arch=sm_90a -I$CUTE -o /tmp/swapab_feed benchmarks/swapab_feed.cu && /tmp/swapab_feed
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include <utility>

#include "microbench.cuh"

namespace gmma = cute::SM90::GMMA;
using cutlass::arch::ClusterBarrier;
using cutlass::arch::ClusterTransactionBarrier;

constexpr int kStages = 4;
constexpr int kThreads = 384;       // a producer warpgroup (one thread issues), two consumers
constexpr int kRowBytes = 128;      // one K block: 64 bf16, one 128-byte swizzle row
constexpr int kWRows = 128;         // weight rows a tile
constexpr int kXRowsMax = 256;      // tokens a tile, at most
constexpr int kWStage = kWRows * kRowBytes;     // 16 KB
constexpr int kXStage = kXRowsMax * kRowBytes;  // 32 KB
constexpr int kSmemBytes = kStages * (kWStage + kXStage) + 1024;  // + alignment slack
constexpr int kK = 4096;
constexpr int kWTiles = 16, kXTiles = 4;

__device__ __forceinline__ uint64_t sw128_descriptor(uint32_t smem_addr) {
  cute::GmmaDescriptor desc;
  desc.bitfield.start_address_ = static_cast<uint16_t>(smem_addr >> 4);
  desc.bitfield.leading_byte_offset_ = 1;  // unused with swizzling
  desc.bitfield.stride_byte_offset_ = 1024 >> 4;
  desc.bitfield.base_offset_ = 0;
  desc.bitfield.layout_type_ = 1;  // SWIZZLE_128B
  return desc.desc_;
}

// This thread's A fragments of the 4 k16 steps of a K block: rows [16 * warp, +16) of the warpgroup's
// 64, from a 128-byte-swizzled tile (16-byte piece c of row r at r * 128 + ((c ^ (r % 8)) * 16)).
// ldmatrix.x4 matrices: rows 0-7 / 8-15 x k 0-7, then the same x k 8-15: wgmma's a0..a3.
__device__ __forceinline__ void load_a(uint32_t w_rows, uint32_t (&a)[16]) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int r = warp * 16 + (lane / 8 % 2) * 8 + lane % 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int piece = 2 * kk + lane / 16;
    const uint32_t addr = w_rows + r * kRowBytes + ((piece ^ (r % 8)) * 16);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(a[4 * kk]), "=r"(a[4 * kk + 1]), "=r"(a[4 * kk + 2]), "=r"(a[4 * kk + 3])
                 : "r"(addr));
  }
}

template <int kN>
struct Rs;
template <>
struct Rs<64> : gmma::MMA_64x64x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
template <>
struct Rs<16> : gmma::MMA_64x16x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::K> {};
using Ss256 = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;

template <size_t... I>
__device__ __forceinline__ void ss256(uint64_t da, uint64_t db, float (&acc)[128], gmma::ScaleOut scale,
                                      std::index_sequence<I...>) {
  Ss256::fma(da, db, acc[I]..., scale);
}

template <class Op, int kOff, int kFloats, size_t... I>
__device__ __forceinline__ void rs(const uint32_t* a, uint64_t db, float (&acc)[kFloats], gmma::ScaleOut scale,
                                   std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, acc[kOff + I]..., scale);
}

// A tile's N as kWide 64-wide chunks then kNarrow 16-wide ones (an m64nN fragment keeps 4 floats a
// thread per 8 columns in column order: a chunk's registers are the wide tile's at its columns).
template <int kWide, int kNarrow, int kChunk = 0>
__device__ __forceinline__ void rs_chunks(const uint32_t* a, uint64_t db, float (&acc)[(64 * kWide + 16 * kNarrow) / 2],
                                          gmma::ScaleOut scale) {
  constexpr int kCols = kChunk < kWide ? 64 * kChunk : 64 * kWide + 16 * (kChunk - kWide);
  if constexpr (kChunk < kWide) {
    rs<Rs<64>, kCols / 2>(a, db + uint64_t(kCols * kRowBytes >> 4), acc, scale, std::make_index_sequence<32>{});
    rs_chunks<kWide, kNarrow, kChunk + 1>(a, db, acc, scale);
  } else if constexpr (kChunk < kWide + kNarrow) {
    rs<Rs<16>, kCols / 2>(a, db + uint64_t(kCols * kRowBytes >> 4), acc, scale, std::make_index_sequence<8>{});
    rs_chunks<kWide, kNarrow, kChunk + 1>(a, db, acc, scale);
  }
}

template <int kFloats>
__device__ __forceinline__ void fence_acc(float (&acc)[kFloats]) {
#pragma unroll
  for (int i = 0; i < kFloats; ++i) cute::warpgroup_fence_operand(acc[i]);
}

// One K block's wgmmas, committed. kSs: A from shared memory too (N = 256 only).
template <bool kSs, int kWide, int kNarrow>
__device__ __forceinline__ void block_mma(const uint32_t (&a)[16], uint32_t w_rows, uint32_t x_stage,
                                          float (&acc)[(64 * kWide + 16 * kNarrow) / 2], bool first) {
  const uint64_t da = sw128_descriptor(w_rows), db = sw128_descriptor(x_stage);
  fence_acc(acc);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const gmma::ScaleOut scale = first && kk == 0 ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
    const uint64_t k_off = uint64_t(kk * 32 >> 4);
    if constexpr (kSs) {
      static_assert(kWide == 4 && kNarrow == 0, "the ss variant is N = 256");
      ss256(da + k_off, db + k_off, acc, scale, std::make_index_sequence<128>{});
    } else {
      rs_chunks<kWide, kNarrow>(a + 4 * kk, db + k_off, acc, scale);
    }
  }
  cute::warpgroup_commit_batch();
  fence_acc(acc);
}

struct FeedArgs {
  int tiles;  // a CTA's
  float* sink;
};

template <bool kSs, int kWide, int kNarrow>
__global__ void __launch_bounds__(kThreads, 1)
    feed_kernel(const __grid_constant__ CUtensorMap tma_w, const __grid_constant__ CUtensorMap tma_x, FeedArgs args) {
  constexpr int kN = 64 * kWide + 16 * kNarrow;
  constexpr int kBlocks = kK / 64;  // K blocks a tile
  static_assert(kBlocks % 2 == 0, "two A fragment buffers, alternating");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  uint8_t* w_smem = smem;
  uint8_t* x_smem = smem + kStages * kWStage;
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ClusterTransactionBarrier::init(&full[s], 1);
      ClusterBarrier::init(&empty[s], 2);  // a thread of each consumer warpgroup
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const int total = args.tiles * kBlocks;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      for (int i = 0; i < total; ++i) {
        const int s = i % kStages, tile = i / kBlocks, kb = i % kBlocks;
        ClusterBarrier::wait(&empty[s], ((i / kStages) & 1) ^ 1);
        ClusterTransactionBarrier::arrive_and_expect_tx(&full[s], kWStage + kN * kRowBytes);
        const int wt = (blockIdx.x + tile * gridDim.x) % kWTiles, xt = (blockIdx.x / 2 + tile) % kXTiles;
        const uint64_t hint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
        cute::SM90_TMA_LOAD_2D::copy(&tma_w, &full[s], hint, w_smem + s * kWStage, kb * 64, wt * kWRows);
        cute::SM90_TMA_LOAD_2D::copy(&tma_x, &full[s], hint, x_smem + s * kXStage, kb * 64, xt * kXRowsMax);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int cwg = wg - 1;  // weight rows [64 * cwg, +64) of the tile
  const bool signals = threadIdx.x % 128 == 0;
  const uint32_t w_base = static_cast<uint32_t>(__cvta_generic_to_shared(w_smem)) + cwg * 64 * kRowBytes;
  const uint32_t x_base = static_cast<uint32_t>(__cvta_generic_to_shared(x_smem));
  float acc[kN / 2];
  uint32_t a0[16], a1[16];
  float check = 0.0f;
  for (int tile = 0; tile < args.tiles; ++tile) {
    for (int kb = 0; kb < kBlocks; kb += 2) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = tile * kBlocks + kb + h, s = i % kStages;
        ClusterBarrier::wait(&full[s], (i / kStages) & 1);
        uint32_t(&a)[16] = h == 0 ? a0 : a1;
        if constexpr (!kSs) load_a(w_base + s * kWStage, a);
        block_mma<kSs, kWide, kNarrow>(a, w_base + s * kWStage, x_base + s * kXStage, acc, kb + h == 0);
        cute::warpgroup_wait<1>();  // block i - 1 done: its stage and its A buffer are free
        if (signals && kb + h > 0) ClusterBarrier::arrive(&empty[(i - 1) % kStages]);
      }
    }
    cute::warpgroup_wait<0>();
    fence_acc(acc);
    if (signals) ClusterBarrier::arrive(&empty[(tile * kBlocks + kBlocks - 1) % kStages]);
    // The tile's "epilogue": every accumulator read, or ptxas drops the wgmmas whose results nobody reads.
#pragma unroll
    for (int j = 0; j < kN / 2; ++j) check += acc[j];
  }
  if (check == 1234.5f) args.sink[0] = check;
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::printf("cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// A [rows, kK] bf16 matrix in boxes of 64 x box_rows, 128-byte swizzle.
CUtensorMap tensor_map(void* ptr, int rows, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {cuuint64_t(kK), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(kK) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode_fn()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, ptr, dims, strides, box, elem,
                                 CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return map;
}

__global__ void fill_kernel(uint16_t* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t h = (uint32_t(i) * 2654435761u) >> 16;
    p[i] = static_cast<uint16_t>(0x3c00u | (h & 0x3ffu)) ^ (h & 0x8000u);  // +-[1, 2)
  }
}

template <bool kSs, int kWide, int kNarrow>
void run(const char* name, int sms, void* w, void* x, float* sink) {
  constexpr int kN = 64 * kWide + 16 * kNarrow;
  auto kernel = feed_kernel<kSs, kWide, kNarrow>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const CUtensorMap tma_w = tensor_map(w, kWTiles * kWRows, kWRows), tma_x = tensor_map(x, kXTiles * kXRowsMax, kN);
  kernel<<<sms, kThreads, kSmemBytes>>>(tma_w, tma_x, FeedArgs{1, sink});  // a fault shows here
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  // ~2-3 ms a run at full rate; no L2 flush between runs: the operands are meant to stay there.
  const int tiles = std::max(4, 40 * 256 / kN);
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> ms;
  for (int rep = 0; rep < 13; ++rep) {
    CHECK(cudaEventRecord(t0));
    kernel<<<sms, kThreads, kSmemBytes>>>(tma_w, tma_x, FeedArgs{tiles, sink});
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, t0, t1));
    if (rep >= 3) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  const float med = ms[ms.size() / 2];
  const double flops = 2.0 * sms * tiles * double(kWRows) * kN * kK;
  const double bytes = double(sms) * tiles * (kK / 64) * (kWStage + kN * kRowBytes);
  std::printf("%-14s N %3d  %7.3f ms  %7.1f TFLOP/s  %7.1f GB/s from L2  (%.1f B/clk/SM at 1.755 GHz)\n", name, kN, med,
              flops / med / 1e9, bytes / med / 1e6, bytes / med / 1e-3 / sms / 1.755e9);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; tile 128 weight rows x N tokens, K = %d, operands in L2\n", prop.name, sms, kK);
  void *w = nullptr, *x = nullptr;
  float* sink = nullptr;
  const int64_t w_elems = int64_t(kWTiles) * kWRows * kK, x_elems = int64_t(kXTiles) * kXRowsMax * kK;
  CHECK(cudaMalloc(&w, w_elems * 2));
  CHECK(cudaMalloc(&x, x_elems * 2));
  CHECK(cudaMalloc(&sink, 4));
  fill_kernel<<<512, 256>>>(static_cast<uint16_t*>(w), w_elems);
  fill_kernel<<<512, 256>>>(static_cast<uint16_t*>(x), x_elems);
  CHECK(cudaDeviceSynchronize());
  run<true, 4, 0>("ss 256", sms, w, x, sink);
  run<false, 4, 0>("rs 4x64", sms, w, x, sink);
  run<false, 3, 0>("rs 3x64", sms, w, x, sink);
  run<false, 2, 1>("rs 2x64+16", sms, w, x, sink);
  run<false, 2, 0>("rs 2x64", sms, w, x, sink);
  run<false, 1, 0>("rs 1x64", sms, w, x, sink);
  return 0;
}
