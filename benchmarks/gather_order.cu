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

template <bool kStreaming>
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
      if (i0 + 32 * u < row_vecs) v[u] = __ldg(src + i0 + 32 * u);
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
  std::printf("%-20s %9s %15s %15s %15s %15s %15s %15s   (us; TB/s of x once + the rows written)\n", "case", "MB",
              "row", "row_cs", "token", "token_cs", "lockstep", "lockstep_cs");
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
      if (variant == 2 || variant == 3) invert<<<static_cast<unsigned>((routes + 255) / 256), 256>>>(p2e, routes, e2p);
      if (variant == 2) scatter_tokens<false><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 3) scatter_tokens<true><<<token_blocks, 256>>>(xs, row_vecs, e2p, c.top_k, c.tokens, o);
      if (variant == 4)
        gather_lockstep<false><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, offs, c.experts, routes, o);
      if (variant == 5)
        gather_lockstep<true><<<row_blocks, 256>>>(xs, row_vecs, p2e, c.top_k, offs, c.experts, routes, o);
    };
    const double bytes = double(c.tokens) * row_bytes + double(routes) * row_bytes;
    std::printf("%-20s %9.1f", c.name, bytes / 1e6);
    run(0);
    CHECK(cudaMemcpy(ref, out, routes * row_bytes, cudaMemcpyDeviceToDevice));
    for (int variant = 0; variant < 6; ++variant) {
      CHECK(cudaMemset(out, 0, routes * row_bytes));
      run(variant);
      std::vector<uint8_t> got(routes * row_bytes), want(routes * row_bytes);
      CHECK(cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(want.data(), ref, want.size(), cudaMemcpyDeviceToHost));
      const bool same = got == want;
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
