// Diagnostic prototype (not part of the library; benchmarks/NOTES.md, sessions 45-46, where it closed the
// swap-AB direction): a swap-AB grouped GEMM, y[rows of expert e] = x[rows of e] @ w[e]^T, whose tiles end
// at each expert's last token in steps of 32 rows instead of padding the expert to 64-row tiles. An
// expert's rows become tiles of <= 256 tokens, split evenly (272 rows: 160 + 112) or as full tiles and a
// remainder (256 + 16); a tile is 128 weight rows x those tokens, issued as 32-wide wgmma chunks to its
// last one, the count a run-time value (swapab.cuh, rs_chunks32). Token rows come in expert order by TMA
// (GEMM2, and GEMM1 after a gather kernel) or are gathered from x through the routing by three producer
// warps' cp.async (the layout the TMA writes; no SwiGLU here). The epilogue stores bf16 directly or
// through shared memory in 64-token passes; tiles are a host-built list in expert order (the library would
// build it on the device): this measures the mainloop's rate on the real ragged shapes, not a finished kernel.
//
// Checks first (every output of a small problem with empty, 1-, 15-, 17-, 64-, 256-, 257- and 300-row
// experts, with rows in order and gathered, in every form; sampled outputs of each timed one, every
// expert's first and last row included, against float sums), then per shape and form: ms, useful TFLOP/s,
// the MMA rows issued over the rows (this tiling and 64-row tiles), and the same kernel on the same rows
// as one expert (dense: full tiles, token tiles reused from L2) for scale.
//   CUTE=$(python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source/include
//   nvcc -O3 -std=c++17 -arch=sm_90a -I$CUTE -o /tmp/swapab_grouped benchmarks/swapab_grouped.cu && /tmp/swapab_grouped
#include <cuda_bf16.h>

#include <numeric>
#include <random>

#include "swapab.cuh"

using namespace swapab;

// Tokens [x_row, x_row + rows) of one expert times its weight rows [w_row, w_row + 128), which are
// output columns [out_col, out_col + 128).
struct Unit {
  int x_row, rows, w_row, out_col;
};

struct GroupedArgs {
  const Unit* units;
  int num_units;
  int k_blocks;
  int n_out;
  __nv_bfloat16* y;
  // GEMM1's gather: product row p reads x row src_rows[p] (x [*, k]); nullptr: x rows in product order (TMA).
  const int* src_rows;
  const __nv_bfloat16* x;
  int k;
};

// The staged epilogue's buffer a consumer warpgroup: kPassTokens tokens x its 64 output columns, rows
// padded to 72 bf16 (144 bytes) so that the fragment writes (tokens 2 (lane % 4) + {0, 1} at once) fall
// in different banks and each row's 16-byte pieces stay aligned.
constexpr int kPassTokens = 64, kStageRow = 72;
constexpr int kStagedBytes = 2 * kPassTokens * kStageRow * 2;

// One tile: its width in 32-wide chunks chosen at run time inside one mainloop (swapab.cuh, rs_chunks32).
// kStaged: the outputs go through shared memory in passes of kPassTokens tokens and leave as 16-byte
// row pieces; else each thread stores its bf16 values directly (2-byte stores, 8 per 16-byte row piece).
template <bool kStaged>
__device__ __forceinline__ void consume_unit(const Ring& ring, int i, int cwg, const Unit& u, const GroupedArgs& a,
                                             __nv_bfloat16* staged) {
  constexpr int kN = kXRowsMax;
  float acc[kN / 2];
  mma_tile<false, 0, 0>(ring, i, a.k_blocks, cwg, acc, (u.rows + 31) / 32, a.src_rows != nullptr);
  // acc[4 g + {0, 1}]: weight row r (and r + 8 for {2, 3}), tokens 8 g + 2 (lane % 4) + {0, 1}.
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  if constexpr (kStaged) {
    const int r = warp * 16 + lane / 4, t = threadIdx.x % 128;
#pragma unroll
    for (int pass = 0; pass < kN / kPassTokens; ++pass) {
      if (pass * kPassTokens < u.rows) {  // uniform in the warpgroup
#pragma unroll
        for (int j = 0; j < kPassTokens / 8; ++j) {
#pragma unroll
          for (int d = 0; d < 2; ++d) {
            const int g = pass * kPassTokens / 8 + j;
            __nv_bfloat16* row = staged + (8 * j + 2 * (lane % 4) + d) * kStageRow;
            row[r] = __float2bfloat16(acc[4 * g + d]);
            row[r + 8] = __float2bfloat16(acc[4 * g + 2 + d]);
          }
        }
        asm volatile("bar.sync %0, 128;" ::"r"(1 + cwg) : "memory");
#pragma unroll
        for (int j = 0; j < kPassTokens * 8 / 128; ++j) {
          const int piece = t + 128 * j, token = pass * kPassTokens + piece / 8;
          if (token < u.rows) {
            const uint4 v = *reinterpret_cast<const uint4*>(staged + (piece / 8) * kStageRow + piece % 8 * 8);
            *reinterpret_cast<uint4*>(a.y + int64_t(u.x_row + token) * a.n_out + u.out_col + cwg * 64 + piece % 8 * 8) = v;
          }
        }
        asm volatile("bar.sync %0, 128;" ::"r"(1 + cwg) : "memory");
      }
    }
  } else {
    const int col = u.out_col + cwg * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int g = 0; g < kN / 8; ++g) {
#pragma unroll
      for (int d = 0; d < 2; ++d) {
        const int token = 8 * g + 2 * (lane % 4) + d;
        if (token < u.rows) {
          __nv_bfloat16* row = a.y + int64_t(u.x_row + token) * a.n_out;
          row[col] = __float2bfloat16(acc[4 * g + d]);
          row[col + 8] = __float2bfloat16(acc[4 * g + 2 + d]);
        }
      }
    }
  }
}

// The gather warps (kGatherWarps of them, warp gw taking every kGatherWarps-th 16-byte piece): the
// tile's token rows by cp.async into the stage, in the layout the TMA writes (128-byte rows, 16-byte
// piece c of row r at ((c ^ (r % 8)) * 16)), rows past the tile's zero-filled. The stage's full barrier
// tracks each warp's copies (each lane's cp.async.mbarrier.arrive), then the warp's lane 0 arrives.
constexpr int kGatherWarps = 3;
__device__ __forceinline__ void gather_unit(const Ring& ring, int i, const Unit& u, const GroupedArgs& a,
                                            const __nv_bfloat16** row_src, int gw) {
  const int lane = threadIdx.x % 32;
  const int rows = (u.rows + 31) / 32 * 32;
  __syncwarp();  // the last tile's copies are issued: its table may be rewritten
  for (int r = lane; r < rows; r += 32) {
    row_src[r] = r < u.rows ? a.x + int64_t(a.src_rows[u.x_row + r]) * a.k : nullptr;
  }
  __syncwarp();
  for (int kb = 0; kb < a.k_blocks; ++kb, ++i) {
    const int s = i % kStages;
    ClusterBarrier::wait(&ring.empty[s], ((i / kStages) & 1) ^ 1);
    const uint32_t stage = ring.x_addr(s);
    for (int piece = gw * 32 + lane; piece < rows * 8; piece += 32 * kGatherWarps) {
      const int r = piece / 8, c = piece % 8;
      const __nv_bfloat16* src = row_src[r];
      const uint32_t dst = stage + r * kRowBytes + ((c ^ (r % 8)) * 16);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst),
                   "l"(src ? src + kb * 64 + c * 8 : a.x), "r"(src ? 16 : 0));
    }
    cutlass::arch::cpasync_barrier_arrive(&ring.full[s]);
    __syncwarp();
    if (lane == 0) ClusterBarrier::arrive(&ring.full[s]);
  }
}

template <bool kStaged>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_kernel(const __grid_constant__ CUtensorMap tma_w, const __grid_constant__ CUtensorMap tma_x64,
                   const __grid_constant__ CUtensorMap tma_x16, GroupedArgs a) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ uint64_t barriers[2 * kStages];
  __shared__ const __nv_bfloat16* row_src[kGatherWarps][kXRowsMax];  // each gather warp's table of the tile's x rows
  const bool gather = a.src_rows != nullptr;
  const Ring ring = make_ring(smem_raw, barriers, gather ? 1 + kGatherWarps : 1);
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      int i = 0;
      for (int n = blockIdx.x; n < a.num_units; n += gridDim.x) {
        const Unit u = a.units[n];
        const int steps = (u.rows + 31) / 32 * 2, wide = steps / 4;  // 16-row boxes of the 32-row chunks
        for (int kb = 0; kb < a.k_blocks; ++kb, ++i) {
          const int s = i % kStages;
          uint64_t* full = produce_stage(ring, i, kWStage + (gather ? 0 : steps * 16 * kRowBytes));
          tma_load(tma_w, full, ring.w + s * kWStage, kb * 64, u.w_row);
          if (gather) continue;  // warps 1.. copy the token rows
          // The tile's token rows in boxes of 64, then 16 (rows past the expert's are loaded, not used).
          for (int j = 0; j < wide; ++j) {
            tma_load(tma_x64, full, ring.x + s * kXStage + j * 64 * kRowBytes, kb * 64, u.x_row + 64 * j);
          }
          for (int j = 64 * wide; j < 16 * steps; j += 16) {
            tma_load(tma_x16, full, ring.x + s * kXStage + j * kRowBytes, kb * 64, u.x_row + j);
          }
        }
      }
    } else if (gather && threadIdx.x >= 32 && threadIdx.x / 32 <= kGatherWarps) {
      const int gw = threadIdx.x / 32 - 1;
      int i = 0;
      for (int n = blockIdx.x; n < a.num_units; n += gridDim.x, i += a.k_blocks) {
        gather_unit(ring, i, a.units[n], a, row_src[gw], gw);
      }
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<232>();
  int i = 0;
  for (int n = blockIdx.x; n < a.num_units; n += gridDim.x, i += a.k_blocks) {
    const Unit u = a.units[n];
    consume_unit<kStaged>(ring, i, wg - 1, u, a,
                          reinterpret_cast<__nv_bfloat16*>(ring.x + kStages * kXStage) + (wg - 1) * kPassTokens * kStageRow);
  }
}

// y_ref at sampled (row, col): float sums of bf16 products; the expert of a row from the offsets, its
// x row through src_rows (GEMM1's gather) where there is one.
__global__ void reference_kernel(const __nv_bfloat16* x, const int* src_rows, const __nv_bfloat16* w,
                                 const int* offsets, int experts, const int2* samples, int n, int k, int n_out,
                                 float* out) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= n) return;
  const int row = samples[s].x, col = samples[s].y;
  int e = 0;
  while (e + 1 < experts && offsets[e + 1] <= row) ++e;
  const __nv_bfloat16* xr = x + int64_t(src_rows ? src_rows[row] : row) * k;
  const __nv_bfloat16* wr = w + (int64_t(e) * n_out + col) * k;
  float sum = 0.0f;
  for (int j = 0; j < k; ++j) sum += __bfloat162float(xr[j]) * __bfloat162float(wr[j]);
  out[s] = sum;
}

struct Problem {
  const char* name;
  std::vector<int> rows;  // per expert
  int n_out, k;
  std::vector<int> src_rows = {};  // GEMM1's gather: product row p reads x row src_rows[p] (empty: row p)
  int x_rows = 0;                  // x's rows when gathering
};

struct Built {
  std::vector<int> offsets;
  std::vector<Unit> units;
  int64_t mma_rows = 0, rows64 = 0;  // token rows the MMAs issue, this tiling / 64-row tiles
};

// How an expert's rows become token tiles: kEven splits them evenly into tiles of <= 256 rows rounded to
// 32 (272 rows: 160 + 112); kFull takes full 256-row tiles and one remainder tile (272: 256 + 16, issued
// as 32): fewer wide tiles, whose weights cost fewer L2 bytes per MMA (swapab_feed.cu's N = 256 row).
enum class Split { kEven, kFull };

Built build(const Problem& p, Split split) {
  Built b;
  b.offsets.push_back(0);
  for (int r : p.rows) b.offsets.push_back(b.offsets.back() + r);
  for (int e = 0; e < int(p.rows.size()); ++e) {
    const int rows = p.rows[e];
    if (rows == 0) continue;
    const int tiles = (rows + kXRowsMax - 1) / kXRowsMax;
    const int base = split == Split::kFull ? kXRowsMax : ((rows + tiles - 1) / tiles + 31) / 32 * 32;
    // Weight tiles inner, in runs of 8 token tiles: a dense expert's token rows are reused from L2 by
    // the weight tiles that run at the same time (its weights are read once a run).
    for (int t0 = 0; t0 < tiles; t0 += 8) {
      for (int m = 0; m < p.n_out; m += kWRows) {
        for (int t = t0; t < std::min(tiles, t0 + 8); ++t) {
          const int first = t * base, n = std::min(base, rows - first);
          if (n <= 0) {
            std::printf("bad split: %d rows, %d tiles of %d\n", rows, tiles, base);
            std::exit(1);
          }
          b.units.push_back({b.offsets[e] + first, n, e * p.n_out + m, m});
          if (m == 0) b.mma_rows += (n + 31) / 32 * 32;
        }
      }
    }
    b.rows64 += (rows + 63) / 64 * 64;
  }
  return b;
}

// k distinct experts of `experts` for each of `tokens` tokens (the bench's softmax top-k of normal
// logits picks such a set): the first `local` experts' row counts and, in expert order, the token of
// each of their rows (GEMM1's gather).
struct Routed {
  std::vector<int> counts, tokens;
};
Routed route(int tokens, int experts, int top_k, int local, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> pick(experts);
  std::vector<std::vector<int>> by_expert(local);
  for (int e = 0; e < experts; ++e) pick[e] = e;
  for (int t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {
      std::uniform_int_distribution<int> d(j, experts - 1);
      std::swap(pick[j], pick[d(rng)]);
      if (pick[j] < local) by_expert[pick[j]].push_back(t);
    }
  }
  Routed r;
  for (const auto& rows : by_expert) {
    r.counts.push_back(int(rows.size()));
    r.tokens.insert(r.tokens.end(), rows.begin(), rows.end());
  }
  return r;
}

struct Device {
  __nv_bfloat16 *x = nullptr, *w = nullptr, *y = nullptr;
  int* offsets = nullptr;
  int* src_rows = nullptr;
  Unit* units = nullptr;
};

float launch(const Problem& p, const Built& b, const Device& d, int sms, bool staged, MedianTimer* timer) {
  const int64_t total = b.offsets.back();
  const CUtensorMap tma_w = tensor_map(d.w, int64_t(p.rows.size()) * p.n_out, p.k, kWRows);
  const CUtensorMap tma_x64 = tensor_map(d.x, std::max<int64_t>(total, 1), p.k, 64);
  const CUtensorMap tma_x16 = tensor_map(d.x, std::max<int64_t>(total, 1), p.k, 16);
  const int smem_bytes = kRingBytes + 1024 + (staged ? kStagedBytes : 0);
  auto kernel = staged ? grouped_kernel<true> : grouped_kernel<false>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  const GroupedArgs a{d.units, int(b.units.size()), p.k / 64, p.n_out, d.y, d.src_rows, d.x, p.k};
  const int grid = std::min<int>(sms, std::max<int>(1, b.units.size()));
  auto run = [&](int) { kernel<<<grid, kThreads, smem_bytes>>>(tma_w, tma_x64, tma_x16, a); };
  run(0);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return timer ? (*timer)(run, 10, 2) : 0.0f;
}

Device upload(const Problem& p, const Built& b) {
  Device d;
  const int64_t total = b.offsets.back(), w_rows = int64_t(p.rows.size()) * p.n_out;
  const int64_t x_rows = std::max<int64_t>(p.src_rows.empty() ? total : p.x_rows, 1);
  CHECK(cudaMalloc(&d.x, x_rows * p.k * 2));
  if (!p.src_rows.empty()) {
    CHECK(cudaMalloc(&d.src_rows, p.src_rows.size() * sizeof(int)));
    CHECK(cudaMemcpy(d.src_rows, p.src_rows.data(), p.src_rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  }
  CHECK(cudaMalloc(&d.w, w_rows * p.k * 2));
  CHECK(cudaMalloc(&d.y, std::max<int64_t>(total, 1) * p.n_out * 2));
  CHECK(cudaMalloc(&d.offsets, b.offsets.size() * sizeof(int)));
  CHECK(cudaMalloc(&d.units, std::max<size_t>(b.units.size(), 1) * sizeof(Unit)));
  fill_kernel<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.x), x_rows * p.k, 11);
  fill_kernel<<<1024, 256>>>(reinterpret_cast<uint16_t*>(d.w), w_rows * p.k, 12);
  CHECK(cudaMemset(d.y, 0xff, std::max<int64_t>(total, 1) * p.n_out * 2));  // NaN where nothing is stored
  CHECK(cudaMemcpy(d.offsets, b.offsets.data(), b.offsets.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d.units, b.units.data(), b.units.size() * sizeof(Unit), cudaMemcpyHostToDevice));
  return d;
}

void release(Device& d) {
  CHECK(cudaFree(d.x));
  CHECK(cudaFree(d.w));
  CHECK(cudaFree(d.y));
  CHECK(cudaFree(d.offsets));
  CHECK(cudaFree(d.src_rows));
  CHECK(cudaFree(d.units));
}

// Largest |y - ref| / (|ref| + 1) over the samples (every output when `all`); exits on a failure.
void check(const Problem& p, const Built& b, const Device& d, bool all) {
  const int total = b.offsets.back();
  std::vector<int2> samples;
  if (all) {
    for (int r = 0; r < total; ++r)
      for (int c = 0; c < p.n_out; ++c) samples.push_back({r, c});
  } else {
    std::mt19937 rng(7);
    std::uniform_int_distribution<int> col(0, p.n_out - 1), row(0, total - 1);
    for (size_t e = 0; e + 1 < b.offsets.size(); ++e) {
      if (b.offsets[e + 1] == b.offsets[e]) continue;
      samples.push_back({b.offsets[e], col(rng)});
      samples.push_back({b.offsets[e + 1] - 1, col(rng)});
    }
    for (int s = 0; s < 4096; ++s) samples.push_back({row(rng), col(rng)});
  }
  int2* d_samples = nullptr;
  float* d_ref = nullptr;
  CHECK(cudaMalloc(&d_samples, samples.size() * sizeof(int2)));
  CHECK(cudaMalloc(&d_ref, samples.size() * sizeof(float)));
  CHECK(cudaMemcpy(d_samples, samples.data(), samples.size() * sizeof(int2), cudaMemcpyHostToDevice));
  const int n = int(samples.size());
  reference_kernel<<<(n + 127) / 128, 128>>>(d.x, d.src_rows, d.w, d.offsets, int(p.rows.size()), d_samples, n,
                                             p.k, p.n_out, d_ref);
  CHECK(cudaGetLastError());
  std::vector<float> ref(n);
  CHECK(cudaMemcpy(ref.data(), d_ref, n * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<__nv_bfloat16> y(int64_t(total) * p.n_out);
  CHECK(cudaMemcpy(y.data(), d.y, y.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0.0;
  for (int s = 0; s < n; ++s) {
    const float got = __bfloat162float(y[int64_t(samples[s].x) * p.n_out + samples[s].y]);
    const double err = std::fabs(double(got) - ref[s]) / (std::fabs(ref[s]) + 1.0);
    if (!(err <= 1e-2)) {
      std::printf("FAIL %s: y[%d, %d] = %g, want %g\n", p.name, samples[s].x, samples[s].y, got, ref[s]);
      std::exit(1);
    }
    worst = std::max(worst, err);
  }
  std::printf("check %-22s %7d outputs ok (largest relative error %.2e)\n", p.name, n, worst);
  CHECK(cudaFree(d_samples));
  CHECK(cudaFree(d_ref));
}

int main() {
  const int sms = print_device();
  for (bool gather : {false, true}) {
    Problem small{gather ? "ragged small, gather" : "ragged small", {0, 1, 15, 17, 256, 257, 300, 0, 64}, 256, 512};
    if (gather) {  // each product row reads a random one of 333 x rows
      std::mt19937 rng(3);
      std::uniform_int_distribution<int> row(0, 332);
      for (int r : small.rows)
        for (int j = 0; j < r; ++j) small.src_rows.push_back(row(rng));
      small.x_rows = 333;
    }
    for (Split split : {Split::kEven, Split::kFull}) {
      for (bool staged : {false, true}) {
        const Built b = build(small, split);
        Device d = upload(small, b);
        launch(small, b, d, sms, staged, nullptr);
        check(small, b, d, true);
        release(d);
      }
    }
  }
  struct Shape {
    const char* name;
    int tokens, experts, top_k, local, n_out, k;
    bool gather;  // token rows of x through the routing (GEMM1; no SwiGLU here), else rows in order by TMA
                  // (GEMM2, and GEMM1 after a gather kernel as main runs it past 2I = 2048)
  };
  const Shape shapes[] = {
      {"qwen3_235b T4096 gemm1", 4096, 128, 8, 128, 3072, 4096, true},
      {"qwen3_235b T4096 gemm1 tma", 4096, 128, 8, 128, 3072, 4096, false},
      {"qwen3_235b T4096 gemm2", 4096, 128, 8, 128, 4096, 1536, false},
      {"qwen3_30b T4096 gemm1", 4096, 128, 8, 128, 1536, 2048, true},
      {"qwen3_30b T4096 gemm1 tma", 4096, 128, 8, 128, 1536, 2048, false},
      {"qwen3_30b T4096 gemm2", 4096, 128, 8, 128, 2048, 768, false},
      {"kimi_ep8 T16384 gemm1", 16384, 384, 8, 48, 4096, 7168, true},
      {"kimi_ep8 T16384 gemm2", 16384, 384, 8, 48, 7168, 2048, false},
  };
  MedianTimer timer;
  std::printf("%-27s %5s %6s %8s %8s %9s %9s | %8s %8s\n", "shape", "split", "store", "ms", "TFLOP/s", "rows+pad",
              "64-pad", "dense ms", "TFLOP/s");
  for (const Shape& s : shapes) {
    const Routed routed = route(s.tokens, s.experts, s.top_k, s.local, 1);
    Problem p{s.name, routed.counts, s.n_out, s.k};
    if (s.gather) p.src_rows = routed.tokens, p.x_rows = s.tokens;
    const int64_t total = std::accumulate(p.rows.begin(), p.rows.end(), int64_t(0));
    const double flops = 2.0 * double(total) * s.n_out * s.k;
    for (bool staged : {false, true}) {
      // The same rows as one expert, in order: full 256-token tiles (what the kernel does at a dense shape).
      const Problem dense{"dense", {int(total)}, s.n_out, s.k};
      const Built bd = build(dense, Split::kFull);
      Device dd = upload(dense, bd);
      const float dense_ms = launch(dense, bd, dd, sms, staged, &timer);
      release(dd);
      for (Split split : {Split::kEven, Split::kFull}) {
        const Built b = build(p, split);
        Device d = upload(p, b);
        const float ms = launch(p, b, d, sms, staged, &timer);
        check(p, b, d, false);
        std::printf("%-27s %5s %6s %8.3f %8.1f %8.1f%% %8.1f%% | %8.3f %8.1f\n", s.name,
                    split == Split::kEven ? "even" : "full", staged ? "staged" : "direct", ms, flops / ms / 1e9,
                    100.0 * (b.mma_rows - total) / total, 100.0 * (b.rows64 - total) / total, dense_ms,
                    flops / dense_ms / 1e9);
        release(d);
      }
    }
  }
  return 0;
}
