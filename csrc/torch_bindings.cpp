// Every cake:: schema lives here. Backends register their kernels in their own files with
// TORCH_LIBRARY_IMPL(cake, CPU|CUDA, m); fakes and autograd live in python/cake_ops.
// The stable ABI (abi3) only: one module binary imports under any CPython >= 3.10.
#define Py_LIMITED_API 0x030A0000
#include <Python.h>
#include <torch/library.h>

#include "grouped_gemm_checks.h"
#include "moe_checks.h"
#ifdef CAKE_WITH_CUDA
#include "cuda/grouped_gemm/grouped_gemm_tactics.h"
#include "cuda/moe/moe_kernels.h"
#endif

TORCH_LIBRARY(cake, m) {
  // Ragged grouped GEMM. Groups are consecutive row ranges of the packed activations, given by
  // an int32 tensor on the operands' device: offs [E] (cumulative group ends) or m_indptr [E+1]
  // (leading zero). Rows past the last group end get zeros.
  //   fwd:   x [sum_m, K], w [E, N, K]        -> y [sum_m, N],  y[g] = x[g] @ w[e].T
  //   dgrad: grad_out [sum_m, N], w [E, N, K] -> dx [sum_m, K], dx[g] = grad_out[g] @ w[e]
  //   wgrad: grad_out [sum_m, N], x [sum_m, K] -> dw [E, N, K], dw[e] = grad_out[g].T @ x[g]
  m.def("grouped_gemm_fwd(Tensor x, Tensor w, Tensor offs) -> Tensor");
  m.def("grouped_gemm_dgrad(Tensor grad_out, Tensor w, Tensor offs) -> Tensor");
  m.def(
      "grouped_gemm_wgrad(Tensor grad_out, Tensor x, Tensor offs, int num_groups, "
      "ScalarType out_dtype) -> Tensor");
  // The same computations into caller-owned outputs, with a caller-owned workspace of
  // grouped_gemm_workspace_size(E) bytes: these allocate nothing (prepared launches).
  m.def(
      "grouped_gemm_fwd_out(Tensor x, Tensor w, Tensor offs, Tensor(a!) out, "
      "Tensor(b!) workspace) -> ()");
  m.def(
      "grouped_gemm_dgrad_out(Tensor grad_out, Tensor w, Tensor offs, Tensor(a!) out, "
      "Tensor(b!) workspace) -> ()");
  m.def(
      "grouped_gemm_wgrad_out(Tensor grad_out, Tensor x, Tensor offs, Tensor(a!) out, "
      "Tensor(b!) workspace) -> ()");

  // MoE token sort. token_selected_experts [T, top_k] int32 global expert ids; this shard holds
  // experts [local_expert_offset, local_expert_offset + num_local_experts). Routes to other
  // experts (or to ids outside [0, num_experts)) are dropped: they contribute zero. Returns
  //   expert_counts [E_local], expert_offsets [E_local + 1] (m_indptr of the permuted rows),
  //   permuted_to_expanded [T * top_k] (expanded index t * top_k + j of each permuted row; -1 past
  //   the last), expanded_to_permuted [T * top_k] (-1 for dropped routes), expert_tile_offsets
  //   [E_local + 1] (cumulative ceil(count / tile_size)). Within an expert, rows keep expanded
  //   order, so the permutation is deterministic. All sizes depend on T, top_k and E_local only.
  m.def(
      "moe_sort(Tensor token_selected_experts, int num_experts, int num_local_experts, "
      "int local_expert_offset, int tile_size) -> (Tensor expert_counts, Tensor expert_offsets, "
      "Tensor permuted_to_expanded, Tensor expanded_to_permuted, Tensor expert_tile_offsets)");
  // Renormalize routing (StepFun): from router_logits [T, E] (float32/bf16/fp16), the top_k
  // experts of each token (ties to the lower id; NaN counts as -inf) and the softmax over the k
  // selected logits in float32; or from precomputed topk_ids [T, k] int32 and topk_weights [T, k]
  // float32, taken as they are. Returns expert_ids [T, k] int32, expert_weights [T, k] float32
  // and moe_sort's five outputs for the shard [local_expert_offset, + num_local_experts).
  m.def(
      "moe_routing(Tensor? router_logits, Tensor? topk_ids, Tensor? topk_weights, int top_k, int num_experts, "
      "int num_local_experts, int local_expert_offset, int tile_size) -> (Tensor expert_ids, "
      "Tensor expert_weights, Tensor expert_counts, Tensor expert_offsets, Tensor permuted_to_expanded, "
      "Tensor expanded_to_permuted, Tensor expert_tile_offsets)");
  // GEMM1 of the MoE with SwiGLU: x [T, H], w1 [E_local, 2I, H] up/gate interleaved at 32 rows
  // (interleave_up_gate_sm90), the moe_sort permutation -> [T * top_k, I] in x's dtype, permuted
  // row p = silu(gate) * up of x[permuted_to_expanded[p] / top_k] @ w1[e].T; rows past the last
  // expert's end are zeros, or with zero_tail=False may be left unwritten on CUDA (GEMM2 and the
  // finalize never read them, and an expert-parallel shard's tail is most of the tensor: zeroing
  // it cost the Kimi-K2 EP8 shard 5.6% at T=16384; fused_moe_bf16 passes False). enable_pdl:
  // launch the CUDA kernels with Programmatic Dependent Launch (numerics unaffected; grouped GEMMs
  // of more than 4096 expected rows launch plainly: grouped_gemm_cuda.cpp).
  // clamp_limits (float32 [E_local]) makes the activation StepFun's SwiGLUStep,
  // min(silu(gate), L_e) * clamp(up, -L_e, L_e) with L_e the row's expert's limit.
  // tactic (both MoE GEMMs): -1 = automatic (the decode kernel for up to 64 rows, or 2 per
  // expert, where its grid covers the SMs, else the grouped GEMM's own choice, tuned or
  // heuristic), -2 = the decode kernel (N % 64 == 0, K bytes % 256 == 0), else that tactic of the
  // fwd family (grouped_gemm_tactics("fwd" / "fwd_f16" / "fwd_e4m3")); the CPU ignores it. fp8
  // (both MoE GEMMs): float8_e4m3fn activations and weights with a per-tensor activation scale
  // (float32, one element) and one weight scale per local expert (float32 [E_local]): expert e's
  // product is scaled by a_scale * w_scale[e] in float32 (physical units: before the clamp) and
  // rounded to bfloat16, the output dtype. GEMM1 also takes bfloat16 x with float8_e4m3fn w1: x
  // is quantized per tensor on its way in (the gather, or the decode kernel's staging), with
  // x_scale (static) or without (dynamic, max|x| / 448), bit for bit quantize_fp8(x, x_scale)
  // then the fp8 path. expected_routes (all the MoE GEMMs; -1: every row): how many of the
  // T * top_k rows the caller expects to be routed to this shard's experts (an expert-parallel
  // shard gets about T * top_k * E_local / E); the automatic tactic choice sizes the groups by it.
  // A hint only: results never depend on it. It is a SymInt so that a graph traced with dynamic
  // token counts passes it on instead of specializing on T (the kernels read it as an int64_t).
  // expanded_to_permuted (GEMM1): moe_sort's inverse of permuted_to_expanded; given, a large x is
  // gathered in token order through it instead of an inverse built on the way (a memset and a
  // kernel less; a row that does not map back is a device-side error).
  // w1_gate_up (GEMM1): w1 holds [gate; up] halves (gate rows [0, I), up rows [I, 2I): transformers'
  // gate_up_proj) instead of the 32-row interleave; the same numbers. On CUDA the decode kernels read
  // either; the bf16 grouped GEMM tiles have gate-up twins (the SwiGLU still in the epilogue); fp16
  // and e4m3 store h and the SwiGLU kernel follows.
  m.def(
      "moe_gemm1_swiglu(Tensor x, Tensor w1, Tensor permuted_to_expanded, Tensor expert_offsets, "
      "int top_k, bool enable_pdl=True, Tensor? clamp_limits=None, int tactic=-1, Tensor? x_scale=None, "
      "Tensor? w1_scale=None, SymInt expected_routes=-1, bool zero_tail=True, Tensor? expanded_to_permuted=None, "
      "bool w1_gate_up=False) -> Tensor");
  // GEMM2 of the MoE: intermediate [T * top_k, I] (permuted rows), w2 [E_local, H, I] ->
  // [T * top_k, H] permuted rows, unscaled. bfloat16 intermediate with float8_e4m3fn w2: quantized
  // per tensor on the way in (a_scale static, or dynamic), bit for bit quantize_fp8 then the fp8
  // path -- in the decode kernel's staging when it takes them, else into a temporary. Rows past
  // the last expert's end belong to no route and are left unwritten on CUDA (moe_finalize never
  // reads them; with expert parallelism they are most of the tensor).
  m.def(
      "moe_gemm2(Tensor intermediate, Tensor w2, Tensor expert_offsets, bool enable_pdl=True, int tactic=-1, "
      "Tensor? a_scale=None, Tensor? w2_scale=None, SymInt expected_routes=-1) -> Tensor");
  // Per-tensor fp8 quantization: out = e4m3(clamp(x / scale, -448, 448)), rounded to nearest even,
  // in float32. scale None: a dynamic scale, max(amax(|x|), 1e-12) / 448, computed on the device.
  // Returns (out, the scale used). A given scale must be positive and finite: on CUDA it stays on the
  // device and is not checked (the Python API checks static scales where it takes them).
  m.def("quantize_fp8(Tensor x, Tensor? scale=None) -> (Tensor out, Tensor scale)");
  m.def("quantize_fp8_out(Tensor x, Tensor? scale, Tensor(a!) out, Tensor(b!) scale_out) -> ()");
  // Weighted combine into token order: out[t] = sum_j scales[t, j] * permuted_rows[p(t, j)] over
  // the kept routes (expanded_to_permuted >= 0), fp32 in route order, one rounding: [T, H].
  m.def(
      "moe_finalize(Tensor permuted_rows, Tensor expanded_to_permuted, Tensor token_final_scales, "
      "bool enable_pdl=True) -> Tensor");
  // moe_finalize's gradients (its autograd formula): (rows_grad [num_rows, H] in grad_output's dtype: a kept route's
  // row gets scale * grad_output[token] in float32, rounded once, a row no route reads zeros; scales_grad [T, top_k]
  // float32: the dot product of the route's row and its token's grad_output, zero for dropped routes). scales_grad
  // needs permuted_rows and is empty ([0]) without it. Kept routes must read distinct rows (as moe_sort's do).
  m.def(
      "moe_finalize_backward(Tensor grad_output, Tensor expanded_to_permuted, Tensor token_final_scales, "
      "SymInt num_rows, Tensor? permuted_rows=None) -> (Tensor rows_grad, Tensor scales_grad)");
  // SwiGLU of [gate | up] halves (the output of transformers' gate_up_proj, as an experts implementation trains
  // it): gate_up [rows, 2I] -> [rows, I] = silu(gate) * up in float32, rounded once; swiglu_backward(grad_out
  // [rows, I], gate_up) -> [rows, 2I]: [grad * up * silu'(gate) | grad * silu(gate)], float32, rounded once.
  // limit (> 0): the clamped SwiGLU of DeepSeek-V4 / GLM-5 / HY-V4 experts, silu(min(gate, limit)) *
  // clamp(up, -limit, limit), with torch 2.14's clamp gradient (through where gate < limit, -limit < up < limit).
  m.def("swiglu(Tensor gate_up, float? limit=None) -> Tensor");
  m.def("swiglu_backward(Tensor grad_out, Tensor gate_up, float? limit=None) -> Tensor");
  // moe_routing and moe_gemm1_swiglu into caller-owned outputs, with caller-owned uint8 workspaces
  // of moe_routing_workspace_size(T * top_k, E_local) and moe_gemm1_workspace_size(T * top_k, H, I,
  // E_local, element_size) bytes: these allocate nothing (prepared launches). An empty workspace
  // for moe_gemm1_swiglu_out lets it allocate its own (traced code, which cannot size it).
  m.def(
      "moe_routing_out(Tensor? router_logits, Tensor? topk_ids, Tensor? topk_weights, int top_k, int num_experts, "
      "int num_local_experts, int local_expert_offset, int tile_size, Tensor(a!) expert_ids, "
      "Tensor(b!) expert_weights, Tensor(c!) expert_counts, Tensor(d!) expert_offsets, "
      "Tensor(e!) permuted_to_expanded, Tensor(f!) expanded_to_permuted, Tensor(g!) expert_tile_offsets, "
      "Tensor(h!) workspace) -> ()");
  m.def(
      "moe_gemm1_swiglu_out(Tensor x, Tensor w1, Tensor permuted_to_expanded, Tensor expert_offsets, int top_k, "
      "Tensor(a!) out, Tensor(b!) workspace, bool enable_pdl=True, Tensor? clamp_limits=None, int tactic=-1, "
      "Tensor? x_scale=None, Tensor? w1_scale=None, SymInt expected_routes=-1, bool zero_tail=True, "
      "Tensor? expanded_to_permuted=None, bool w1_gate_up=False) -> ()");
  // moe_gemm2 into a caller-owned out [T * top_k, H] with a workspace of
  // grouped_gemm_workspace_size(E_local) bytes (empty: allocated by the op).
  m.def(
      "moe_gemm2_out(Tensor intermediate, Tensor w2, Tensor expert_offsets, Tensor(a!) out, Tensor(b!) workspace, "
      "bool enable_pdl=True, int tactic=-1, Tensor? a_scale=None, Tensor? w2_scale=None, "
      "SymInt expected_routes=-1) -> ()");
  // GEMM2 with the fused finalize (fused_moe_bf16's default): out [T, H] (the intermediate's dtype,
  // bfloat16 or float16; contents overwritten) = sum over the kept routes of token t of
  // round(scales[t, j] * round(row)), row = GEMM2's product row of route (t, j), each addition
  // rounded to out's dtype. On CUDA the additions are atomics in any order (not bitwise
  // reproducible; moe_finalize is the fixed-order combine); the CPU adds in route order. Where the
  // GEMM's tile has no fused epilogue (decode sizes), GEMM2 then moe_finalize run instead.
  m.def(
      "moe_gemm2_finalize_out(Tensor intermediate, Tensor w2, Tensor expert_offsets, Tensor permuted_to_expanded, "
      "Tensor expanded_to_permuted, Tensor token_final_scales, Tensor(a!) out, bool enable_pdl=True, "
      "int tactic=-1, SymInt expected_routes=-1) -> ()");
  // A whole MoE layer into out [T, H] (x's dtype, overwritten): moe_sort of token_selected_experts
  // for the shard [local_expert_offset, + E_local) (E_local = w1.size(0)), moe_gemm1_swiglu (SwiGLU,
  // or SwiGLUStep with clamp_limits), moe_gemm2 and moe_finalize, with those ops' numbers; fp8:
  // float8_e4m3fn w1 / w2 with w1_scale / w2_scale, bfloat16 x quantized per tensor on the way into
  // each GEMM (x_scale / fc2_scale static, or dynamic). On CUDA a decode batch (T * top_k <= 64
  // routes, shapes the decode kernel takes: moe_forward_layer_fits) runs as one cooperative launch
  // with a uint8 workspace of moe_forward_workspace_size(T * top_k, H, I) bytes (empty: allocated
  // by the op); anything else runs the four ops. expected_routes: as the MoE GEMMs' (a shard's
  // share of the T * top_k routes under even routing, -1: all); it picks kernels, never results.
  // w1_gate_up: as moe_gemm1_swiglu's.
  m.def(
      "moe_forward_out(Tensor x, Tensor token_selected_experts, Tensor token_final_scales, Tensor w1, Tensor w2, "
      "int local_expert_offset, Tensor(a!) out, Tensor(b!) workspace, bool enable_pdl=True, Tensor? clamp_limits=None, "
      "Tensor? x_scale=None, Tensor? w1_scale=None, Tensor? fc2_scale=None, Tensor? w2_scale=None, "
      "SymInt expected_routes=-1, bool w1_gate_up=False) -> ()");
  // moe_routing (Renormalize top-k of router_logits [T, E]) into token_selected_experts [T, k] int32
  // and token_final_scales [T, k] float32 (written; k = their width), then moe_forward_out with
  // them: the StepFun decode layer (on CUDA the routing kernel, then moe_forward_out's kernels; its
  // expected_routes from router_logits' width E: T * top_k * E_local / E for a shard).
  m.def(
      "moe_forward_from_logits_out(Tensor x, Tensor router_logits, Tensor w1, Tensor w2, int local_expert_offset, "
      "Tensor(a!) token_selected_experts, Tensor(b!) token_final_scales, Tensor(c!) out, Tensor(d!) workspace, "
      "bool enable_pdl=True, Tensor? clamp_limits=None, Tensor? x_scale=None, Tensor? w1_scale=None, "
      "Tensor? fc2_scale=None, Tensor? w2_scale=None) -> ()");
  // The same into a caller-owned [T, H] tensor of permuted_rows' dtype (fused_moe_bf16's moe_output).
  m.def(
      "moe_finalize_out(Tensor permuted_rows, Tensor expanded_to_permuted, Tensor token_final_scales, "
      "Tensor(a!) out, bool enable_pdl=True) -> ()");
}

namespace {

PyObject* workspace_size(PyObject*, PyObject* arg) {
  long long num_groups = PyLong_AsLongLong(arg);
  if (num_groups == -1 && PyErr_Occurred()) return nullptr;
  if (num_groups < 0) {
    PyErr_SetString(PyExc_ValueError, "grouped_gemm_workspace_size: num_groups must be >= 0");
    return nullptr;
  }
  return PyLong_FromLongLong(cake::grouped_gemm_workspace_bytes(num_groups));
}

#ifdef CAKE_WITH_CUDA
// Tactic names of a family ("fwd", "dgrad", "wgrad", "wgrad_f32", "fwd_f16"), in tactic-number order.
PyObject* grouped_gemm_tactics(PyObject*, PyObject* arg) {
  const char* family = PyUnicode_AsUTF8AndSize(arg, nullptr);
  if (family == nullptr) return nullptr;
  try {
    const auto& table = cake::tactics_sm90(cake::tactic_family(family));
    PyObject* names = PyList_New(static_cast<Py_ssize_t>(table.size()));
    if (names == nullptr) return nullptr;
    for (size_t i = 0; i < table.size(); ++i) {
      PyObject* name = PyUnicode_FromString(table[i].name.c_str());
      if (name == nullptr || PyList_SetItem(names, static_cast<Py_ssize_t>(i), name) < 0) {
        Py_DECREF(names);
        return nullptr;
      }
    }
    return names;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

// "none", "swiglu" (the MoE GEMM1 in one kernel; "gather_swiglu" gathering its rows too; "swiglu_gu" /
// "gather_swiglu_gu" the same with w1 as [gate; up] halves) or "scatter" (the MoE GEMM2 with the fused
// finalize) -> the epilogue twin; false for any other name. kEpilogueTwinNames: them, for error messages.
constexpr const char* kEpilogueTwinNames = "none, swiglu, gather_swiglu, swiglu_gu, gather_swiglu_gu or scatter";

bool epilogue_twin_named(const std::string& name, cake::EpilogueTwin* twin) {
  if (name == "none") *twin = cake::EpilogueTwin::kNone;
  else if (name == "swiglu") *twin = cake::EpilogueTwin::kSwiGlu;
  else if (name == "scatter") *twin = cake::EpilogueTwin::kScatter;
  else if (name == "gather_swiglu") *twin = cake::EpilogueTwin::kGatherSwiGlu;
  else if (name == "swiglu_gu") *twin = cake::EpilogueTwin::kSwiGluGateUp;
  else if (name == "gather_swiglu_gu") *twin = cake::EpilogueTwin::kGatherSwiGluGateUp;
  else return false;
  return true;
}

// Tactic names of a fwd family whose configuration has an epilogue twin ("swiglu" or "scatter").
PyObject* grouped_gemm_epilogue_twins(PyObject*, PyObject* args) {
  const char* family = nullptr;
  const char* kind = nullptr;
  if (!PyArg_ParseTuple(args, "ss", &family, &kind)) return nullptr;
  cake::EpilogueTwin twin;
  if (!epilogue_twin_named(kind, &twin) || twin == cake::EpilogueTwin::kNone) {
    PyErr_SetString(PyExc_ValueError,
                    "grouped_gemm_epilogue_twins: kind must be 'swiglu', 'scatter', 'gather_swiglu', 'swiglu_gu' or "
                    "'gather_swiglu_gu'");
    return nullptr;
  }
  try {
    PyObject* names = PyList_New(0);
    for (const auto& tactic : cake::tactics_sm90(cake::tactic_family(family))) {
      if (cake::epilogue_twin_sm90(tactic, twin) == nullptr) continue;
      PyObject* name = PyUnicode_FromString(tactic.name.c_str());
      PyList_Append(names, name);
      Py_DECREF(name);
    }
    return names;
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
}

// Force tactic `index` for a family (-1: the heuristic again).
PyObject* set_grouped_gemm_tactic(PyObject*, PyObject* args) {
  const char* family = nullptr;
  int index = -1;
  if (!PyArg_ParseTuple(args, "si", &family, &index)) return nullptr;
  try {
    cake::set_tactic_override(cake::tactic_family(family), index);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// The tactic a launch of this problem would run now (override, tuned or heuristic); expected_rows:
// the MoE GEMMs' expected_routes hint (-1: sum_m); epilogue: "none", or the twin that will run the
// tactic ("swiglu": MoE GEMM1, "scatter": MoE GEMM2 with the fused finalize); dram_tbps: the device's
// DRAM bandwidth the heuristic assumes (0: this device's; without a GPU the H200's 4.8).
PyObject* grouped_gemm_tactic_for(PyObject*, PyObject* args) {
  const char* family = nullptr;
  const char* epilogue = "none";
  long long e = 0, sum_m = 0, n = 0, k = 0, expected_rows = -1;
  double dram_tbps = 0;
  if (!PyArg_ParseTuple(args, "sLLLL|Lsd", &family, &e, &sum_m, &n, &k, &expected_rows, &epilogue, &dram_tbps)) {
    return nullptr;
  }
  try {
    cake::EpilogueTwin twin;
    TORCH_CHECK(epilogue_twin_named(epilogue, &twin),
                "grouped_gemm_tactic_for: epilogue must be ", kEpilogueTwinNames, ", got '", epilogue, "'");
    cake::GroupedGemmShape s{e, sum_m, n, k, false, expected_rows};
    TORCH_CHECK(dram_tbps >= 0, "grouped_gemm_tactic_for: dram_tbps must be >= 0 (0: this device's), got ",
                dram_tbps);
    return PyLong_FromLong(cake::choose_tactic_sm90(cake::tactic_family(family), s, twin, dram_tbps * 1e12));
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_ValueError, err.what_without_backtrace());
    return nullptr;
  }
}

// Keep `tactic` for problems of the bucket of (E, sum_m, N, K) run with `epilogue` (what the
// autotuner measured).
PyObject* set_grouped_gemm_tuned_tactic(PyObject*, PyObject* args) {
  const char* family = nullptr;
  const char* epilogue = "none";
  long long e = 0, sum_m = 0, n = 0, k = 0;
  int tactic = -1;
  if (!PyArg_ParseTuple(args, "sLLLLi|s", &family, &e, &sum_m, &n, &k, &tactic, &epilogue)) return nullptr;
  try {
    cake::EpilogueTwin twin;
    TORCH_CHECK(epilogue_twin_named(epilogue, &twin),
                "set_grouped_gemm_tuned_tactic: epilogue must be ", kEpilogueTwinNames, ", got '", epilogue, "'");
    cake::set_tuned_tactic(cake::tactic_family(family), cake::GroupedGemmShape{e, sum_m, n, k, false},
                           tactic, twin);
  } catch (const c10::Error& err) {
    PyErr_SetString(PyExc_ValueError, err.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyObject* clear_grouped_gemm_tuned_tactics(PyObject*, PyObject*) {
  cake::clear_tuned_tactics();
  Py_RETURN_NONE;
}
#endif

// moe_routing_workspace_size(routes, E_local) and moe_gemm1_workspace_size(rows, H, I, E_local,
// element_size): bytes of the MoE out-variants' workspaces (element_size: w1's).
PyObject* moe_routing_workspace_size(PyObject*, PyObject* args) {
  long long routes = 0, num_local = 0;
  if (!PyArg_ParseTuple(args, "LL", &routes, &num_local)) return nullptr;
  if (routes < 0 || num_local < 1) {
    PyErr_SetString(PyExc_ValueError, "moe_routing_workspace_size: routes must be >= 0 and E_local >= 1");
    return nullptr;
  }
  return PyLong_FromLongLong(cake::moe_routing_workspace_bytes(routes, num_local));
}

PyObject* moe_gemm1_workspace_size(PyObject*, PyObject* args) {
  long long rows = 0, hidden = 0, inter = 0, num_local = 0, element_size = 0;
  if (!PyArg_ParseTuple(args, "LLLLL", &rows, &hidden, &inter, &num_local, &element_size)) return nullptr;
  if (rows < 0 || hidden < 0 || inter < 0 || num_local < 0 || element_size < 1) {
    PyErr_SetString(PyExc_ValueError, "moe_gemm1_workspace_size: sizes must be >= 0 and element_size >= 1");
    return nullptr;
  }
  return PyLong_FromLongLong(cake::moe_gemm1_workspace_bytes(rows, hidden, inter, num_local, element_size));
}

// moe_forward_workspace_size(routes, H, I): bytes of moe_forward_out's workspace;
// moe_forward_layer_fits(routes, H, I, weight_bytes): whether its CUDA path is the one-launch layer
// kernel (False in a build without CUDA kernels).
PyObject* moe_forward_workspace_size(PyObject*, PyObject* args) {
  long long routes = 0, hidden = 0, inter = 0;
  if (!PyArg_ParseTuple(args, "LLL", &routes, &hidden, &inter)) return nullptr;
  if (routes < 0 || hidden < 0 || inter < 0) {
    PyErr_SetString(PyExc_ValueError, "moe_forward_workspace_size: sizes must be >= 0");
    return nullptr;
  }
  return PyLong_FromLongLong(cake::moe_forward_workspace_bytes(routes, hidden, inter));
}

PyObject* moe_forward_layer_fits(PyObject*, PyObject* args) {
  long long routes = 0, hidden = 0, inter = 0, weight_bytes = 0;
  if (!PyArg_ParseTuple(args, "LLLL", &routes, &hidden, &inter, &weight_bytes)) return nullptr;
#ifdef CAKE_WITH_CUDA
  if (cake::sm90::moe_decode_layer_fits(routes, hidden, inter, weight_bytes)) Py_RETURN_TRUE;
#endif
  Py_RETURN_FALSE;
}

PyMethodDef methods[] = {
    {"moe_forward_workspace_size", moe_forward_workspace_size, METH_VARARGS,
     "moe_forward_workspace_size(routes, H, I): bytes of moe_forward_out's workspace."},
    {"moe_forward_layer_fits", moe_forward_layer_fits, METH_VARARGS,
     "moe_forward_layer_fits(routes, H, I, weight_bytes): whether moe_forward_out runs as one CUDA launch."},
    {"moe_routing_workspace_size", moe_routing_workspace_size, METH_VARARGS,
     "moe_routing_workspace_size(routes, E_local): bytes of moe_routing_out's workspace."},
    {"moe_gemm1_workspace_size", moe_gemm1_workspace_size, METH_VARARGS,
     "moe_gemm1_workspace_size(rows, H, I, E_local, element_size): bytes of moe_gemm1_swiglu_out's workspace."},
    {"grouped_gemm_workspace_size", workspace_size, METH_O,
     "Bytes of device workspace a grouped GEMM over num_groups groups needs."},
#ifdef CAKE_WITH_CUDA
    {"grouped_gemm_tactics", grouped_gemm_tactics, METH_O,
     "Names of the SM90 kernel configurations of a family (fwd, dgrad, wgrad, wgrad_f32)."},
    {"grouped_gemm_epilogue_twins", grouped_gemm_epilogue_twins, METH_VARARGS,
     "grouped_gemm_epilogue_twins(family, kind): fwd tactics whose tile also runs with the MoE GEMM1's SwiGLU "
     "(kind 'swiglu') or the MoE GEMM2's fused finalize ('scatter') as its epilogue, or the SwiGLU twin that "
     "gathers its rows of x itself ('gather_swiglu')."},
    {"set_grouped_gemm_tactic", set_grouped_gemm_tactic, METH_VARARGS,
     "set_grouped_gemm_tactic(family, index): force a configuration; -1 restores the heuristic."},
    {"grouped_gemm_tactic_for", grouped_gemm_tactic_for, METH_VARARGS,
     "grouped_gemm_tactic_for(family, E, sum_m, N, K, expected_rows=-1, epilogue='none', dram_tbps=0): the tactic "
     "such a launch runs now (dram_tbps: the DRAM bandwidth assumed; 0: this device's)."},
    {"set_grouped_gemm_tuned_tactic", set_grouped_gemm_tuned_tactic, METH_VARARGS,
     "set_grouped_gemm_tuned_tactic(family, E, sum_m, N, K, tactic, epilogue='none'): keep a tuned choice."},
    {"clear_grouped_gemm_tuned_tactics", clear_grouped_gemm_tuned_tactics, METH_NOARGS,
     "Forget every tuned choice."},
#endif
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "cake_ops native ops", -1, methods};

}  // namespace

// Importing cake_ops._C runs the registrations above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) return nullptr;
  // Comma-separated SM targets with kernels in this build ("" for a CPU-only build).
  if (PyModule_AddStringConstant(module, "CUDA_ARCHS", CAKE_CUDA_ARCHS_STR) < 0) return nullptr;
  return module;
}
