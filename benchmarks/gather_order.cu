// Diagnostic microbenchmark (not part of the library): GEMM1's row gather at large T, in the order
// moe_gather_kernel walks it (permuted rows: each x row is read top_k times, far apart in time, so
// at T=16384 most of those reads miss L2 under the gathered rows' writes) against token order (an
// inverse-permutation kernel, then one warp per token reads x[t] once and writes its top_k rows).
//   row      moe_gather_kernel's loop: warp per permuted row, 8 x 16 B per lane in flight
//   row_cs   the same with streaming stores (st.global.cs: the writes do not push x out of L2)
//   token    inverse kernel + warp per token (the inverse's time included)
//   token_cs the same with streaming stores
//   lockstep permuted rows in the order (position within the expert, expert): one kernel, any
//            permutation, and the top_k reads of a token close in time (rows sorted by expert)
//   lockstep_cs  the same with streaming stores
//   token_bulk   warp per token, by the bulk copy engine: x[t] into shared memory by one TMA bulk
//            load, then top_k bulk stores of the row (cp.async.bulk.global.shared::cta)
//   token_nox    token's stores with no reads (a constant): its store pattern alone
//   token_l2x    token after a kernel that pulls x into L2 by bulk prefetches (both timed): what a
//            prefetch of x issued while moe_sort runs could leave of the gather
//   write_only   the ceiling: the rows' bytes written in order (16-byte stores, grid-stride), no reads
//   memset   cudaMemsetAsync of the rows' bytes
// Routing: top_k distinct random experts of E per token, rows sorted by expert (stable), as
// moe_sort makes them. Median of 20 runs, each after a 256 MB read that empties L2.
//   nvcc -O3 -arch=sm_90a -o /tmp/gather_order benchmarks/gather_order.cu && /tmp/gather_order
#include <numeric>
#include <random>

#include "microbench.cuh"

constexpr int kRowsPerBlock = 8;  // one warp per row (or token)
constexpr int kUnroll = 8;

template <bool kStreaming>
__device__ __forceinline__ void store(uint4* p, const uint4& v) {
  if constexpr (kStreaming)
    __stcs(p, v);
  else
    *p = v;
}

// One warp copies a row of row_vecs 16-byte words: up to kUnroll loads in flight per lane.
template <bool kStreaming>
__device__ __forceinline__ void copy_row(const uint4* src, uint4* dst, int64_t row_vecs) {
  for (int64_t i0 = threadIdx.x % 32; i0 < row_vecs; i0 += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + 32 * u < row_vecs) v[u] = __ldg(src + i0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + 32 * u < row_vecs) store<kStreaming>(dst + i0 + 32 * u, v[u]);
  }
}

template <bool kStreaming>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    gather_rows(const uint4* x, int64_t row_vecs, const int32_t* permuted_to_expanded, int top_k, int64_t rows,
                uint4* out) {
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  copy_row<kStreaming>(x + int64_t(permuted_to_expanded[row] / top_k) * row_vecs, out + row * row_vecs, row_vecs);
}

// Row order by position within the expert: virtual index v = i * E + e is the i-th row of expert e,
// so the warps in flight hold the same relative stretch of every expert's rows, whose tokens (rows
// sorted stably by expert) lie in one window of x: its top_k reads are close in time.
template <bool kStreaming>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    gather_lockstep(const uint4* x, int64_t row_vecs, const int32_t* permuted_to_expanded, int top_k,
                    const int32_t* offsets, int experts, int64_t rows, uint4* out) {
  const int lane = threadIdx.x % 32;
  int longest = 0;
  for (int e = lane; e < experts; e += 32) longest = max(longest, offsets[e + 1] - offsets[e]);
  for (int d = 16; d > 0; d /= 2) longest = max(longest, __shfl_xor_sync(0xffffffffu, longest, d));
  const int64_t warps = int64_t(gridDim.x) * kRowsPerBlock;
  for (int64_t v = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; v < int64_t(experts) * longest; v += warps) {
    const int e = static_cast<int>(v % experts);
    const int64_t i = v / experts;
    const int64_t row = offsets[e] + i;
    if (row >= offsets[e + 1]) continue;
    copy_row<kStreaming>(x + int64_t(permuted_to_expanded[row] / top_k) * row_vecs, out + row * row_vecs, row_vecs);
  }
}

__global__ void invert(const int32_t* permuted_to_expanded, int64_t rows, int32_t* expanded_to_permuted) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < rows) expanded_to_permuted[permuted_to_expanded[p]] = static_cast<int32_t>(p);
}

template <bool kStreaming, bool kReadX = true>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    scatter_tokens(const uint4* x, int64_t row_vecs, const int32_t* expanded_to_permuted, int top_k, int64_t tokens,
                   uint4* out) {
  const int64_t t = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (t >= tokens) return;
  const uint4* src = x + t * row_vecs;
  int32_t dst_row[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) dst_row[j] = j < top_k ? expanded_to_permuted[t * top_k + j] : -1;
  for (int64_t i0 = threadIdx.x % 32; i0 < row_vecs; i0 += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i0 + 32 * u < row_vecs) v[u] = kReadX ? __ldg(src + i0 + 32 * u) : make_uint4(u, 1, 2, 3);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (dst_row[j] < 0) continue;
      uint4* dst = out + int64_t(dst_row[j]) * row_vecs;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i0 + 32 * u < row_vecs) store<kStreaming>(dst + i0 + 32 * u, v[u]);
    }
  }
}

// Warp per token through the bulk copy engine (lane 0 issues): one bulk load of x[t] into the warp's
// shared-memory row, then a bulk store of it to each of the token's rows. Every route kept, as the cases
// route; rows up to 8 KB (the shared memory main() allows it).
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    scatter_tokens_bulk(const uint4* x, int64_t row_vecs, const int32_t* expanded_to_permuted, int top_k,
                        int64_t tokens, uint4* out) {
  extern __shared__ __align__(128) uint4 rows_smem[];
  __shared__ __align__(8) uint64_t bars[kRowsPerBlock];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t = int64_t(blockIdx.x) * kRowsPerBlock + warp;
  if (t >= tokens || lane != 0) return;
  const uint32_t bytes = static_cast<uint32_t>(row_vecs * 16);
  uint4* row = rows_smem + warp * row_vecs;
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(bars + warp));
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(x + t * row_vecs), "r"(bytes), "r"(bar) : "memory");
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar) : "memory");
  }
  for (int j = 0; j < top_k; ++j) {
    const int32_t r = expanded_to_permuted[t * top_k + j];
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(out + int64_t(r) * row_vecs), "r"(dst), "r"(bytes) : "memory");
  }
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// x into L2: 32 KB bulk prefetches, one per thread.
__global__ void prefetch_l2(const uint8_t* x, int64_t bytes) {
  constexpr int64_t kPiece = 32 << 10;
  for (int64_t at = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPiece; at < bytes;
       at += int64_t(gridDim.x) * blockDim.x * kPiece) {
    const uint32_t size = static_cast<uint32_t>(min(kPiece, bytes - at));
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x + at), "r"(size) : "memory");
  }
}

__global__ void write_words(uint4* out, int64_t n) {
  const uint4 v = make_uint4(1, 2, 3, 4);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) out[i] = v;
}

int main() {
  struct Case {
    const char* name;
    int tokens, hidden, experts, top_k;
    bool hot = false;  // half the tokens route to expert 0 (a hot expert)
  };
  const Case cases[] = {{"qwen3_30b T=4096", 4096, 2048, 128, 8},   {"qwen3_30b T=16384", 16384, 2048, 128, 8},
                        {"qwen3_235b T=4096", 4096, 4096, 128, 8},  {"qwen3_235b T=16384", 16384, 4096, 128, 8},
                        {"mixtral T=16384", 16384, 4096, 8, 2},     {"qwen3_30b T=16384 hot", 16384, 2048, 128, 8, true}};
  MedianTimer timer;
  CHECK(cudaFuncSetAttribute(scatter_tokens_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, kRowsPerBlock * 8192));
  std::printf("%-20s %9s %15s %15s %15s %15s %15s %15s %15s %15s %15s %15s %15s   (us; TB/s of x once + the rows written)\n",
              "case", "MB", "row", "row_cs", "token", "token_cs", "lockstep", "lockstep_cs", "token_bulk", "write_only",
              "memset", "token_nox", "token_l2x");
  std::mt19937 rng(0);
  for (const Case& c : cases) {
    const int64_t routes = int64_t(c.tokens) * c.top_k, row_bytes = int64_t(c.hidden) * 2, row_vecs = row_bytes / 16;
    // Routing and the stable sort by expert.
    std::vector<int32_t> expert(routes);
    std::vector<int> ids(c.experts);
    std::iota(ids.begin(), ids.end(), 0);
    for (int t = 0; t < c.tokens; ++t) {
      std::shuffle(ids.begin(), ids.end(), rng);
      if (c.hot && t % 2 == 0 && std::find(ids.begin(), ids.begin() + c.top_k, 0) == ids.begin() + c.top_k) ids[0] = 0;
      for (int j = 0; j < c.top_k; ++j) expert[t * c.top_k + j] = ids[j];
    }
    std::vector<int32_t> perm(routes);
    std::iota(perm.begin(), perm.end(), 0);
    std::stable_sort(perm.begin(), perm.end(), [&](int32_t l, int32_t r) { return expert[l] < expert[r]; });
    uint8_t *x, *out, *ref;
    int32_t *p2e, *e2p, *offs;
    CHECK(cudaMalloc(&x, c.tokens * row_bytes));
    CHECK(cudaMalloc(&out, routes * row_bytes));
    CHECK(cudaMalloc(&ref, routes * row_bytes));
    CHECK(cudaMalloc(&p2e, routes * 4));
    CHECK(cudaMalloc(&e2p, routes * 4));
    std::vector<int32_t> offsets(c.experts + 1, 0);
    for (int64_t r = 0; r < routes; ++r) offsets[expert[r] + 1]++;
    for (int e = 0; e < c.experts; ++e) offsets[e + 1] += offsets[e];
    CHECK(cudaMalloc(&offs, (c.experts + 1) * 4));
    CHECK(cudaMemcpy(offs, offsets.data(), (c.experts + 1) * 4, cudaMemcpyHostToDevice));
    std::vector<uint8_t> host_x(c.tokens * row_bytes);
    for (auto& v : host_x) v = static_cast<uint8_t>(rng());
    CHECK(cudaMemcpy(x, host_x.data(), host_x.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(p2e, perm.data(), routes * 4, cudaMemcpyHostToDevice));
    const unsigned row_blocks = static_cast<unsigned>((routes + kRowsPerBlock - 1) / kRowsPerBlock);
    const unsigned token_blocks = static_cast<unsigned>((c.tokens + kRowsPerBlock - 1) / kRowsPerBlock);
    auto run = [&](int variant) {
      const uint4* xs = reinterpret_cast<const uint4*>(x);
      uint4* o = reinterpret_cast<uint4*>(out);
      if (variant == 0) gather_rows<false><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, routes, o);
      if (variant == 1) gather_rows<true><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, routes, o);
      // The token-order variants (2, 3, 6, 9, 10) gather through the inverse permutation, its kernel timed with them.
      if (variant == 2 || variant == 3 || variant == 6 || variant == 9 || variant == 10)
        invert<<<static_cast<unsigned>((routes + 255) / 256), 256>>>(p2e, routes, e2p);
      if (variant == 2) scatter_tokens<false><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 3) scatter_tokens<true><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 4)
        gather_lockstep<false><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, offs, c.experts, routes, o);
      if (variant == 5)
        gather_lockstep<true><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, offs, c.experts, routes, o);
      if (variant == 6)
        scatter_tokens_bulk<<<token_blocks, 256, kRowsPerBlock * row_bytes>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 7) write_words<<<132 * 8, 512>>>(o, routes * row_vecs);
      if (variant == 8) CHECK(cudaMemsetAsync(out, 0, routes * row_bytes));
      if (variant == 9) scatter_tokens<false, false><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 10) {
        prefetch_l2<<<132, 128>>>(x, c.tokens * row_bytes);
        scatter_tokens<false><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      }
    };
    const double bytes = double(c.tokens) * row_bytes + double(routes) * row_bytes;
    std::printf("%-20s %9.1f", c.name, bytes / 1e6);
    run(0);
    CHECK(cudaMemcpy(ref, out, routes * row_bytes, cudaMemcpyDeviceToDevice));
    for (int variant = 0; variant < 11; ++variant) {
      CHECK(cudaMemset(out, 0, routes * row_bytes));
      run(variant);
      std::vector<uint8_t> got(routes * row_bytes), want(routes * row_bytes);
      CHECK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(want.data(), ref, want.size(), cudaMemcpyDeviceToHost));
      const bool same = variant == 7 || variant == 8 || variant == 9 || got == want;  // these copy nothing
      const float med = timer([&](int) { run(variant); });
      std::printf(" %7.1f (%4.2f)%s", med * 1e3, bytes / (med * 1e-3) / 1e12, same ? " " : "!");
    }
    std::printf("\n");
    CHECK(cudaFree(x));
    CHECK(cudaFree(out));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(p2e));
    CHECK(cudaFree(e2p));
    CHECK(cudaFree(offs));
  }
  std::printf("(! after a time: that variant's rows differ from moe_gather_kernel's order)\n");
  CHECK(cudaGetLastError());
  return 0;
}
