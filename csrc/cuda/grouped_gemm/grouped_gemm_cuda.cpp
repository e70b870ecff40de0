// CUDA backend of the grouped GEMM ops: the Hopper kernels' own checks, the workspace, and the
// architecture and tactic dispatch. Argument checks and outputs are in grouped_gemm_ops.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/common/alignment.h"
#include "cuda/common/arch.h"
#include "cuda/grouped_gemm/grouped_gemm_cuda.h"
#include "cuda/grouped_gemm/grouped_gemm_tactics.h"
#include "grouped_gemm_ops.h"

namespace cake {
namespace {

using Op = GroupedGemmOp;

// What the Hopper kernels need beyond the shared checks.
void check_cuda_operands(Op kind, const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                         const at::Tensor& out, const char* op) {
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 ||
                  (kind == Op::kFwd && (a.scalar_type() == at::kHalf || a.scalar_type() == at::kFloat8_e4m3fn)),
              op, ": CUDA kernels take bfloat16 operands (fwd also float16), got ", a.scalar_type(),
              " (the CPU implementation also takes float16, float32 and float64)");  // e4m3: MoE GEMMs only
  TORCH_CHECK(a.scalar_type() != at::kFloat8_e4m3fn || out.scalar_type() == at::kBFloat16, op,
              ": float8_e4m3fn operands give a bfloat16 output, got ", out.scalar_type(), " (internal error)");
  TORCH_CHECK(s.n % 8 == 0 && s.k % 8 == 0, op,
              ": CUDA kernels need N and K to be multiples of 8 (16-byte rows for TMA), got N=", s.n,
              " and K=", s.k);
  TORCH_CHECK(aligned16(a) && aligned16(b) && aligned16(out), op,
              ": CUDA kernels need 16-byte aligned data pointers (a storage offset broke this)");
  TORCH_CHECK(s.num_groups <= 65535, op, ": at most 65535 groups, got ", s.num_groups);
  TORCH_CHECK(s.n <= INT32_MAX && s.k <= INT32_MAX, op, ": N and K must fit in int32");
  // TMA coordinates and CUTLASS's group shapes are int32 (the fixed-operand tiles address every row).
  TORCH_CHECK(s.sum_m <= INT32_MAX, op, ": at most 2^31 - 1 rows (sum_m), got ", s.sum_m);
}

void check_workspace(const at::Tensor& workspace, const GroupedGemmShape& s, const at::Tensor& like,
                     const char* op) {
  const int64_t need = grouped_gemm_workspace_bytes(s.num_groups);
  TORCH_CHECK(workspace.device() == like.device() && workspace.is_contiguous() &&
                  workspace.nbytes() >= static_cast<size_t>(need) && aligned16(workspace),
              op, ": workspace must be a contiguous tensor of at least ", need, " bytes on ",
              like.device(), " (cake_ops._C.grouped_gemm_workspace_size(E)), got ",
              workspace.nbytes(), " bytes on ", workspace.device());
}

// An epilogue twin of the chosen fwd tactic (grouped_gemm_tactics.h) and what it needs beyond the GEMM.
struct TwinLaunch {
  EpilogueTwin twin = EpilogueTwin::kNone;
  const float* swiglu_limits = nullptr;
  GroupedGemmParams::Scatter scatter;
  GroupedGemmParams::Gather gather;
};

// Programmatic launch pays where a GEMM is short enough for its launch latency to count, and it
// hurts a long GEMM that follows another one: on the H200 the CUDA-graph replay of the StepFun
// chain (Step-3.5 bf16, T=8192: 65536 rows) ran 6.1-6.7 ms against 4.1-4.4 whenever GEMM1 and
// GEMM2 both launched with PDL, and 4.2 with a plain kernel between them; at 16384 rows the
// edge cost nothing (benchmarks/NOTES.md, session 28). On an H100 the same slowdown shows at 8192
// and 16384 rows (StepFun issue geometry bf16 T=1024 / 2048: 1.03-1.05 / 1.33 ms against 0.965 / 1.265
// without PDL, fp8 T=2048 0.89 against 0.85; level from 4096 rows down; session 48), while on the
// H200 PDL at 8192 rows was within +-1% (session 29). Longer GEMMs launch plainly: a few
// microseconds on a millisecond. An expert-parallel shard's expected rows size the GEMM, unless
// its prologue zeroes the rows past the groups' end (zero_tail: most of the output, every row
// counts): the Kimi-K2 EP8 shard's GEMM1 at T=9216 (9216 of 73728 rows its own) on the fixed
// 64x256 tile ran 1.86-1.96 ms with PDL against 1.14-1.24 without (session 35).
constexpr int64_t kPdlMaxRows = 4096;

bool launches_with_pdl(const GroupedGemmShape& s, bool zero_tail) {
  return (s.expected_rows >= 0 && !zero_tail ? s.expected_rows : s.sum_m) <= kPdlMaxRows;
}

// With a twin (fwd only), the chosen tactic's twin runs instead of it; false, with nothing launched,
// when that tactic has none.
bool launch_with(Op kind, const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                 const at::Tensor& offs, at::Tensor& out, at::Tensor& workspace, const char* op, bool pdl,
                 bool zero_tail, int64_t forced_tactic = -1, GroupedGemmScales scales = {},
                 const TwinLaunch& twin = {}) {
  check_cuda_operands(kind, s, a, b, out, op);
  check_workspace(workspace, s, a, op);
  c10::cuda::CUDAGuard guard(a.device());
  const KernelArch arch = select_kernel_arch(a.get_device(), op);
  if (out.numel() == 0) return true;
  // A zero-length reduction (fwd K = 0, dgrad N = 0) multiplies nothing (and SwiGLU(0, 0) = 0).
  if ((kind == Op::kFwd && s.k == 0) || (kind == Op::kDgrad && s.n == 0)) {
    out.zero_();
    return true;
  }
  GroupedGemmParams p;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.out = out.data_ptr();
  p.offs = offs.data_ptr<int32_t>();
  p.indptr = s.indptr;
  p.num_groups = s.num_groups;
  p.sum_m = s.sum_m;
  p.n = s.n;
  p.k = s.k;
  p.workspace = workspace.data_ptr();
  p.workspace_bytes = static_cast<int64_t>(workspace.nbytes());
  p.device = a.get_device();
  p.sm_count = at::cuda::getDeviceProperties(p.device)->multiProcessorCount;
  p.pdl = pdl && launches_with_pdl(s, zero_tail);
  p.zero_tail = zero_tail;
  p.a_scale = scales.a;
  p.b_scale = scales.b;
  p.swiglu_limits = twin.swiglu_limits;
  p.scatter = twin.scatter;
  p.gather = twin.gather;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(p.device);
  switch (arch) {
    case KernelArch::kSm90: {
      const TacticFamily family = tactic_family(kind, a.scalar_type(), out.scalar_type());
      const auto& table = tactics_sm90(family);
      TORCH_CHECK(forced_tactic < static_cast<int64_t>(table.size()), op, ": tactic must be below ", table.size(),
                  ", got ", forced_tactic);
      const Tactic& tactic = table[forced_tactic >= 0 ? forced_tactic : choose_tactic_sm90(family, s, twin.twin)];
      const GroupedGemmLaunchFn fn = epilogue_twin_sm90(tactic, twin.twin, s);
      if (fn == nullptr) return false;
      p.raster_along_n = tactic.raster_along_n;
      p.swizzle = tactic.swizzle;
      fn(p, stream);
      return true;
    }
  }
  return false;
}

// The grouped GEMM ops launch with PDL: the prologue waits for whatever ran before on the
// device, and the GEMM for the prologue, so the chain overlaps launch latencies only.
void launch(Op kind, const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
            const at::Tensor& offs, at::Tensor& out, at::Tensor& workspace, const char* op) {
  launch_with(kind, s, a, b, offs, out, workspace, op, /*pdl=*/true, /*zero_tail=*/true);
}

struct CudaBackend {
  static at::Tensor workspace(const GroupedGemmShape& s, const at::Tensor& like) {
    return at::empty({grouped_gemm_workspace_bytes(s.num_groups)}, like.options().dtype(at::kByte));
  }
  static constexpr auto run = &launch;
};

}  // namespace

void run_grouped_gemm_cuda(Op kind, const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                           const at::Tensor& offs, at::Tensor& out, const char* op, bool pdl, bool zero_tail,
                           int64_t tactic, at::Tensor* workspace, GroupedGemmScales scales) {
  if (workspace != nullptr) {
    launch_with(kind, s, a, b, offs, out, *workspace, op, pdl, zero_tail, tactic, scales);
    return;
  }
  auto own = CudaBackend::workspace(s, a);
  launch_with(kind, s, a, b, offs, out, own, op, pdl, zero_tail, tactic, scales);
}

bool run_grouped_gemm_swiglu_cuda(const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                                  const at::Tensor& offs, at::Tensor& out, const float* limits, const char* op,
                                  bool pdl, int64_t tactic, at::Tensor& workspace, bool zero_tail,
                                  GroupedGemmScales scales, bool gate_up) {
  TORCH_CHECK(s.n % 64 == 0 && out.size(0) == s.sum_m && out.size(1) == s.n / 2, op,
              ": the SwiGLU GEMM needs N % 64 == 0 and a [sum_m, N / 2] output (internal error)");
  TwinLaunch twin;
  twin.twin = gate_up ? EpilogueTwin::kSwiGluGateUp : EpilogueTwin::kSwiGlu;
  twin.swiglu_limits = limits;
  return launch_with(Op::kFwd, s, a, b, offs, out, workspace, op, pdl, zero_tail, tactic, scales, twin);
}

bool run_grouped_gemm_gather_swiglu_cuda(const GroupedGemmShape& s, const at::Tensor& x, const at::Tensor& b,
                                         const at::Tensor& offs, const int32_t* rows_to_routes, int64_t routes,
                                         int top_k, at::Tensor& out, const float* limits, const char* op, bool pdl,
                                         int64_t tactic, at::Tensor& workspace, bool zero_tail, bool gate_up) {
  TORCH_CHECK(s.n % 64 == 0 && out.size(0) == s.sum_m && out.size(1) == s.n / 2 && x.dim() == 2 &&
                  x.size(1) == s.k && x.is_contiguous() && x.size(0) * top_k == routes,
              op, ": the gathering SwiGLU GEMM needs N % 64 == 0, x [routes / top_k, K] and a [sum_m, N / 2] output "
              "(internal error)");
  if (x.scalar_type() == at::kFloat8_e4m3fn) return false;  // e4m3 x is quantized on its way: no twin
  // Gathering in the mainloop makes the cooperative tile's GEMM ~8% slower (its producer warps issue A's
  // copies one 16-byte chunk at a time) and saves the gather kernel, whose share of GEMM1 goes as 1 / N:
  // H200, session 22, Qwen3-30B (N = 1536) T=16384 -3.7% end to end, Qwen3-235B (N = 3072) even
  // (benchmarks/NOTES.md). So only up to N = 2048.
  constexpr int64_t kGatherMaxN = 2048;
  if (s.n > kGatherMaxN) return false;
  TwinLaunch twin;
  twin.twin = gate_up ? EpilogueTwin::kGatherSwiGluGateUp : EpilogueTwin::kGatherSwiGlu;
  twin.swiglu_limits = limits;
  twin.gather.rows_to_routes = rows_to_routes;
  twin.gather.routes = routes;
  twin.gather.top_k = top_k;
  return launch_with(Op::kFwd, s, x, b, offs, out, workspace, op, pdl, zero_tail, tactic, {}, twin);
}

bool run_grouped_gemm_scatter_cuda(const GroupedGemmShape& s, const at::Tensor& a, const at::Tensor& b,
                                   const at::Tensor& offs, const at::Tensor& rows_to_routes,
                                   const at::Tensor& route_scales, at::Tensor& out, const char* op, bool pdl,
                                   int64_t tactic, at::Tensor& workspace) {
  TORCH_CHECK(out.dim() == 2 && out.size(1) == s.n && rows_to_routes.is_contiguous() && route_scales.is_contiguous() &&
                  route_scales.numel() == rows_to_routes.numel() && out.size(0) > 0 &&
                  route_scales.numel() % out.size(0) == 0,
              op, ": the fused finalize needs out [num_tokens, N] and contiguous routes (internal error)");
  TwinLaunch twin;
  twin.twin = EpilogueTwin::kScatter;
  twin.scatter.out = out.data_ptr();
  twin.scatter.num_tokens = out.size(0);
  twin.scatter.top_k = static_cast<int>(route_scales.numel() / out.size(0));
  twin.scatter.rows_to_routes = rows_to_routes.data_ptr<int32_t>();
  twin.scatter.route_scales = route_scales.data_ptr<float>();
  // `out` of the GEMM itself is unused: the twin writes scatter.out; the checks see the token output.
  return launch_with(Op::kFwd, s, a, b, offs, out, workspace, op, pdl, /*zero_tail=*/false, tactic, {}, twin);
}

TORCH_LIBRARY_IMPL(cake, CUDA, m) {
  GroupedGemmOps<CudaBackend>::register_kernels(m);
}

}  // namespace cake
