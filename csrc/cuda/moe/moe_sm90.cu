// The MoE routing and data-movement kernels around the grouped GEMMs: the token sort, the row
// gather of GEMM1's operand, the SwiGLU of GEMM1's output, the deterministic combine and the fp8
// family's per-tensor quantization. All
// read sizes that depend on the routing from the device (no host synchronisation) and wait for
// their predecessor with PDL (pdl.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cassert>
#include <climits>
#include <cmath>

#include <algorithm>
#include <type_traits>

#include <cooperative_groups.h>

#include <c10/util/Exception.h>

#include "cuda/common/pdl.cuh"
#include "cuda/moe/fp8_e4m3.cuh"
#include "cuda/moe/moe_kernels.h"
#include "cuda/moe/swiglu.cuh"
#include "moe_checks.h"

namespace cake::sm90 {
namespace {

// ---- sort -------------------------------------------------------------------------------------
// A block sorts a chunk of the routes: warp w owns one contiguous segment of the chunk; pass 1
// counts each expert's routes per warp, a scan turns the counts into each (expert, warp) start,
// pass 2 places every route at its start plus its rank among the earlier lanes of the same
// expert. Rows of an expert keep expanded order, so the permutation is deterministic. Up to one
// chunk of routes, one block does it all (one launch, decode); beyond, one cooperative launch of a
// block per chunk (count, grid barrier, scan, place), or, past what the GPU holds at once, a count
// kernel, a scan kernel and a place kernel.
constexpr int kSortThreads = 1024;
constexpr int kSortMaxWarps = kSortThreads / 32;
constexpr int64_t kSortSmemBudget = 200 * 1024;
// The dynamic shared memory the sort kernels (and the routing one that sorts) opt in to: the
// budget sort_smem_bytes stays within, and some slack.
constexpr int kSortSmemOptIn = static_cast<int>(kSortSmemBudget) + 1024;
// kSortUnroll rounds of 32 routes per step: their loads are in flight together.
constexpr int kSortUnroll = 4;
constexpr int kSortStep = 32 * kSortUnroll;
static_assert(kSortStep == kMoeSortRoutesPerStep, "moe_routing_workspace_bytes bounds the blocks by this step");

// Shared memory of a sort block: its warps' [warps][E] counters, [E + 1] starts, and `extra` more
// [E] arrays (the grid sort's rows in earlier blocks); the warps are as many as the budget allows.
int sort_warps(int64_t num_local, int extra = 0) {
  const int64_t warps = (kSortSmemBudget - 4 * ((1 + extra) * num_local + 1)) / (4 * num_local);
  return static_cast<int>(std::clamp<int64_t>(warps, 1, kSortMaxWarps));
}

size_t sort_smem_bytes(int warps, int64_t num_local, int extra = 0) {
  return sizeof(int32_t) * (size_t(warps) * num_local + (1 + extra) * num_local + 1);
}

// A one-block sort's warps and threads sized to its work: a sort warp per kSortStep routes, a
// thread warp per token being routed (one warp each), at least 4. Decode's 8 routes had run on
// 32 sort warps in 1024 threads: 31 warps zeroed their counters, the per-expert scan walked 32
// of them, and every barrier waited for 1024 threads.
struct OneBlockShape {
  int sort_warps;
  int threads;
};
OneBlockShape one_block_shape(int64_t routes, int64_t tokens, int64_t num_local) {
  const int64_t sort = std::clamp<int64_t>((routes + kSortStep - 1) / kSortStep, 1, sort_warps(num_local));
  const int64_t warps = std::clamp<int64_t>(std::max(sort, tokens), 4, kSortMaxWarps);
  return {static_cast<int>(sort), static_cast<int>(32 * warps)};
}

__device__ __forceinline__ int local_key(int32_t id, const MoeSortArgs& a) {
  const int local = id - a.local_expert_offset;
  const bool kept = id >= 0 && id < a.num_experts && local >= 0 && local < a.num_local_experts;
  return kept ? local : -1;
}

__device__ __forceinline__ void load_keys(const MoeSortArgs& a, int64_t base, int64_t end, int lane,
                                          int (&keys)[kSortUnroll]) {
  int32_t ids[kSortUnroll];
#pragma unroll
  for (int u = 0; u < kSortUnroll; ++u) {
    const int64_t r = base + 32 * u + lane;
    ids[u] = r < end ? a.ids[r] : -1;  // not __ldg: the fused routing kernel writes the ids it sorts
  }
#pragma unroll
  for (int u = 0; u < kSortUnroll; ++u) {
    keys[u] = base + 32 * u + lane < end ? local_key(ids[u], a) : -1;
  }
}

// The segment of [begin, end) that warp `warp` of `warps` owns.
struct Segment {
  int64_t begin, end;
};
__device__ __forceinline__ Segment warp_segment(int64_t begin, int64_t end, int warp, int warps) {
  const int64_t len = ((end - begin + warps - 1) / warps + kSortStep - 1) / kSortStep * kSortStep;
  const int64_t b = begin + warp * len;
  return {b, std::min(end, b + len)};
}

// Pass 1 over [begin, end), then each (warp, expert) start within the chunk's expert rows;
// totals[e] = the chunk's rows of expert e. warp_base is [warps][E] shared memory.
__device__ void count_chunk(const MoeSortArgs& a, int64_t begin, int64_t end, int warps, int32_t* warp_base,
                            int32_t* totals) {
  const int E = a.num_local_experts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < warps * E; i += blockDim.x) warp_base[i] = 0;
  __syncthreads();
  if (warp < warps) {
    const Segment seg = warp_segment(begin, end, warp, warps);
    int32_t* mine = warp_base + warp * E;
    for (int64_t base = seg.begin; base < seg.end; base += kSortStep) {
      int keys[kSortUnroll];
      load_keys(a, base, seg.end, lane, keys);
      // Counts need no order among equal keys: shared-memory atomics, not match_any (whose cost
      // per step is what benchmarks/sort_variants.cu measures).
#pragma unroll
      for (int u = 0; u < kSortUnroll; ++u) {
        if (keys[u] >= 0) atomicAdd(mine + keys[u], 1);
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

// Warp 0: counts, offsets and tile offsets from the experts' totals, which become each expert's
// first row (starts[E] = the number of kept routes); `publish`: also write them to a's outputs.
__device__ void scan_experts(const MoeSortArgs& a, int32_t* starts, bool publish = true) {
  const int E = a.num_local_experts;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int carry = 0, tile_carry = 0;
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      const int count = e < E ? starts[e] : 0;
      const int tiles = (count + a.tile_size - 1) / a.tile_size;
      int incl = count, tile_incl = tiles;
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, incl, d);
        const int tile_up = __shfl_up_sync(0xffffffffu, tile_incl, d);
        if (lane >= d) {
          incl += up;
          tile_incl += tile_up;
        }
      }
      if (e < E) {
        if (publish) {
          a.counts[e] = count;
          a.offsets[e + 1] = carry + incl;
          a.tile_offsets[e + 1] = tile_carry + tile_incl;
        }
        starts[e] = carry + incl - count;
      }
      carry += __shfl_sync(0xffffffffu, incl, 31);
      tile_carry += __shfl_sync(0xffffffffu, tile_incl, 31);
    }
    if (lane == 0) {
      if (publish) {
        a.offsets[0] = 0;
        a.tile_offsets[0] = 0;
      }
      starts[E] = carry;
    }
  }
  __syncthreads();
}

// Pass 2 over [begin, end): route r goes to row starts[e] + its warp's start + its rank.
__device__ void place_chunk(const MoeSortArgs& a, int64_t begin, int64_t end, int warps, int32_t* warp_base,
                            const int32_t* starts) {
  const int E = a.num_local_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp >= warps) return;
  const Segment seg = warp_segment(begin, end, warp, warps);
  int32_t* mine = warp_base + warp * E;
  for (int64_t base = seg.begin; base < seg.end; base += kSortStep) {
    int keys[kSortUnroll];
    load_keys(a, base, seg.end, lane, keys);
#pragma unroll
    for (int u = 0; u < kSortUnroll; ++u) {
      const int64_t r = base + 32 * u + lane;
      const int key = keys[u];
      const unsigned peers = __match_any_sync(0xffffffffu, key);
      if (key >= 0) {
        const int pos = starts[key] + mine[key] + __popc(peers & ((1u << lane) - 1));
        a.permuted_to_expanded[pos] = static_cast<int32_t>(r);
        a.expanded_to_permuted[r] = pos;
      } else if (r < seg.end) {
        a.expanded_to_permuted[r] = -1;
      }
      __syncwarp();
      if (key >= 0 && lane == __ffs(peers) - 1) mine[key] += __popc(peers);
      __syncwarp();
    }
  }
}

// permuted_to_expanded past the kept rows: -1 (grid-stride over every block).
__device__ void fill_tail(const MoeSortArgs& a, int64_t kept) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = kept + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < a.routes; i += stride) {
    a.permuted_to_expanded[i] = -1;
  }
}

// All of a.routes in one block (dynamic shared memory: sort_smem_bytes).
__device__ void sort_one_block(const MoeSortArgs& a, int warps, int32_t* smem) {
  int32_t* warp_base = smem;                                // [warps][E]
  int32_t* starts = smem + warps * a.num_local_experts;     // [E + 1]
  count_chunk(a, 0, a.routes, warps, warp_base, starts);
  scan_experts(a, starts);
  place_chunk(a, 0, a.routes, warps, warp_base, starts);
  fill_tail(a, starts[a.num_local_experts]);
}

__global__ void __launch_bounds__(kSortThreads) moe_sort_one_block_kernel(MoeSortArgs a, int warps) {
  extern __shared__ int32_t smem[];
  pdl_wait();
  pdl_launch_dependents();
  sort_one_block(a, warps, smem);
}

// Multi-block sort, 1/3: each block's per-expert totals -> block_rows [blocks][E].
__global__ void __launch_bounds__(kSortThreads) moe_sort_count_kernel(MoeSortArgs a, int warps, int64_t chunk,
                                                                      int32_t* block_rows) {
  extern __shared__ int32_t smem[];
  pdl_wait();
  pdl_launch_dependents();
  const int E = a.num_local_experts;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  count_chunk(a, begin, std::min(a.routes, begin + chunk), warps, smem, smem + warps * E);
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_rows[int64_t(blockIdx.x) * E + e] = smem[warps * E + e];
}

// 2/3 (one block): block_rows becomes each (block, expert)'s first row; counts and offsets.
__global__ void __launch_bounds__(kSortThreads) moe_sort_scan_kernel(MoeSortArgs a, int blocks, int32_t* block_rows) {
  extern __shared__ int32_t starts[];  // [E + 1]
  pdl_wait();
  pdl_launch_dependents();
  const int E = a.num_local_experts;
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

// 3/3: each block recounts its chunk and places its routes from its (block, expert) rows.
__global__ void __launch_bounds__(kSortThreads) moe_sort_place_kernel(MoeSortArgs a, int warps, int64_t chunk,
                                                                      const int32_t* block_rows) {
  extern __shared__ int32_t smem[];
  pdl_wait();
  pdl_launch_dependents();
  const int E = a.num_local_experts;
  int32_t* warp_base = smem;
  int32_t* starts = smem + warps * E;
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = std::min(a.routes, begin + chunk);
  count_chunk(a, begin, end, warps, warp_base, starts);  // starts: this chunk's totals (unused)
  for (int e = threadIdx.x; e < E; e += blockDim.x) starts[e] = block_rows[int64_t(blockIdx.x) * E + e];
  __syncthreads();
  place_chunk(a, begin, end, warps, warp_base, starts);
  fill_tail(a, a.offsets[E]);
}

// The multi-block sort in one cooperative launch, a block per chunk: each block counts its chunk
// (its warps' starts stay in shared memory) and publishes its per-expert totals to block_rows
// [blocks][E]; after the grid barrier every block sums them into each expert's total (the scan:
// block 0 writes counts and offsets) and its rows in the blocks before it, then places its chunk.
// One launch and one count pass where the three kernels above take three launches and two.
// Shared memory: sort_smem_bytes(warps, E, 1).
__global__ void __launch_bounds__(kSortThreads) moe_sort_grid_kernel(MoeSortArgs a, int warps, int64_t chunk,
                                                                     int32_t* block_rows) {
  extern __shared__ int32_t smem[];
  pdl_wait();
  pdl_launch_dependents();
  const int E = a.num_local_experts;
  int32_t* warp_base = smem;                // [warps][E]
  int32_t* starts = warp_base + warps * E;  // [E + 1]
  int32_t* before = starts + E + 1;         // [E]: the expert's rows in the blocks before this one
  const int64_t begin = int64_t(blockIdx.x) * chunk;
  const int64_t end = std::min(a.routes, begin + chunk);
  count_chunk(a, begin, end, warps, warp_base, starts);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    block_rows[int64_t(blockIdx.x) * E + e] = starts[e];
    starts[e] = 0;
    before[e] = 0;
  }
  cooperative_groups::this_grid().sync();
  // Every (block, expert) total, kUnroll loads in flight per thread.
  constexpr int kUnroll = 4;
  const int64_t n = int64_t(gridDim.x) * E;
  for (int64_t i0 = threadIdx.x; i0 < n; i0 += kUnroll * blockDim.x) {
    int32_t c[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * blockDim.x;
      c[u] = i < n ? block_rows[i] : 0;  // not __ldg: written in this launch
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * blockDim.x;
      if (i >= n || c[u] == 0) continue;
      const int e = static_cast<int>(i % E);
      atomicAdd(starts + e, c[u]);
      if (i / E < blockIdx.x) atomicAdd(before + e, c[u]);
    }
  }
  __syncthreads();
  scan_experts(a, starts, blockIdx.x == 0);
  for (int e = threadIdx.x; e < E; e += blockDim.x) starts[e] += before[e];
  __syncthreads();
  place_chunk(a, begin, end, warps, warp_base, starts);
  fill_tail(a, starts[E]);
}

// ---- gather -----------------------------------------------------------------------------------
constexpr int kGatherRowsPerBlock = 8;  // one warp per row

// The token whose x row permuted row `row` gathers; its route index checked (a device-side assert
// naming the op: the GPU path never reads the permutation on the host).
__device__ __forceinline__ int64_t gathered_token(const int32_t* permuted_to_expanded, int64_t row, int64_t rows,
                                                  int top_k) {
  const int32_t expanded = permuted_to_expanded[row];
  if (expanded < 0 || expanded >= rows) {
    __assert_fail("cake::moe_gemm1_swiglu: permuted_to_expanded must hold route indices in [0, num_tokens * top_k) "
                  "for the rows below expert_offsets[E]", __FILE__, __LINE__, __func__);
  }
  return expanded / top_k;
}

__global__ void __launch_bounds__(32 * kGatherRowsPerBlock)
    moe_gather_kernel(const uint4* x, int64_t row_vecs, const int32_t* permuted_to_expanded, int top_k,
                      const int32_t* num_kept, int64_t rows, uint4* gathered) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t row = int64_t(blockIdx.x) * kGatherRowsPerBlock + threadIdx.x / 32;
  if (row >= rows || row >= *num_kept) return;
  const uint4* __restrict__ src = x + gathered_token(permuted_to_expanded, row, rows, top_k) * row_vecs;
  uint4* __restrict__ dst = gathered + row * row_vecs;
  // Up to kCopyUnroll loads in flight per lane before the stores.
  constexpr int kCopyUnroll = 8;
  for (int64_t i0 = threadIdx.x % 32; i0 < row_vecs; i0 += 32 * kCopyUnroll) {
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (i0 + 32 * u < row_vecs) v[u] = __ldg(src + i0 + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (i0 + 32 * u < row_vecs) dst[i0 + 32 * u] = v[u];
    }
  }
}

// ---- the gather in token order (large x) ------------------------------------------------------
// In permuted order a token's top_k reads of x come a whole kernel apart, under the gathered
// rows' writes: once x outgrows L2 it is read from DRAM top_k times. In token order each x row is
// read once and written top_k times (benchmarks/gather_order.cu, H200: -29% at Qwen3-30B T=16384,
// -33% at Qwen3-235B). That order needs the inverse of permuted_to_expanded on the kept rows,
// which only a permutation has: `inverse` ([rows + 1] int32) is all -1 (a memset) before
// moe_invert_kernel; a second row naming the same route clears inverse[rows], and the gather then
// copies row by row (any mapping stays legal input). A caller holding moe_sort's
// expanded_to_permuted passes that instead (no memset, no invert kernel, no break in the PDL
// chain: ~4 us at Qwen3-30B T=4096); the gather checks each of its rows against
// permuted_to_expanded.
constexpr int64_t kTokenOrderMinXBytes = 16 << 20;  // x smaller than this stays in L2 anyway

__global__ void moe_invert_kernel(const int32_t* permuted_to_expanded, const int32_t* num_kept, int64_t rows,
                                  int32_t* inverse) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t kept = min(int64_t(*num_kept), rows);
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < kept; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t route = gathered_token(permuted_to_expanded, p, rows, 1);  // checked as the gather does
    if (atomicExch(inverse + route, static_cast<int32_t>(p)) != -1) inverse[rows] = 0;
  }
}

// Where moe_gather_tokens_kernel's rows go: copied as they are (16 bytes of x to 16 bytes).
struct CopiedRows {
  uint4* gathered;
  __device__ __forceinline__ void prepare() {}
  __device__ __forceinline__ void put(int64_t index, const uint4& v) const { gathered[index] = v; }
};

// One warp per token: x[t] read once, written to the permuted rows of its kept routes; or, when
// the mapping is no permutation, the warp copies the permuted rows [t * top_k, (t + 1) * top_k).
// `out` (CopiedRows, QuantizedRows) writes 16-byte piece `index` of the gathered rows.
// `no_permutation`: the invert kernel's flag (inverse + rows), or null for a caller's inverse.
template <class Rows>
__global__ void __launch_bounds__(32 * kGatherRowsPerBlock)
    moe_gather_tokens_kernel(const uint4* x, int64_t row_vecs, const int32_t* permuted_to_expanded, int top_k,
                             const int32_t* num_kept, int64_t tokens, int64_t rows, const int32_t* inverse,
                             const int32_t* no_permutation, Rows out) {
  pdl_wait();
  pdl_launch_dependents();
  out.prepare();
  const int64_t t = int64_t(blockIdx.x) * kGatherRowsPerBlock + threadIdx.x / 32;
  if (t >= tokens) return;
  constexpr int kCopyUnroll = 8;
  if (no_permutation != nullptr && __ldcg(no_permutation) != -1) {
    const int64_t kept = min(int64_t(*num_kept), rows);
    for (int64_t row = t * top_k; row < (t + 1) * top_k && row < kept; ++row) {
      const uint4* __restrict__ src = x + gathered_token(permuted_to_expanded, row, rows, top_k) * row_vecs;
      for (int64_t i = threadIdx.x % 32; i < row_vecs; i += 32) out.put(row * row_vecs + i, __ldg(src + i));
    }
    return;
  }
  const uint4* __restrict__ src = x + t * row_vecs;
  const int lane = threadIdx.x % 32;
  // The token's routes, up to 32 at a time, one per lane: their rows load (and are checked) in parallel, not one
  // dependent load per route (+4 us at Qwen3-30B T=4096 with the check), then reach the warp by shuffles.
  for (int j0 = 0; j0 < top_k; j0 += 32) {
    const int routes = min(32, top_k - j0);
    const int64_t route = t * top_k + j0 + lane;
    const int32_t lane_row = lane < routes ? __ldcg(inverse + route) : -1;  // -1: a dropped route (outside the shard)
    if (no_permutation == nullptr && lane_row >= 0 &&
        (lane_row >= rows || __ldg(permuted_to_expanded + lane_row) != route)) {
      __assert_fail("cake::moe_gemm1_swiglu: expanded_to_permuted must be the inverse of permuted_to_expanded "
                    "(moe_sort's)", __FILE__, __LINE__, __func__);
    }
    // Warp-uniform trip counts (the shuffles need every lane); lanes past the row skip their copies.
    for (int64_t base = 0; base < row_vecs; base += 32 * kCopyUnroll) {
      const int64_t i0 = base + lane;
      uint4 v[kCopyUnroll];
#pragma unroll
      for (int u = 0; u < kCopyUnroll; ++u) {
        if (i0 + 32 * u < row_vecs) v[u] = __ldg(src + i0 + 32 * u);
      }
      for (int j = 0; j < routes; ++j) {
        const int32_t row = __shfl_sync(0xffffffffu, lane_row, j);
        if (row < 0) continue;
#pragma unroll
        for (int u = 0; u < kCopyUnroll; ++u) {
          if (i0 + 32 * u < row_vecs) out.put(int64_t(row) * row_vecs + i0 + 32 * u, v[u]);
        }
      }
    }
  }
}

// The token-order gather of `rows` routes: through the caller's expanded_to_permuted, or an
// inverse built in `scratch` (memset, invert), then one warp per token.
template <class Rows>
void launch_gather_tokens(const void* x, int64_t row_vecs, const int32_t* permuted_to_expanded, int top_k,
                          const int32_t* num_kept, int64_t rows, const GatherInverse& inverse, Rows out,
                          cudaStream_t stream, bool pdl) {
  const int32_t* route_rows = inverse.expanded_to_permuted;
  const int32_t* no_permutation = nullptr;
  if (route_rows == nullptr) {
    // The memset is no kernel: the invert kernel after it launches without PDL.
    C10_CUDA_CHECK(cudaMemsetAsync(inverse.scratch, 0xff, (rows + 1) * sizeof(int32_t), stream));
    const int64_t invert_blocks = std::min<int64_t>((rows + 255) / 256, 4096);
    launch_kernel(moe_invert_kernel, dim3(static_cast<unsigned>(invert_blocks)), dim3(256), 0, stream, false,
                  permuted_to_expanded, num_kept, rows, inverse.scratch);
    route_rows = inverse.scratch;
    no_permutation = inverse.scratch + rows;
  }
  const int64_t tokens = rows / top_k;
  const int64_t blocks = (tokens + kGatherRowsPerBlock - 1) / kGatherRowsPerBlock;
  launch_kernel(moe_gather_tokens_kernel<Rows>, dim3(static_cast<unsigned>(blocks)), dim3(32 * kGatherRowsPerBlock),
                0, stream, pdl, static_cast<const uint4*>(x), row_vecs, permuted_to_expanded, top_k, num_kept,
                tokens, rows, route_rows, no_permutation, out);
}

// ---- element conversions (8 values per 16 bytes) ----------------------------------------------
template <class T>
struct Pair;  // the two-element vector of T and its float conversions
template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ float2 to_float2(Type v) { return __bfloat1622float2(v); }
  static __device__ Type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair<__half> {
  using Type = __half2;
  static __device__ float2 to_float2(Type v) { return __half22float2(v); }
  static __device__ Type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

template <class T>
struct Vec8 {
  using P = Pair<T>;
  static __device__ void load(const uint4& v, float* f) {
    const auto* h = reinterpret_cast<const typename P::Type*>(&v);
    for (int i = 0; i < 4; ++i) {
      const float2 p = P::to_float2(h[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ uint4 store(const float* f) {
    uint4 v;
    auto* h = reinterpret_cast<typename P::Type*>(&v);
    for (int i = 0; i < 4; ++i) h[i] = P::from_floats(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

// ---- SwiGLU -----------------------------------------------------------------------------------
// block (32, kSwigluRows): threadIdx.x walks the 16-byte output vectors of a row, threadIdx.y rows.
constexpr int kSwigluRows = 8;

// min(x, hi) and max(x, lo) that keep a NaN, as torch.clamp does (fminf / fmaxf would drop it).
__device__ __forceinline__ float clamp_high(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp_low(float x, float lo) { return x < lo ? lo : x; }

// A 64-column chunk of h is 8 vectors: up in vectors 0-3, gate in 4-7 (32-row interleave); with gate_up,
// h is [gate | up] halves of inter_vecs vectors each.
template <class T>
__global__ void __launch_bounds__(32 * kSwigluRows)
    moe_swiglu_kernel(const uint4* __restrict__ h, int64_t rows, int64_t inter_vecs, const int32_t* offsets,
                      int num_experts, const float* limits, bool gate_up, float clamp_limit,
                      uint4* __restrict__ out) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t kept = offsets == nullptr ? rows : std::min<int64_t>(offsets[num_experts], rows);
  const int64_t v = int64_t(blockIdx.x) * 32 + threadIdx.x;
  if (v >= inter_vecs) return;
  for (int64_t row = int64_t(blockIdx.y) * kSwigluRows + threadIdx.y; row < rows;
       row += int64_t(gridDim.y) * kSwigluRows) {
    uint4* dst = out + row * inter_vecs + v;
    if (row >= kept) {
      *dst = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4* h_row = h + row * 2 * inter_vecs;
    const uint4* up_vec = gate_up ? h_row + inter_vecs + v : h_row + (v / 4) * 8 + v % 4;
    const uint4* gate_vec = gate_up ? h_row + v : h_row + (v / 4) * 8 + 4 + v % 4;
    float up[8], gate[8], r[8];
    Vec8<T>::load(__ldg(up_vec), up);
    Vec8<T>::load(__ldg(gate_vec), gate);
    if (limits == nullptr) {
      if (clamp_limit != INFINITY) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          gate[j] = clamp_high(gate[j], clamp_limit);
          up[j] = clamp_high(clamp_low(up[j], -clamp_limit), clamp_limit);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = swiglu_value(up[j], gate[j], false, 0.0f);
    } else {
      // SwiGLUStep: the row's expert is the last e with offsets[e] <= row.
      int lo = 0, hi = num_experts - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (__ldg(offsets + mid) <= row) lo = mid; else hi = mid - 1;
      }
      const float limit = __ldg(limits + lo);
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = swiglu_value(up[j], gate[j], true, limit);
    }
    *dst = Vec8<T>::store(r);
  }
}

// The SwiGLU's gradients, [gate | up] halves, moe_swiglu_kernel's grid. sigmoid with IEEE division: it must
// reach 0 for a large negative gate (exp = inf), where the gradients are 0.
template <class T>
__global__ void __launch_bounds__(32 * kSwigluRows)
    swiglu_backward_kernel(const uint4* __restrict__ grad, const uint4* __restrict__ gate_up, int64_t rows,
                           int64_t inter_vecs, float clamp_limit, uint4* __restrict__ d_gate_up) {
  const bool clamp = clamp_limit != INFINITY;
  const int64_t v = int64_t(blockIdx.x) * 32 + threadIdx.x;
  if (v >= inter_vecs) return;
  for (int64_t row = int64_t(blockIdx.y) * kSwigluRows + threadIdx.y; row < rows;
       row += int64_t(gridDim.y) * kSwigluRows) {
    const uint4* src = gate_up + row * 2 * inter_vecs;
    float gate[8], up[8], g[8], d_gate[8], d_up[8];
    Vec8<T>::load(__ldg(src + v), gate);
    Vec8<T>::load(__ldg(src + inter_vecs + v), up);
    Vec8<T>::load(__ldg(grad + row * inter_vecs + v), g);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float g_gate = g[j], g_up = g[j];
      if (clamp) {  // clamp's gradient as torch 2.14's: through where the value is strictly inside its bounds
        g_gate = gate[j] < clamp_limit ? g_gate : 0.0f;
        g_up = up[j] > -clamp_limit && up[j] < clamp_limit ? g_up : 0.0f;
        gate[j] = clamp_high(gate[j], clamp_limit);
        up[j] = clamp_high(clamp_low(up[j], -clamp_limit), clamp_limit);
      }
      const float sigmoid = 1.0f / (1.0f + __expf(-gate[j]));
      const float silu = gate[j] * sigmoid;
      d_up[j] = g_up * silu;
      d_gate[j] = g_gate * up[j] * (sigmoid + silu * (1.0f - sigmoid));
    }
    uint4* dst = d_gate_up + row * 2 * inter_vecs;
    dst[v] = Vec8<T>::store(d_gate);
    dst[inter_vecs + v] = Vec8<T>::store(d_up);
  }
}

// ---- routing (Renormalize top-k) ---------------------------------------------------------------
constexpr int kRoutingWarps = 4;  // one warp per token

// (value, id) a beats (value, id) b: larger value, then lower id.
__device__ __forceinline__ bool beats(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// Token t's Renormalize routing by one warp: top-k of its logits (ties to the lower id), softmax
// over the k picks in float32, into ids / weights [t * top_k, (t + 1) * top_k).
// kPerLane: the experts each lane holds (num_experts <= 32 * kPerLane), sized to the model's
// experts by the host (one warp is the whole routing of a decode step: its instructions are the
// routing kernel's latency).
template <int kPerLane, class T>
__device__ void topk_softmax_token(const T* logits, int64_t t, int num_experts, int top_k, int32_t* ids,
                                   float* weights) {
  const int lane = threadIdx.x & 31;
  // Lane l holds experts l, l + 32, ...; taken ones become -inf with id INT_MAX (never chosen).
  float v[kPerLane];
  int id[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    float x = e < num_experts ? load_float(logits + t * num_experts + e) : -INFINITY;
    if (isnan(x)) x = -INFINITY;
    v[i] = x;
    id[i] = e < num_experts ? e : INT_MAX;
  }
  // Lane j keeps pick j (its logit and id); every lane keeps the first pick's logit, the largest.
  float my_top = -INFINITY, top0 = -INFINITY;
  int top_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -INFINITY;
    int best_id = INT_MAX;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (beats(v[i], id[i], best, best_id)) {
        best = v[i];
        best_id = id[i];
      }
    }
    for (int d = 16; d > 0; d /= 2) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, d);
      const int oi = __shfl_xor_sync(0xffffffffu, best_id, d);
      if (beats(ov, oi, best, best_id)) {
        best = ov;
        best_id = oi;
      }
    }
    if (j == 0) top0 = best;
    if (lane == j) {
      my_top = best;
      top_id = best_id;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (id[i] == best_id) {
        v[i] = -INFINITY;
        id[i] = INT_MAX;
      }
    }
  }
  // Softmax over the k picks in float32, summed in pick order.
  float sum = 0.f;
  for (int j = 0; j < top_k; ++j) sum += expf(__shfl_sync(0xffffffffu, my_top, j) - top0);
  if (lane < top_k) {
    ids[t * top_k + lane] = top_id;
    weights[t * top_k + lane] = expf(my_top - top0) / sum;
  }
}

// Calls f(std::integral_constant<int, P>()) with P, the experts per lane of the routing's warps,
// the smallest power of two >= num_experts / 32 (at least 2, at most kMaxPerLane).
template <int kMaxPerLane, class F>
void with_experts_per_lane(int num_experts, F&& f) {
  if (num_experts <= 64) return f(std::integral_constant<int, 2>());
  if (num_experts <= 128 || kMaxPerLane <= 4) return f(std::integral_constant<int, 4>());
  if (num_experts <= 256 || kMaxPerLane <= 8) return f(std::integral_constant<int, 8>());
  if (num_experts <= 512 || kMaxPerLane <= 16) return f(std::integral_constant<int, 16>());
  return f(std::integral_constant<int, (kMaxPerLane < 32 ? 16 : 32)>());
}

// Calls f with the logits as a pointer to their element type.
template <class F>
void with_float_type(const void* logits, FloatType type, F&& f) {
  switch (type) {
    case FloatType::kFloat:
      return f(static_cast<const float*>(logits));
    case FloatType::kBFloat16:
      return f(static_cast<const __nv_bfloat16*>(logits));
    case FloatType::kHalf:
      return f(static_cast<const __half*>(logits));
  }
}

template <int kPerLane, class T>
__global__ void __launch_bounds__(32 * kRoutingWarps)
    moe_topk_softmax_kernel(const T* logits, int64_t tokens, int num_experts, int top_k, int32_t* ids,
                            float* weights) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = int64_t(blockIdx.x) * kRoutingWarps + threadIdx.x / 32;
  if (t < tokens) topk_softmax_token<kPerLane>(logits, t, num_experts, top_k, ids, weights);
}

// Decode: the routing of a few tokens and the sort of their routes in one block, one launch
// instead of two. Its warps take the tokens in turn, then the block sorts as
// moe_sort_one_block_kernel (the ids it wrote are visible to the block after the barrier). At
// most 512 experts: 16 per lane keep a 1024-thread block within its 64 registers a thread.
template <int kPerLane, class T>
__global__ void __launch_bounds__(kSortThreads)
    moe_route_and_sort_one_block_kernel(const T* logits, int64_t tokens, int top_k, int32_t* ids, float* weights,
                                        MoeSortArgs a, int warps) {
  extern __shared__ int32_t smem[];
  pdl_wait();
  pdl_launch_dependents();
  for (int64_t t = threadIdx.x / 32; t < tokens; t += blockDim.x / 32) {
    topk_softmax_token<kPerLane>(logits, t, a.num_experts, top_k, ids, weights);
  }
  __syncthreads();
  sort_one_block(a, warps, smem);
}

// ---- finalize ---------------------------------------------------------------------------------
constexpr int kFinalizeThreads = 128;
constexpr int kFinalizeMaxTopK = 64;  // routes per token staged in shared memory
constexpr int64_t kFinalizeFillCtas = 2048;  // ~ the CTAs of 128 threads the GPU holds at once (132 x 16)

// Each thread sums kFinalizeVecs vectors of the token's row at a time, their routes' loads in flight
// together: on an expert-parallel shard a token keeps ~top_k / EP routes (the Kimi-K2 EP8 shard: ~1
// of 8), so one vector per thread left ~1 load in flight per thread (150 us at T=16384, ~3.1 TB/s).
constexpr int kFinalizeVecs = 2;

template <class T>
__global__ void __launch_bounds__(kFinalizeThreads)
    moe_finalize_kernel(const uint4* __restrict__ rows, int64_t hidden_vecs, const int32_t* expanded_to_permuted,
                        const float* scales, int top_k, int64_t num_rows, uint4* __restrict__ out) {
  __shared__ int32_t route_row[kFinalizeMaxTopK];
  __shared__ float route_scale[kFinalizeMaxTopK];
  __shared__ int kept;
  pdl_wait();
  pdl_launch_dependents();
  const int64_t t = blockIdx.x;
  // The token's kept routes, compacted in route order (dropped ones add no term).
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    int count = 0;
    for (int base = 0; base < top_k; base += 32) {
      const int j = base + lane;
      int32_t p = -1;
      float scale = 0.0f;
      if (j < top_k) {
        p = expanded_to_permuted[t * top_k + j];
        if (p >= num_rows || p < -1) {
          __assert_fail("cake::moe_finalize: expanded_to_permuted must hold -1 or row indices below "
                        "permuted_rows.size(0)", __FILE__, __LINE__, __func__);
        }
        scale = scales[t * top_k + j];
      }
      const unsigned mask = __ballot_sync(0xffffffffu, p >= 0);
      if (p >= 0) {
        const int slot = count + __popc(mask & ((1u << lane) - 1));
        route_row[slot] = p;
        route_scale[slot] = scale;
      }
      count += __popc(mask);
    }
    if (lane == 0) kept = count;
  }
  __syncthreads();
  const int routes = kept;
  // This CTA's share of the token's row: blockIdx.y of gridDim.y slices.
  const int64_t slice = (hidden_vecs + gridDim.y - 1) / gridDim.y;
  const int64_t end = std::min(hidden_vecs, (blockIdx.y + 1) * slice);
  for (int64_t v0 = blockIdx.y * slice + threadIdx.x; v0 < end; v0 += kFinalizeVecs * blockDim.x) {
    float acc[kFinalizeVecs][8] = {};
    // kUnroll routes' loads of each vector go out together; the sum then runs in route order.
    constexpr int kUnroll = 4;
    for (int j0 = 0; j0 < routes; j0 += kUnroll) {
      uint4 val[kUnroll][kFinalizeVecs];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int q = 0; q < kFinalizeVecs; ++q) {
          const int64_t v = v0 + q * blockDim.x;
          if (j0 + u < routes && v < end) val[u][q] = __ldg(rows + int64_t(route_row[j0 + u]) * hidden_vecs + v);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (j0 + u >= routes) break;
        const float scale = route_scale[j0 + u];
#pragma unroll
        for (int q = 0; q < kFinalizeVecs; ++q) {
          if (v0 + q * blockDim.x >= end) continue;
          float f[8];
          Vec8<T>::load(val[u][q], f);
          // Explicit roundings: no contraction into FMA, the same sum on every build.
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[q][i] = __fadd_rn(acc[q][i], __fmul_rn(scale, f[i]));
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kFinalizeVecs; ++q) {
      const int64_t v = v0 + q * blockDim.x;
      if (v < end) out[t * hidden_vecs + v] = Vec8<T>::store(acc[q]);
    }
  }
}

// ---- moe_finalize's gradients ------------------------------------------------------------------
// Two passes, no atomics on values (bitwise reproducible). Pass 1 inverts expanded_to_permuted into
// route_of_row (filled with -1 before), claiming each row with atomicCAS so that a row two kept routes
// read is a device-side error; a dropped route's scale gradient is 0. Pass 2: a warp per permuted row.
__global__ void finalize_route_of_row_kernel(const int32_t* __restrict__ expanded_to_permuted, int64_t routes,
                                             int64_t num_rows, int32_t* route_of_row, float* scales_grad) {
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < routes; r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t p = expanded_to_permuted[r];
    if (p >= num_rows || p < -1) {
      __assert_fail("cake::moe_finalize_backward: expanded_to_permuted must hold -1 or row indices below num_rows",
                    __FILE__, __LINE__, __func__);
    }
    if (p < 0) {
      if (scales_grad != nullptr) scales_grad[r] = 0.0f;
    } else if (atomicCAS(route_of_row + p, -1, static_cast<int32_t>(r)) != -1) {
      __assert_fail("cake::moe_finalize_backward: the kept routes of expanded_to_permuted must read distinct rows",
                    __FILE__, __LINE__, __func__);
    }
  }
}

constexpr int kFinalizeBackwardWarps = 4;

// Row p of route r = (t, j): rows_grad[p] = scale[r] * grad[t] (float32 product, one rounding), and with rows,
// scales_grad[r] = sum_h rows[p, h] * grad[t, h] in float32 (each lane in order, then a fixed butterfly); a row
// no route reads gets zeros.
template <class T>
__global__ void __launch_bounds__(32 * kFinalizeBackwardWarps)
    finalize_backward_kernel(const uint4* __restrict__ grad, const uint4* __restrict__ rows,
                             const int32_t* __restrict__ route_of_row, const float* __restrict__ scales, int top_k,
                             int64_t num_rows, int64_t hidden_vecs, uint4* __restrict__ rows_grad,
                             float* __restrict__ scales_grad) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kFinalizeBackwardWarps + (threadIdx.x >> 5);
  if (row >= num_rows) return;  // warp-uniform, as every branch below
  uint4* dst = rows_grad + row * hidden_vecs;
  const int32_t r = route_of_row[row];
  if (r < 0) {
    for (int64_t v = lane; v < hidden_vecs; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    return;
  }
  const float scale = scales[r];
  const uint4* g_row = grad + int64_t(r / top_k) * hidden_vecs;
  const uint4* x_row = rows != nullptr ? rows + row * hidden_vecs : nullptr;
  float dot = 0.0f;
#pragma unroll 4
  for (int64_t v = lane; v < hidden_vecs; v += 32) {
    float g[8], d[8];
    Vec8<T>::load(__ldg(g_row + v), g);
#pragma unroll
    for (int i = 0; i < 8; ++i) d[i] = __fmul_rn(scale, g[i]);
    dst[v] = Vec8<T>::store(d);
    if (x_row != nullptr) {
      float x[8];
      Vec8<T>::load(__ldg(x_row + v), x);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot = __fadd_rn(dot, __fmul_rn(x[i], g[i]));
    }
  }
  if (scales_grad != nullptr) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, offset));
    if (lane == 0) scales_grad[r] = dot;
  }
}

// ---- fp8 per-tensor quantization ----------------------------------------------------------------
// Grid-stride passes over 16-byte vectors of x (then the last few elements one by one); the amax
// over the bits of |x| (amax_bits_strided, fp8_e4m3.cuh). A dynamic scale over a small x (decode: the
// hidden states and fc1's output of a few tokens) is one kernel of one block: amax, then quantize.
// Larger x takes three: the amax (atomicMax), the quantization, which derives the scale from that
// amax, and the amax's replacement by the scale.
constexpr int kQuantThreads = 256;
constexpr int kQuantMaxBlocks = 1024;
constexpr int kQuantOneBlockThreads = 1024;
// One block reads 64 Ki elements (128 KB of bf16) twice in ~2 us, under the ~5 us of the three
// kernels and a memset that the grid path costs at that size.
constexpr int64_t kQuantOneBlockMaxElements = int64_t(1) << 16;
template <class T>
__device__ __forceinline__ void quantize_strided(const T* x, int64_t n, float scale, __nv_fp8_storage_t* out,
                                                 int64_t first, int64_t stride) {
  constexpr int V = kQuantVec<T>;
  struct alignas(V) Bytes {
    __nv_fp8_storage_t b[V];
  };
  const int64_t vecs = n / V;
  for (int64_t i = first; i < vecs; i += stride) {
    const uint4 v = reinterpret_cast<const uint4*>(x)[i];
    const T* e = reinterpret_cast<const T*>(&v);
    Bytes q;
#pragma unroll
    for (int j = 0; j < V; ++j) q.b[j] = quantize_e4m3(load_float(e + j), scale);
    reinterpret_cast<Bytes*>(out)[i] = q;
  }
  for (int64_t i = vecs * V + first; i < n; i += stride) out[i] = quantize_e4m3(load_float(x + i), scale);
}

template <class T>
__global__ void __launch_bounds__(kQuantThreads) fp8_amax_kernel(const T* x, int64_t n, unsigned* amax_bits) {
  pdl_wait();
  pdl_launch_dependents();
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const unsigned m = __reduce_max_sync(0xffffffffu, amax_bits_strided(x, n, first, int64_t(gridDim.x) * blockDim.x));
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax_bits, m);
}

// kDynamic: `scale` holds the amax of x (fp8_amax_kernel) and scale_out is written afterwards
// (fp8_scale_from_amax_kernel); else scale_out gets a copy of `scale`.
template <class T, bool kDynamic>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_quantize_kernel(const T* x, int64_t n, const float* scale_in, __nv_fp8_storage_t* out, float* scale_out) {
  pdl_wait();
  pdl_launch_dependents();
  const float scale = kDynamic ? amax_to_scale(*scale_in) : *scale_in;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (!kDynamic && first == 0) *scale_out = scale;
  quantize_strided(x, n, scale, out, first, int64_t(gridDim.x) * blockDim.x);
}

__global__ void fp8_scale_from_amax_kernel(float* scale) {
  pdl_wait();
  pdl_launch_dependents();
  *scale = amax_to_scale(*scale);
}

// The dynamic scale of a small x in one block: the block's amax, then the quantization.
template <class T>
__global__ void __launch_bounds__(kQuantOneBlockThreads)
    fp8_quantize_one_block_kernel(const T* x, int64_t n, __nv_fp8_storage_t* out, float* scale_out) {
  __shared__ unsigned warp_max[kQuantOneBlockThreads / 32];
  pdl_wait();
  pdl_launch_dependents();
  const float scale = amax_to_scale(__uint_as_float(block_amax_bits(x, n, warp_max)));
  if (threadIdx.x == 0) *scale_out = scale;
  quantize_strided(x, n, scale, out, threadIdx.x, blockDim.x);
}

// Eight bfloat16 values (16 bytes) quantized to e4m3 by `scale`.
struct alignas(8) Bytes8 {
  __nv_fp8_storage_t b[8];
};
__device__ __forceinline__ Bytes8 quantize8(const uint4& v, float scale) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
  Bytes8 q;
#pragma unroll
  for (int j = 0; j < 8; ++j) q.b[j] = quantize_e4m3(load_float(e + j), scale);
  return q;
}

// The gather of GEMM1's rows quantized to e4m3 on the way (bfloat16 x with fp8 weights): one
// warp per row as moe_gather_kernel, 8 elements per 16-byte load. The scale: static (*static_scale),
// or dynamic from the amax of all of x: each block's own (kOwnAmax: small x, read from L2 by every
// block, no kernel before) or the amax a fp8_amax_kernel left in amax_bits. Block 0 writes it to
// *scale_out, which the grouped GEMM then scales by.
enum class GatherScale { kStatic, kOwnAmax, kAmaxBits };

template <GatherScale kScale>
__global__ void __launch_bounds__(32 * kGatherRowsPerBlock)
    moe_gather_quantize_kernel(const __nv_bfloat16* x, int64_t x_elements, int64_t hidden,
                               const int32_t* permuted_to_expanded, int top_k, const int32_t* num_kept, int64_t rows,
                               const float* static_scale, const unsigned* amax_bits, float* scale_out,
                               __nv_fp8_storage_t* gathered) {
  __shared__ unsigned warp_max[kGatherRowsPerBlock];
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float scale;
  if constexpr (kScale == GatherScale::kStatic) {
    scale = *static_scale;
  } else if constexpr (kScale == GatherScale::kOwnAmax) {
    scale = amax_to_scale(__uint_as_float(block_amax_bits(x, x_elements, warp_max)));
  } else {
    scale = amax_to_scale(__uint_as_float(*amax_bits));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  const int64_t row = int64_t(blockIdx.x) * kGatherRowsPerBlock + warp;
  if (row >= rows || row >= *num_kept) return;
  const uint4* __restrict__ src =
      reinterpret_cast<const uint4*>(x + gathered_token(permuted_to_expanded, row, rows, top_k) * hidden);
  Bytes8* __restrict__ dst = reinterpret_cast<Bytes8*>(gathered + row * hidden);
  for (int64_t i = lane; i < hidden / 8; i += 32) dst[i] = quantize8(src[i], scale);
}

// moe_gather_tokens_kernel's rows quantized to e4m3 (16 bytes of bfloat16 x to 8), by the static
// scale or the one from the amax a fp8_amax_kernel left in amax_bits; block 0 writes it to *scale_out.
struct QuantizedRows {
  Bytes8* gathered;
  const float* static_scale;
  const unsigned* amax_bits;
  float* scale_out;
  float scale;
  __device__ __forceinline__ void prepare() {
    scale = static_scale != nullptr ? *static_scale : amax_to_scale(__uint_as_float(*amax_bits));
    if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  }
  __device__ __forceinline__ void put(int64_t index, const uint4& v) const { gathered[index] = quantize8(v, scale); }
};

template <class T>
void launch_fp8_quantize(const T* x, int64_t n, const float* scale, __nv_fp8_storage_t* out, float* scale_out,
                         cudaStream_t stream, bool pdl) {
  const int64_t per_block = int64_t(kQuantThreads) * kQuantVec<T>;
  const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kQuantMaxBlocks)));
  if (scale != nullptr) {
    launch_kernel(fp8_quantize_kernel<T, false>, grid, dim3(kQuantThreads), 0, stream, pdl, x, n, scale, out,
                  scale_out);
    return;
  }
  if (n <= kQuantOneBlockMaxElements) {
    launch_kernel(fp8_quantize_one_block_kernel<T>, dim3(1), dim3(kQuantOneBlockThreads), 0, stream, pdl, x, n, out,
                  scale_out);
    return;
  }
  // The memset is no kernel: the amax kernel after it launches without PDL.
  C10_CUDA_CHECK(cudaMemsetAsync(scale_out, 0, sizeof(float), stream));
  launch_kernel(fp8_amax_kernel<T>, grid, dim3(kQuantThreads), 0, stream, false, x, n,
                reinterpret_cast<unsigned*>(scale_out));
  launch_kernel(fp8_quantize_kernel<T, true>, grid, dim3(kQuantThreads), 0, stream, pdl, x, n,
                static_cast<const float*>(scale_out), out, scale_out);
  launch_kernel(fp8_scale_from_amax_kernel, dim3(1), dim3(1), 0, stream, pdl, scale_out);
}

}  // namespace

int64_t moe_sort_blocks(int64_t routes, int64_t num_local_experts) {
  const int64_t chunk = int64_t(sort_warps(num_local_experts)) * kSortStep;
  return routes <= chunk ? 1 : (routes + chunk - 1) / chunk;
}

namespace {

// The sort kernels' shared memory may exceed the default 48 KB.
void configure_sort_kernels() {
  for (const void* kernel :
       {(const void*)moe_sort_one_block_kernel, (const void*)moe_sort_count_kernel, (const void*)moe_sort_scan_kernel,
        (const void*)moe_sort_place_kernel, (const void*)moe_sort_grid_kernel}) {
    allow_dynamic_smem(kernel, kSortSmemOptIn);
  }
}

void check_sort_experts(const MoeSortArgs& a) {
  TORCH_CHECK(a.num_local_experts >= 1 && a.num_local_experts <= kMoeSortMaxLocalExperts,
              "cake::moe_sort: at most ", kMoeSortMaxLocalExperts, " local experts on CUDA, got ",
              a.num_local_experts);
}

void check_routing_limits(int num_experts, int top_k) {
  TORCH_CHECK(num_experts <= kMoeRoutingMaxExperts && top_k <= kMoeRoutingMaxTopK, "cake::moe_routing: CUDA kernels "
              "take at most ", kMoeRoutingMaxExperts, " experts and top_k <= ", kMoeRoutingMaxTopK, ", got ",
              num_experts, " and ", top_k);
}

}  // namespace

void moe_sort(const MoeSortArgs& a, int32_t* block_rows, cudaStream_t stream, bool pdl) {
  check_sort_experts(a);
  configure_sort_kernels();
  const int64_t blocks = moe_sort_blocks(a.routes, a.num_local_experts);
  if (blocks == 1) {
    const OneBlockShape shape = one_block_shape(a.routes, 0, a.num_local_experts);
    launch_kernel(moe_sort_one_block_kernel, dim3(1), dim3(shape.threads),
                  sort_smem_bytes(shape.sort_warps, a.num_local_experts), stream, pdl, a, shape.sort_warps);
    return;
  }
  TORCH_CHECK(block_rows != nullptr, "cake::moe_sort: missing block workspace (internal error)");
  // (Any chunk of whole steps fits the workspace: moe_routing_workspace_bytes counts a block per step.)
  const int grid_warps = sort_warps(a.num_local_experts, 1);
  const int64_t grid_chunk = int64_t(grid_warps) * kSortStep;
  const int64_t grid_blocks = (a.routes + grid_chunk - 1) / grid_chunk;
  const size_t grid_smem = sort_smem_bytes(grid_warps, a.num_local_experts, 1);
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The grid barrier needs every block resident at once.
  const int per_sm = resident_ctas_per_sm(reinterpret_cast<const void*>(moe_sort_grid_kernel), kSortThreads, grid_smem);
  if (grid_blocks <= int64_t(per_sm) * sms) {
    launch_cooperative_kernel(moe_sort_grid_kernel, dim3(static_cast<unsigned>(grid_blocks)), dim3(kSortThreads),
                              grid_smem, stream, pdl, a, grid_warps, grid_chunk, block_rows);
    return;
  }
  const int warps = sort_warps(a.num_local_experts);
  const int64_t chunk = int64_t(warps) * kSortStep;
  const size_t smem = sort_smem_bytes(warps, a.num_local_experts);
  const size_t scan_smem = sizeof(int32_t) * (a.num_local_experts + 1);
  launch_kernel(moe_sort_count_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kSortThreads), smem, stream, pdl,
                a, warps, chunk, block_rows);
  launch_kernel(moe_sort_scan_kernel, dim3(1), dim3(kSortThreads), scan_smem, stream, pdl, a,
                static_cast<int>(blocks), block_rows);
  launch_kernel(moe_sort_place_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kSortThreads), smem, stream, pdl,
                a, warps, chunk, static_cast<const int32_t*>(block_rows));
}

void moe_gather_rows(const void* x, int64_t row_bytes, const int32_t* permuted_to_expanded, int top_k,
                     const int32_t* num_kept, int64_t rows, void* gathered, const GatherInverse& inverse,
                     cudaStream_t stream, bool pdl) {
  if (rows == 0 || row_bytes == 0) return;
  TORCH_CHECK(row_bytes % 16 == 0, "cake MoE gather: rows must be 16-byte multiples (internal error)");
  if (inverse.available() && rows / top_k * row_bytes >= kTokenOrderMinXBytes) {
    launch_gather_tokens(x, row_bytes / 16, permuted_to_expanded, top_k, num_kept, rows, inverse,
                         CopiedRows{static_cast<uint4*>(gathered)}, stream, pdl);
    return;
  }
  const int64_t blocks = (rows + kGatherRowsPerBlock - 1) / kGatherRowsPerBlock;
  launch_kernel(moe_gather_kernel, dim3(static_cast<unsigned>(blocks)), dim3(32 * kGatherRowsPerBlock), 0,
                stream, pdl, static_cast<const uint4*>(x), row_bytes / 16, permuted_to_expanded, top_k,
                num_kept, rows, static_cast<uint4*>(gathered));
}

void moe_gather_quantize_rows(const void* x, int64_t tokens, int64_t hidden, const int32_t* permuted_to_expanded,
                              int top_k, const int32_t* num_kept, int64_t rows, const float* static_scale,
                              float* slots, void* gathered, const GatherInverse& inverse, cudaStream_t stream,
                              bool pdl) {
  if (rows == 0 || hidden == 0) return;
  TORCH_CHECK(hidden % 16 == 0, "cake MoE gather: hidden must be a multiple of 16 (internal error)");
  const auto xb = static_cast<const __nv_bfloat16*>(x);
  const int64_t n = tokens * hidden;
  const dim3 grid(static_cast<unsigned>((rows + kGatherRowsPerBlock - 1) / kGatherRowsPerBlock));
  const dim3 block(32 * kGatherRowsPerBlock);
  auto q = static_cast<__nv_fp8_storage_t*>(gathered);
  auto amax_bits = reinterpret_cast<unsigned*>(slots + 1);
  const bool own_amax = static_scale == nullptr && n <= kQuantOneBlockMaxElements;
  if (static_scale == nullptr && !own_amax) {
    // The memset is no kernel: the amax kernel after it launches without PDL.
    C10_CUDA_CHECK(cudaMemsetAsync(amax_bits, 0, sizeof(unsigned), stream));
    const int64_t per_block = int64_t(kQuantThreads) * kQuantVec<__nv_bfloat16>;
    const int64_t amax_blocks = std::clamp<int64_t>((n + per_block - 1) / per_block, 1, kQuantMaxBlocks);
    launch_kernel(fp8_amax_kernel<__nv_bfloat16>, dim3(static_cast<unsigned>(amax_blocks)), dim3(kQuantThreads), 0,
                  stream, false, xb, n, amax_bits);
  }
  // Token order takes the static scale or the amax kernel's: its x is past kOwnAmax's size.
  static_assert(kTokenOrderMinXBytes / int64_t(sizeof(__nv_bfloat16)) > kQuantOneBlockMaxElements);
  if (inverse.available() && n * int64_t(sizeof(__nv_bfloat16)) >= kTokenOrderMinXBytes) {
    launch_gather_tokens(x, hidden / 8, permuted_to_expanded, top_k, num_kept, rows, inverse,
                         QuantizedRows{static_cast<Bytes8*>(gathered), static_scale, amax_bits, slots, 0.0f}, stream,
                         pdl);
    return;
  }
  auto kernel = static_scale != nullptr ? moe_gather_quantize_kernel<GatherScale::kStatic>
                : own_amax              ? moe_gather_quantize_kernel<GatherScale::kOwnAmax>
                                        : moe_gather_quantize_kernel<GatherScale::kAmaxBits>;
  launch_kernel(kernel, grid, block, 0, stream, pdl, xb, n, hidden, permuted_to_expanded, top_k, num_kept, rows,
                static_scale, amax_bits, slots, q);
}

void moe_swiglu(const void* h, int64_t rows, int64_t inter, const int32_t* offsets, int num_experts,
                const float* limits, bool gate_up, void* out, bool is_bf16, cudaStream_t stream, bool pdl,
                float clamp_limit) {
  if (rows == 0 || inter == 0) return;
  TORCH_CHECK(inter % (gate_up ? 8 : 32) == 0, "cake MoE SwiGLU: I must be a multiple of 32 (8 for [gate | up] "
              "halves; internal error)");
  const int64_t inter_vecs = inter / 8;
  const dim3 grid(static_cast<unsigned>((inter_vecs + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>((rows + kSwigluRows - 1) / kSwigluRows, 65535)));
  auto kernel = is_bf16 ? moe_swiglu_kernel<__nv_bfloat16> : moe_swiglu_kernel<__half>;
  launch_kernel(kernel, grid, dim3(32, kSwigluRows), 0, stream, pdl, static_cast<const uint4*>(h), rows,
                inter_vecs, offsets, num_experts, limits, gate_up, clamp_limit, static_cast<uint4*>(out));
}

void swiglu_backward(const void* grad, const void* gate_up, int64_t rows, int64_t inter, void* d_gate_up,
                     bool is_bf16, cudaStream_t stream, float clamp_limit) {
  if (rows == 0 || inter == 0) return;
  TORCH_CHECK(inter % 8 == 0, "cake SwiGLU backward: I must be a multiple of 8 (internal error)");
  const int64_t inter_vecs = inter / 8;
  const dim3 grid(static_cast<unsigned>((inter_vecs + 31) / 32),
                  static_cast<unsigned>(std::min<int64_t>((rows + kSwigluRows - 1) / kSwigluRows, 65535)));
  auto kernel = is_bf16 ? swiglu_backward_kernel<__nv_bfloat16> : swiglu_backward_kernel<__half>;
  launch_kernel(kernel, grid, dim3(32, kSwigluRows), 0, stream, false, static_cast<const uint4*>(grad),
                static_cast<const uint4*>(gate_up), rows, inter_vecs, clamp_limit, static_cast<uint4*>(d_gate_up));
}

void moe_topk_softmax(const void* logits, FloatType type, int64_t tokens, int num_experts, int top_k, int32_t* ids,
                      float* weights, cudaStream_t stream, bool pdl) {
  check_routing_limits(num_experts, top_k);
  if (tokens == 0) return;
  const dim3 grid(static_cast<unsigned>((tokens + kRoutingWarps - 1) / kRoutingWarps));
  const dim3 block(32 * kRoutingWarps);
  with_float_type(logits, type, [&](auto typed_logits) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed_logits)>>;
    with_experts_per_lane<kMoeRoutingMaxExperts / 32>(num_experts, [&](auto per_lane) {
      launch_kernel(moe_topk_softmax_kernel<decltype(per_lane)::value, T>, grid, block, 0, stream, pdl, typed_logits,
                    tokens, num_experts, top_k, ids, weights);
    });
  });
}

bool moe_route_and_sort_fits(int64_t tokens, const MoeSortArgs& a) {
  return tokens >= 1 && tokens <= kMoeRouteAndSortMaxTokens && a.num_experts <= kMoeRouteAndSortMaxExperts &&
         moe_sort_blocks(a.routes, a.num_local_experts) == 1;
}

void moe_route_and_sort(const void* logits, FloatType type, int64_t tokens, int top_k, int32_t* ids, float* weights,
                        const MoeSortArgs& a, cudaStream_t stream, bool pdl) {
  check_routing_limits(a.num_experts, top_k);
  check_sort_experts(a);
  TORCH_CHECK(moe_route_and_sort_fits(tokens, a), "cake::moe_routing: ", tokens, " tokens over ", a.num_experts,
              " experts do not fit the one-block routing (internal error)");
  configure_sort_kernels();
  const OneBlockShape shape = one_block_shape(a.routes, tokens, a.num_local_experts);
  const int warps = shape.sort_warps;
  const dim3 block(shape.threads);
  const size_t smem = sort_smem_bytes(warps, a.num_local_experts);
  with_float_type(logits, type, [&](auto typed_logits) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(typed_logits)>>;
    with_experts_per_lane<kMoeRouteAndSortMaxExperts / 32>(a.num_experts, [&](auto per_lane) {
      const auto kernel = moe_route_and_sort_one_block_kernel<decltype(per_lane)::value, T>;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSortSmemOptIn);
      launch_kernel(kernel, dim3(1), block, smem, stream, pdl, typed_logits, tokens, top_k, ids, weights, a, warps);
    });
  });
}

void moe_finalize(const void* permuted_rows, int64_t hidden, const int32_t* expanded_to_permuted,
                  const float* scales, int64_t tokens, int top_k, int64_t num_rows, void* out, bool is_bf16,
                  cudaStream_t stream, bool pdl) {
  if (tokens == 0 || hidden == 0) return;
  TORCH_CHECK(hidden % 8 == 0, "cake MoE finalize: hidden must be a multiple of 8 (internal error)");
  TORCH_CHECK(top_k <= kFinalizeMaxTopK, "cake::moe_finalize: CUDA kernels take top_k <= ", kFinalizeMaxTopK,
              ", got ", top_k);
  // Few tokens: each token's row over several CTAs, so that more of the k rows' loads are in
  // flight at once (T=1, H=4096: one CTA made four round trips of 8 loads per thread, ~8 us).
  const int64_t slices = std::clamp<int64_t>(kFinalizeFillCtas / tokens, 1,
                                             (hidden / 8 + kFinalizeThreads - 1) / kFinalizeThreads);
  auto kernel = is_bf16 ? moe_finalize_kernel<__nv_bfloat16> : moe_finalize_kernel<__half>;
  launch_kernel(kernel, dim3(static_cast<unsigned>(tokens), static_cast<unsigned>(slices)), dim3(kFinalizeThreads),
                0, stream, pdl,
                static_cast<const uint4*>(permuted_rows), hidden / 8, expanded_to_permuted, scales, top_k, num_rows,
                static_cast<uint4*>(out));
}

void moe_finalize_backward(const void* grad, const void* permuted_rows, const int32_t* expanded_to_permuted,
                           const float* scales, int64_t tokens, int top_k, int64_t num_rows, int64_t hidden,
                           int32_t* route_of_row, void* rows_grad, float* scales_grad, bool is_bf16,
                           cudaStream_t stream) {
  const int64_t routes = tokens * top_k;
  if (routes > 0) {
    const int64_t blocks = std::min<int64_t>((routes + 255) / 256, 1024);
    launch_kernel(finalize_route_of_row_kernel, dim3(static_cast<unsigned>(blocks)), dim3(256), 0, stream, false,
                  expanded_to_permuted, routes, num_rows, route_of_row, scales_grad);
  }
  if (num_rows == 0) return;
  TORCH_CHECK(hidden % 8 == 0, "cake MoE finalize backward: hidden must be a multiple of 8 (internal error)");
  const int64_t blocks = (num_rows + kFinalizeBackwardWarps - 1) / kFinalizeBackwardWarps;
  auto kernel = is_bf16 ? finalize_backward_kernel<__nv_bfloat16> : finalize_backward_kernel<__half>;
  launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(32 * kFinalizeBackwardWarps), 0, stream, false,
                static_cast<const uint4*>(grad), static_cast<const uint4*>(permuted_rows), route_of_row, scales,
                top_k, num_rows, hidden / 8, static_cast<uint4*>(rows_grad), scales_grad);
}

void fp8_quantize(const void* x, FloatType type, int64_t n, const float* scale, void* out, float* scale_out,
                  cudaStream_t stream, bool pdl) {
  auto q = static_cast<__nv_fp8_storage_t*>(out);
  switch (type) {
    case FloatType::kFloat:
      launch_fp8_quantize(static_cast<const float*>(x), n, scale, q, scale_out, stream, pdl);
      break;
    case FloatType::kBFloat16:
      launch_fp8_quantize(static_cast<const __nv_bfloat16*>(x), n, scale, q, scale_out, stream, pdl);
      break;
    case FloatType::kHalf:
      launch_fp8_quantize(static_cast<const __half*>(x), n, scale, q, scale_out, stream, pdl);
      break;
  }
}

}  // namespace cake::sm90
