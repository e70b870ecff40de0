// Host launchers of the MoE CUDA kernels (moe_sm90.cu). No CUTLASS and no ATen here: raw device
// pointers, sizes and the stream. Every launcher takes `pdl` (launch_kernel in pdl.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace cake::sm90 {

// The largest E_local the one-block sort kernel takes (one counter per expert and warp in
// shared memory).
constexpr int64_t kMoeSortMaxLocalExperts = 16384;

struct MoeSortArgs {
  const int32_t* ids = nullptr;  // [routes] global expert ids, expanded order (t * top_k + j)
  int64_t routes = 0;
  int num_experts = 0;
  int num_local_experts = 0;
  int local_expert_offset = 0;
  int tile_size = 0;
  int32_t* counts = nullptr;                // [E_local]
  int32_t* offsets = nullptr;               // [E_local + 1]
  int32_t* permuted_to_expanded = nullptr;  // [routes], -1 past the last kept route
  int32_t* expanded_to_permuted = nullptr;  // [routes], -1 for dropped routes
  int32_t* tile_offsets = nullptr;          // [E_local + 1]
};
// Blocks the sort runs on: 1 (one launch) up to one chunk of routes, else count / scan / place
// kernels over that many chunks, which need a block_rows workspace of blocks * E_local int32.
int64_t moe_sort_blocks(int64_t routes, int64_t num_local_experts);
void moe_sort(const MoeSortArgs& a, int32_t* block_rows, cudaStream_t stream, bool pdl);

// What lets a large x be gathered in token order (read once): moe_sort's expanded_to_permuted
// ([rows] int32, the inverse of permuted_to_expanded; each row is checked against it), or else
// [rows + 1] int32 of scratch to build an inverse in; neither: the gather in row order.
struct GatherInverse {
  const int32_t* expanded_to_permuted = nullptr;
  int32_t* scratch = nullptr;
  bool available() const { return expanded_to_permuted != nullptr || scratch != nullptr; }
};

// gathered[p] = x[permuted_to_expanded[p] / top_k] for the kept rows p < *num_kept; the rest
// of `gathered` is left untouched (the grouped GEMM reads no row past the last group end). An
// index outside [0, rows) is a device-side error.
void moe_gather_rows(const void* x, int64_t row_bytes, const int32_t* permuted_to_expanded,
                     int top_k, const int32_t* num_kept, int64_t rows, void* gathered, const GatherInverse& inverse,
                     cudaStream_t stream, bool pdl);

// moe_gather_rows of bfloat16 x quantized to e4m3 on the way: gathered[p] = e4m3(x[token] / s)
// (hidden % 16 == 0). s = *static_scale, or with static_scale null the dynamic
// max(amax(|x|), 1e-12) / 448 over all of x ([tokens, hidden]); slots[0] = s (float32), slots[1]
// holds the amax on the way. Bit for bit fp8_quantize then moe_gather_rows.
void moe_gather_quantize_rows(const void* x, int64_t tokens, int64_t hidden, const int32_t* permuted_to_expanded,
                              int top_k, const int32_t* num_kept, int64_t rows, const float* static_scale,
                              float* slots, void* gathered, const GatherInverse& inverse, cudaStream_t stream,
                              bool pdl);

// out[p, j] = silu(gate) * up of h[p] ([rows, 2I], up/gate interleaved at 32 columns, or with
// gate_up [gate | up] halves), in fp32, rounded once to the element type; rows p >= offsets[E] get
// zeros. With `limits` (float32 [E]): SwiGLUStep, min(silu(gate), L) * clamp(up, -L, L), L the
// limit of row p's expert. Without limits, a finite clamp_limit L gives the clamped SwiGLU
// silu(min(gate, L)) * clamp(up, -L, L) (cake::swiglu's limit).
void moe_swiglu(const void* h, int64_t rows, int64_t inter, const int32_t* offsets, int num_experts,
                const float* limits, bool gate_up, void* out, bool is_bf16, cudaStream_t stream, bool pdl,
                float clamp_limit = INFINITY);
// (moe_swiglu with offsets == nullptr: every row is kept.)

// d_gate_up [rows, 2I] = [grad * up * silu'(gate) | grad * silu(gate)] of gate_up [rows, 2I] ([gate | up]
// halves) and grad [rows, I], in float32, rounded once to the element type; I % 8 == 0, 16-byte aligned.
// A finite clamp_limit: the clamped SwiGLU's, each half's gradient zero where its clamp bit.
void swiglu_backward(const void* grad, const void* gate_up, int64_t rows, int64_t inter, void* d_gate_up,
                     bool is_bf16, cudaStream_t stream, float clamp_limit = INFINITY);

// The float element types the routing and quantization kernels read.
enum class FloatType { kFloat, kBFloat16, kHalf };

// Renormalize routing: for each token, the top_k largest of logits[t, 0:E] (ties to the lower
// id, NaN as -inf) and the softmax over those k in float32.
constexpr int kMoeRoutingMaxExperts = 1024;
constexpr int kMoeRoutingMaxTopK = 32;
void moe_topk_softmax(const void* logits, FloatType type, int64_t tokens, int num_experts, int top_k, int32_t* ids,
                      float* weights, cudaStream_t stream, bool pdl);

// Decode: moe_topk_softmax then moe_sort (a.ids == ids) in one launch of one block, for a few
// tokens whose routes the one-block sort takes (moe_route_and_sort_fits). The same outputs.
constexpr int64_t kMoeRouteAndSortMaxTokens = 64;
constexpr int kMoeRouteAndSortMaxExperts = 512;
bool moe_route_and_sort_fits(int64_t tokens, const MoeSortArgs& a);
void moe_route_and_sort(const void* logits, FloatType type, int64_t tokens, int top_k, int32_t* ids, float* weights,
                        const MoeSortArgs& a, cudaStream_t stream, bool pdl);

// Per-tensor fp8: out[i] = e4m3(clamp(x[i] / s, -448, 448)) (x: n elements, 16-byte aligned; out
// 16-byte aligned), s = *scale, or with scale null the dynamic max(amax(|x|), 1e-12) / 448
// computed on the device; *scale_out = s.
void fp8_quantize(const void* x, FloatType type, int64_t n, const float* scale, void* out, float* scale_out,
                  cudaStream_t stream, bool pdl);

// Decode-sized MoE GEMMs (moe_decode_sm90.cu): out rows of expert e = a rows [offsets[e],
// offsets[e+1]) @ w[e].T, the weights streamed once into wgmma registers, for few rows per expert.
// GEMM1 (swiglu): a = x [tokens, K] read through permuted_to_expanded[p] / top_k (indices checked
// against `a_rows` = tokens * top_k routes), out [rows, n / 2] = SwiGLU(Step) of the product
// rounded to the output type (as moe_swiglu over the grouped GEMM's h), rows past the last expert
// zeroed. GEMM2: a = [rows, K], out [rows, n], rows past the last expert unwritten. Output
// bfloat16 (float16 for float16 inputs); fp8: the product scaled by a_scale * w_scale[e] first.
constexpr int64_t kMoeDecodeStepBytes = 256;
// K is summed in slices of this many bytes of each weight row, in slice order (moe_decode.cuh).
constexpr int64_t kMoeDecodeSliceBytes = 2048;
// A dynamic scale for bfloat16 a is each CTA's own amax over all of a: up to this many elements.
constexpr int64_t kMoeDecodeMaxAmaxElements = int64_t(1) << 15;
enum class MoeDecodeElement { kBFloat16, kHalf, kE4m3 };
struct MoeDecodeGemmArgs {
  const void* a = nullptr;
  int64_t a_rows = 0;
  const int32_t* permuted_to_expanded = nullptr;  // GEMM1 only
  int top_k = 1;
  const void* w = nullptr;  // [E, n, K]
  const int32_t* offsets = nullptr;
  int num_experts = 0;
  int64_t rows = 0;
  int64_t n = 0;
  int64_t k_bytes = 0;
  const float* a_scale = nullptr;  // fp8
  bool quantize_a = false;         // bfloat16 a quantized to e4m3 (a_scale, or dynamic over a_elements)
  int64_t a_elements = 0;
  const float* w_scale = nullptr;  // fp8, [E]
  const float* limits = nullptr;   // GEMM1's SwiGLUStep, [E]
  bool w_gate_up = false;          // GEMM1: w [E, n, K] holds [gate; up] halves (else up/gate interleaved at 32)
  void* out = nullptr;
};
// The shapes the decode kernel takes: n % 64 == 0 and K bytes % kMoeDecodeStepBytes == 0.
bool moe_decode_gemm_fits(int64_t n, int64_t k_bytes, int64_t num_experts);
void moe_decode_gemm(const MoeDecodeGemmArgs& a, MoeDecodeElement element, bool swiglu, cudaStream_t stream,
                     bool pdl);

// A whole MoE layer for a decode batch in one cooperative launch (moe_decode_layer_sm90.cu): every
// kept route of x's tokens through GEMM1 + SwiGLU(Step) into h, GEMM2 into y, then out [tokens,
// hidden] = the fixed-order float32 combine: the numbers of moe_gemm1_swiglu -> moe_gemm2 ->
// moe_finalize. h [routes, I] and y [routes, hidden] (16-bit) are caller-owned scratch, and so
// are the slice sums of a phase whose items are few enough to spread over idle CTAs (at most
// split_items items, split_items * max_slices * 64 floats, and a float per item).
constexpr int64_t kMoeDecodeLayerMaxRoutes = 64;
struct MoeDecodeLayerArgs {
  const void* x = nullptr;  // [tokens, hidden] 16-bit (bfloat16 for e4m3 weights: quantized on the way in)
  int64_t tokens = 0;
  int top_k = 1;
  const int32_t* ids = nullptr;  // [tokens * top_k] global expert ids
  const float* scales = nullptr;
  int64_t local_offset = 0;
  int64_t num_local = 0;
  const void* w1 = nullptr;  // [E_local, 2I, hidden]: up/gate interleaved at 32 rows, or [gate; up] halves
  bool w1_gate_up = false;   // ... the latter
  const void* w2 = nullptr;  // [E_local, hidden, I]
  int64_t hidden = 0;
  int64_t inter = 0;
  const float* x_scale = nullptr;    // fp8: static activation scales, or null (dynamic)
  const float* fc2_scale = nullptr;
  const float* w1_scale = nullptr;   // fp8: [E_local]
  const float* w2_scale = nullptr;
  const float* limits = nullptr;     // SwiGLUStep: [E_local]
  void* h = nullptr;
  void* y = nullptr;
  float* slice_sums = nullptr;
  float* alphas = nullptr;
  int split_items = 0;
  int64_t expected_routes = -1;  // the shard's expected kept routes (-1: all of T * top_k)
  void* out = nullptr;
};
// Whether the layer kernel takes this shape: routes <= kMoeDecodeLayerMaxRoutes, both GEMMs fit the
// decode kernel, and for e4m3 weights (w_bytes 1) the dynamic scales' amax sizes.
bool moe_decode_layer_fits(int64_t routes, int64_t hidden, int64_t inter, int64_t w_bytes);
void moe_decode_layer(const MoeDecodeLayerArgs& a, MoeDecodeElement element, cudaStream_t stream, bool pdl);

// out[t] = sum_j scales[t, j] * rows[expanded_to_permuted[t * top_k + j]] over kept routes, in
// fp32 in route order (bitwise reproducible), rounded once. A route index outside
// [-1, num_rows) is a device-side error.
void moe_finalize(const void* permuted_rows, int64_t hidden, const int32_t* expanded_to_permuted,
                  const float* scales, int64_t tokens, int top_k, int64_t num_rows, void* out, bool is_bf16,
                  cudaStream_t stream, bool pdl);
// moe_finalize's gradients: rows_grad [num_rows, hidden] and, where permuted_rows and scales_grad are given,
// scales_grad [tokens * top_k] (see the op's schema). route_of_row: int32 [num_rows] scratch filled with -1. A
// route index outside [-1, num_rows), or a row two kept routes read, is a device-side error.
void moe_finalize_backward(const void* grad, const void* permuted_rows, const int32_t* expanded_to_permuted,
                           const float* scales, int64_t tokens, int top_k, int64_t num_rows, int64_t hidden,
                           int32_t* route_of_row, void* rows_grad, float* scales_grad, bool is_bf16,
                           cudaStream_t stream);

}  // namespace cake::sm90
