"""Fake (meta) implementations of every torch.ops.cake op, mirroring csrc/torch_bindings.cpp.

Output shapes depend only on argument shapes, so these are exact. The checks here are the
type and shape checks of csrc/grouped_gemm_checks.cpp, with the same messages, so that bad
inputs fail the same way under torch.compile as in eager mode.
"""
import torch
from torch.library import register_fake

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check(cond, msg):
    torch._check(cond, lambda: msg)


def _check_dims(t, dim, name, layout, op):
    _check(t.dim() == dim, f"{op}: {name} must be a {dim}-D {layout} tensor, got shape {list(t.shape)}")


def _check_pair(a, a_name, b, b_name, op, allow_e4m3=False):
    _check(a.dtype in _FLOAT_DTYPES or (allow_e4m3 and a.dtype == torch.float8_e4m3fn),
           f"{op}: {a_name} must be bfloat16, float16, float32 or float64, got {a.dtype}")
    quantized_by_op = allow_e4m3 and a.dtype == torch.bfloat16 and b.dtype == torch.float8_e4m3fn
    _check(a.dtype == b.dtype or quantized_by_op,
           f"{op}: {a_name} and {b_name} must have the same dtype, got {a.dtype} and {b.dtype}")
    _check(a.device == b.device,
           f"{op}: {a_name} and {b_name} must be on the same device, got {a.device} and {b.device}")


def _check_contiguous(t, name, layout, op):
    _check(t.is_contiguous(), f"{op}: {name} must be contiguous (row-major {layout}); call .contiguous() first")


def check_offs(offs, num_groups, like, op):
    _check(offs.dtype == torch.int32, f"{op}: offs must be int32, got {offs.dtype}")
    _check(offs.device == like.device, f"{op}: offs must be on the operands' device {like.device}, got {offs.device}")
    _check(offs.dim() == 1 and (offs.shape[0] == num_groups or offs.shape[0] == num_groups + 1),
           f"{op}: offs must be 1-D with E={num_groups} entries (cumulative group ends) or "
           f"E+1={num_groups + 1} (m_indptr with a leading zero), got shape {list(offs.shape)}")


def check_fwd(x, w, offs, op="cake::grouped_gemm_fwd", allow_e4m3=False):
    _check_dims(x, 2, "x", "[sum_m, K]", op)
    _check_dims(w, 3, "w", "[E, N, K]", op)
    _check_pair(x, "x", w, "w", op, allow_e4m3)
    _check(x.shape[1] == w.shape[2],
           f"{op}: K mismatch: x is [sum_m, K] with K={x.shape[1]} but w is [E, N, K] with K={w.shape[2]}")
    _check_contiguous(x, "x", "[sum_m, K]", op)
    _check_contiguous(w, "w", "[E, N, K]", op)
    check_offs(offs, w.shape[0], x, op)
    return (x.shape[0], w.shape[1])


def check_dgrad(grad_out, w, offs, op="cake::grouped_gemm_dgrad"):
    _check_dims(grad_out, 2, "grad_out", "[sum_m, N]", op)
    _check_dims(w, 3, "w", "[E, N, K]", op)
    _check_pair(grad_out, "grad_out", w, "w", op)
    _check(grad_out.shape[1] == w.shape[1],
           f"{op}: N mismatch: grad_out is [sum_m, N] with N={grad_out.shape[1]} but w is [E, N, K] with N={w.shape[1]}")
    _check_contiguous(grad_out, "grad_out", "[sum_m, N]", op)
    _check_contiguous(w, "w", "[E, N, K]", op)
    check_offs(offs, w.shape[0], grad_out, op)
    return (grad_out.shape[0], w.shape[2])


def check_wgrad(grad_out, x, offs, num_groups, out_dtype, op="cake::grouped_gemm_wgrad"):
    _check_dims(grad_out, 2, "grad_out", "[sum_m, N]", op)
    _check_dims(x, 2, "x", "[sum_m, K]", op)
    _check_pair(grad_out, "grad_out", x, "x", op)
    _check(grad_out.shape[0] == x.shape[0],
           f"{op}: sum_m mismatch: grad_out has {grad_out.shape[0]} rows but x has {x.shape[0]}")
    _check(num_groups >= 0, f"{op}: num_groups must be >= 0, got {num_groups}")
    _check_contiguous(grad_out, "grad_out", "[sum_m, N]", op)
    _check_contiguous(x, "x", "[sum_m, K]", op)
    _check(out_dtype == x.dtype or out_dtype == torch.float32,
           f"{op}: out_dtype must be the input dtype ({x.dtype}) or float32, got {out_dtype}")
    check_offs(offs, num_groups, x, op)
    return (num_groups, grad_out.shape[1], x.shape[1])


def check_out(out, shape, dtype, like, op):
    _check(tuple(out.shape) == tuple(shape), f"{op}: out must have shape {list(shape)}, got {list(out.shape)}")
    _check(out.dtype == dtype, f"{op}: out must be {dtype}, got {out.dtype}")
    _check(out.device == like.device, f"{op}: out must be on {like.device}, got {out.device}")
    _check(out.is_contiguous(), f"{op}: out must be contiguous")


@register_fake("cake::grouped_gemm_fwd")
def _grouped_gemm_fwd_fake(x, w, offs):
    return x.new_empty(check_fwd(x, w, offs))


@register_fake("cake::grouped_gemm_dgrad")
def _grouped_gemm_dgrad_fake(grad_out, w, offs):
    return grad_out.new_empty(check_dgrad(grad_out, w, offs))


@register_fake("cake::grouped_gemm_wgrad")
def _grouped_gemm_wgrad_fake(grad_out, x, offs, num_groups, out_dtype):
    return x.new_empty(check_wgrad(grad_out, x, offs, num_groups, out_dtype), dtype=out_dtype)


@register_fake("cake::grouped_gemm_fwd_out")
def _grouped_gemm_fwd_out_fake(x, w, offs, out, workspace):
    op = "cake::grouped_gemm_fwd_out"
    check_out(out, check_fwd(x, w, offs, op), x.dtype, x, op)


@register_fake("cake::grouped_gemm_dgrad_out")
def _grouped_gemm_dgrad_out_fake(grad_out, w, offs, out, workspace):
    op = "cake::grouped_gemm_dgrad_out"
    check_out(out, check_dgrad(grad_out, w, offs, op), grad_out.dtype, grad_out, op)


@register_fake("cake::grouped_gemm_wgrad_out")
def _grouped_gemm_wgrad_out_fake(grad_out, x, offs, out, workspace):
    op = "cake::grouped_gemm_wgrad_out"
    _check_dims(out, 3, "out", "[E, N, K]", op)
    shape = check_wgrad(grad_out, x, offs, out.shape[0], out.dtype, op)
    check_out(out, shape, out.dtype, x, op)


@register_fake("cake::moe_sort")
def _moe_sort_fake(token_selected_experts, num_experts, num_local_experts, local_expert_offset, tile_size):
    op = "cake::moe_sort"
    ids = token_selected_experts
    _check(ids.dim() == 2, f"{op}: token_selected_experts must be a 2-D [num_tokens, top_k] tensor, got shape {list(ids.shape)}")
    _check(ids.dtype == torch.int32, f"{op}: token_selected_experts must be int32, got {ids.dtype}")
    _check(0 < num_local_experts <= num_experts,
           f"{op}: num_local_experts must be in [1, num_experts={num_experts}], got {num_local_experts}")
    _check(0 <= local_expert_offset and local_expert_offset + num_local_experts <= num_experts,
           f"{op}: the shard must lie within [0, num_experts={num_experts})")
    _check(tile_size > 0, f"{op}: tile_size must be positive, got {tile_size}")
    routes = ids.shape[0] * ids.shape[1]
    return (ids.new_empty(num_local_experts), ids.new_empty(num_local_experts + 1), ids.new_empty(routes),
            ids.new_empty(routes), ids.new_empty(num_local_experts + 1))


@register_fake("cake::moe_routing")
def _moe_routing_fake(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                      local_expert_offset, tile_size):
    op = "cake::moe_routing"
    _check((router_logits is None) != (topk_ids is None and topk_weights is None),
           f"{op}: give either router_logits (FromLogits) or topk_ids and topk_weights (UnpackedPrecomputed)")
    _check(1 <= top_k <= num_experts, f"{op}: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    like = router_logits if router_logits is not None else topk_ids
    _check(like is not None and like.dim() == 2, f"{op}: routing inputs must be 2-D [num_tokens, ...]")
    ids = like.new_empty((like.shape[0], top_k), dtype=torch.int32)
    return (ids, like.new_empty((like.shape[0], top_k), dtype=torch.float32),
            *_moe_sort_fake(ids, num_experts, num_local_experts, local_expert_offset, tile_size))


def _moe_gemm_out_dtype(a):
    return torch.bfloat16 if a.dtype == torch.float8_e4m3fn else a.dtype


def _check_activation_scale(a_scale, a_name, op):
    _check(a_scale.dtype == torch.float32 and a_scale.numel() == 1,
           f"{op}: the {a_name} scale must be one float32 value, got {a_scale.dtype} {list(a_scale.shape)}")


def _check_weight_scales(w_scale, num_local_experts, op):
    _check(w_scale.dtype == torch.float32 and tuple(w_scale.shape) == (num_local_experts,),
           f"{op}: the weight scales must be float32 [E_local] = [{num_local_experts}], got {w_scale.dtype} "
           f"{list(w_scale.shape)}")


def _check_moe_gemm_scales(a, a_scale, w_scale, num_local_experts, a_name, op):
    if a.dtype != torch.float8_e4m3fn:
        _check(a_scale is None and w_scale is None,
               f"{op}: scales apply to float8_e4m3fn {a_name} and weights only, got {a.dtype}")
        return
    _check(a_scale is not None and w_scale is not None, f"{op}: float8_e4m3fn {a_name} and weights need their scales")
    _check_activation_scale(a_scale, a_name, op)
    _check_weight_scales(w_scale, num_local_experts, op)


def _check_moe_gemm_input(a, a_scale, w, w_scale, a_name, w_name, op):
    """check_moe_gemm_input: bfloat16 a with float8_e4m3fn w is quantized on its way in."""
    if a.dtype == torch.bfloat16 and w.dtype == torch.float8_e4m3fn:
        _check(w_scale is not None, f"{op}: float8_e4m3fn {w_name} needs its scales (one per local expert)")
        _check_weight_scales(w_scale, w.shape[0], op)
        if a_scale is not None:
            _check_activation_scale(a_scale, a_name, op)
        return
    _check_moe_gemm_scales(a, a_scale, w_scale, w.shape[0], a_name, op)


def _check_expected_routes(expected_routes, op):
    _check(expected_routes >= -1, f"{op}: expected_routes must be -1 (every row) or a route count >= 0, got "
           f"{expected_routes}")


@register_fake("cake::moe_gemm1_swiglu")
def _moe_gemm1_swiglu_fake(x, w1, permuted_to_expanded, expert_offsets, top_k, enable_pdl=True, clamp_limits=None,
                           tactic=-1, x_scale=None, w1_scale=None, expected_routes=-1, zero_tail=True,
                           expanded_to_permuted=None, w1_gate_up=False):
    return _moe_gemm1_output(x, w1, permuted_to_expanded, top_k, x_scale, w1_scale, expected_routes,
                             expanded_to_permuted, "cake::moe_gemm1_swiglu")


def _moe_gemm1_output(x, w1, permuted_to_expanded, top_k, x_scale, w1_scale, expected_routes, expanded_to_permuted,
                      op):
    _check_expected_routes(expected_routes, op)
    _check(x.dim() == 2 and w1.dim() == 3, f"{op}: x must be [num_tokens, hidden] and w1 [E_local, 2I, hidden]")
    _check(w1.shape[2] == x.shape[1] and w1.shape[1] % 64 == 0,
           f"{op}: w1 must be [E_local, 2I, hidden={x.shape[1]}] with I % 32 == 0, got shape {list(w1.shape)}")
    _check(w1.dtype == x.dtype or (x.dtype == torch.bfloat16 and w1.dtype == torch.float8_e4m3fn),
           f"{op}: x and w1 must have the same dtype (or bfloat16 x with float8_e4m3fn w1), got {x.dtype} and "
           f"{w1.dtype}")
    _check(permuted_to_expanded.shape == (x.shape[0] * top_k,),
           f"{op}: permuted_to_expanded must be int32 [num_tokens * top_k] = [{x.shape[0] * top_k}]")
    if expanded_to_permuted is not None:
        _check(expanded_to_permuted.shape == permuted_to_expanded.shape and expanded_to_permuted.dtype == torch.int32,
               f"{op}: expanded_to_permuted must be int32 [num_tokens * top_k] = [{x.shape[0] * top_k}] on "
               f"{x.device} (moe_sort's), got {expanded_to_permuted.dtype} {list(expanded_to_permuted.shape)} on "
               f"{expanded_to_permuted.device}")
    _check_moe_gemm_input(x, x_scale, w1, w1_scale, "x", "w1", op)
    return x.new_empty((x.shape[0] * top_k, w1.shape[1] // 2), dtype=_moe_gemm_out_dtype(x))


@register_fake("cake::moe_gemm2")
def _moe_gemm2_fake(intermediate, w2, expert_offsets, enable_pdl=True, tactic=-1, a_scale=None, w2_scale=None,
                    expected_routes=-1):
    return _moe_gemm2_output(intermediate, w2, expert_offsets, a_scale, w2_scale, expected_routes, "cake::moe_gemm2")


def _moe_gemm2_output(intermediate, w2, expert_offsets, a_scale, w2_scale, expected_routes, op):
    _check_expected_routes(expected_routes, op)
    shape = check_fwd(intermediate, w2, expert_offsets, op, allow_e4m3=True)
    _check_moe_gemm_input(intermediate, a_scale, w2, w2_scale, "intermediate", "w2", op)
    return intermediate.new_empty(shape, dtype=_moe_gemm_out_dtype(intermediate))


@register_fake("cake::moe_gemm2_out")
def _moe_gemm2_out_fake(intermediate, w2, expert_offsets, out, workspace, enable_pdl=True, tactic=-1, a_scale=None,
                        w2_scale=None, expected_routes=-1):
    want = _moe_gemm2_output(intermediate, w2, expert_offsets, a_scale, w2_scale, expected_routes,
                             "cake::moe_gemm2_out")
    _check(out.shape == want.shape and out.dtype == want.dtype,
           f"cake::moe_gemm2_out: out must be [T * top_k, H] = {list(want.shape)} {want.dtype}, got "
           f"{list(out.shape)} {out.dtype}")


def _check_quantize_fp8(x, scale, op):
    _check(x.dtype in (torch.bfloat16, torch.float16, torch.float32),
           f"{op}: x must be bfloat16, float16 or float32, got {x.dtype}")
    _check(scale is None or (scale.dtype == torch.float32 and scale.numel() == 1),
           f"{op}: scale must be one float32 value (or None for a dynamic scale)")


@register_fake("cake::quantize_fp8")
def _quantize_fp8_fake(x, scale=None):
    _check_quantize_fp8(x, scale, "cake::quantize_fp8")
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(1, dtype=torch.float32)


@register_fake("cake::quantize_fp8_out")
def _quantize_fp8_out_fake(x, scale, out, scale_out):
    op = "cake::quantize_fp8_out"
    _check_quantize_fp8(x, scale, op)
    _check(out.dtype == torch.float8_e4m3fn and out.shape == x.shape,
           f"{op}: out must be a float8_e4m3fn tensor of x's shape {list(x.shape)}, got {out.dtype} {list(out.shape)}")
    _check(scale_out.dtype == torch.float32 and scale_out.numel() == 1, f"{op}: scale_out must be one float32 value")


@register_fake("cake::moe_finalize")
def _moe_finalize_fake(permuted_rows, expanded_to_permuted, token_final_scales, enable_pdl=True):
    op = "cake::moe_finalize"
    _check(permuted_rows.dim() == 2 and token_final_scales.dim() == 2,
           f"{op}: permuted_rows must be [rows, hidden] and token_final_scales [num_tokens, top_k]")
    _check(token_final_scales.dtype == torch.float32, f"{op}: token_final_scales must be float32")
    return permuted_rows.new_empty((token_final_scales.shape[0], permuted_rows.shape[1]))


@register_fake("cake::moe_finalize_backward")
def _moe_finalize_backward_fake(grad_output, expanded_to_permuted, token_final_scales, num_rows, permuted_rows=None):
    op = "cake::moe_finalize_backward"
    _check(grad_output.dim() == 2 and token_final_scales.dim() == 2
           and grad_output.shape[0] == token_final_scales.shape[0],
           f"{op}: grad_output must be [num_tokens, hidden] and token_final_scales [num_tokens, top_k], got "
           f"{list(grad_output.shape)} and {list(token_final_scales.shape)}")
    _check(token_final_scales.dtype == torch.float32, f"{op}: token_final_scales must be float32")
    rows_grad = grad_output.new_empty((num_rows, grad_output.shape[1]))
    if permuted_rows is None:
        return rows_grad, token_final_scales.new_empty((0,))
    _check(permuted_rows.shape == rows_grad.shape and permuted_rows.dtype == grad_output.dtype,
           f"{op}: permuted_rows must be [num_rows, hidden] = {list(rows_grad.shape)} {grad_output.dtype}, "
           f"got {permuted_rows.dtype} {list(permuted_rows.shape)}")
    return rows_grad, token_final_scales.new_empty(token_final_scales.shape)


def _check_swiglu(gate_up, op):
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
           f"{op}: gate_up must be 2-D [rows, 2I] ([gate | up] halves), got shape {list(gate_up.shape)}")
    _check(gate_up.dtype in _FLOAT_DTYPES,
           f"{op}: gate_up must be bfloat16, float16, float32 or float64, got {gate_up.dtype}")
    return gate_up.shape[1] // 2


def _check_swiglu_limit(limit, op):
    _check(limit is None or limit > 0, f"{op}: limit must be positive (the clamp of silu(min(gate, limit)) * "
           f"clamp(up, -limit, limit)), got {limit}")


@register_fake("cake::swiglu")
def _swiglu_fake(gate_up, limit=None):
    inter = _check_swiglu(gate_up, "cake::swiglu")
    _check_swiglu_limit(limit, "cake::swiglu")
    return gate_up.new_empty((gate_up.shape[0], inter))


@register_fake("cake::swiglu_backward")
def _swiglu_backward_fake(grad_out, gate_up, limit=None):
    op = "cake::swiglu_backward"
    inter = _check_swiglu(gate_up, op)
    _check_swiglu_limit(limit, op)
    _check(grad_out.dim() == 2 and grad_out.shape[0] == gate_up.shape[0] and grad_out.shape[1] == inter,
           f"{op}: grad_out must be [rows, I] = [{gate_up.shape[0]}, {inter}], got shape {list(grad_out.shape)}")
    _check(grad_out.dtype == gate_up.dtype and grad_out.device == gate_up.device,
           f"{op}: grad_out must have gate_up's dtype and device ({gate_up.dtype} on {gate_up.device}), got "
           f"{grad_out.dtype} on {grad_out.device}")
    return gate_up.new_empty(gate_up.shape)


@register_fake("cake::moe_finalize_out")
def _moe_finalize_out_fake(permuted_rows, expanded_to_permuted, token_final_scales, out, enable_pdl=True):
    op = "cake::moe_finalize_out"
    expected = _moe_finalize_fake(permuted_rows, expanded_to_permuted, token_final_scales)
    _check(out.shape == expected.shape and out.dtype == permuted_rows.dtype and out.device == permuted_rows.device,
           f"{op}: out must be [num_tokens, hidden] = {list(expected.shape)} of permuted_rows' dtype and device, "
           f"got {list(out.shape)} {out.dtype} on {out.device}")


@register_fake("cake::moe_gemm2_finalize_out")
def _moe_gemm2_finalize_out_fake(intermediate, w2, expert_offsets, permuted_to_expanded, expanded_to_permuted,
                                 token_final_scales, out, enable_pdl=True, tactic=-1, expected_routes=-1):
    op = "cake::moe_gemm2_finalize_out"
    _check_expected_routes(expected_routes, op)
    shape = check_fwd(intermediate, w2, expert_offsets, op, allow_e4m3=False)
    _check(intermediate.dtype in (torch.bfloat16, torch.float16),
           f"{op}: the fused finalize takes bfloat16 or float16 operands, got {intermediate.dtype}")
    _moe_finalize_fake(intermediate, expanded_to_permuted, token_final_scales)  # the routing's checks
    tokens, top_k = token_final_scales.shape
    _check(tokens * top_k == shape[0],
           f"{op}: intermediate must have num_tokens * top_k = {tokens * top_k} rows, got {shape[0]}")
    _check(permuted_to_expanded.dtype == torch.int32 and permuted_to_expanded.shape == (shape[0],),
           f"{op}: permuted_to_expanded must be int32 [num_tokens * top_k] = [{shape[0]}]")
    _check(out.shape == (tokens, shape[1]) and out.dtype == intermediate.dtype and out.device == intermediate.device,
           f"{op}: out must be [num_tokens, hidden] = {[tokens, shape[1]]} of the intermediate's dtype and device, "
           f"got {list(out.shape)} {out.dtype} on {out.device}")


@register_fake("cake::moe_routing_out")
def _moe_routing_out_fake(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                          local_expert_offset, tile_size, expert_ids, expert_weights, expert_counts, expert_offsets,
                          permuted_to_expanded, expanded_to_permuted, expert_tile_offsets, workspace):
    expected = _moe_routing_fake(router_logits, topk_ids, topk_weights, top_k, num_experts, num_local_experts,
                                 local_expert_offset, tile_size)
    outs = (expert_ids, expert_weights, expert_counts, expert_offsets, permuted_to_expanded, expanded_to_permuted,
            expert_tile_offsets)
    for out, want in zip(outs, expected):
        _check(out.shape == want.shape and out.dtype == want.dtype,
               f"cake::moe_routing_out: outputs must have moe_routing's shapes and dtypes, got {list(out.shape)} "
               f"{out.dtype} for {list(want.shape)} {want.dtype}")


@register_fake("cake::moe_gemm1_swiglu_out")
def _moe_gemm1_swiglu_out_fake(x, w1, permuted_to_expanded, expert_offsets, top_k, out, workspace, enable_pdl=True,
                               clamp_limits=None, tactic=-1, x_scale=None, w1_scale=None, expected_routes=-1,
                               zero_tail=True, expanded_to_permuted=None, w1_gate_up=False):
    want = _moe_gemm1_output(x, w1, permuted_to_expanded, top_k, x_scale, w1_scale, expected_routes,
                             expanded_to_permuted, "cake::moe_gemm1_swiglu_out")
    _check(out.shape == want.shape and out.dtype == want.dtype,
           f"cake::moe_gemm1_swiglu_out: out must be [T * top_k, I] = {list(want.shape)} {want.dtype}, got "
           f"{list(out.shape)} {out.dtype}")


_MOE_FORWARD_SPLIT_ITEMS = 256  # kMoeForwardSplitItems (moe_checks.h)
_MOE_FORWARD_SLICE_BYTES = 2048  # kMoeForwardSliceBytes


def _moe_forward_workspace_bytes(routes, hidden, inter):
    """moe_forward_workspace_bytes (moe_checks.h): h and y (16-bit), then slice sums and scales."""
    slices = -(-2 * max(hidden, inter) // _MOE_FORWARD_SLICE_BYTES)
    return 2 * routes * (inter + hidden) + 4 * _MOE_FORWARD_SPLIT_ITEMS * (1 + 64 * slices)


def _check_moe_forward(op, x, ids, scales, w1, w2, local_expert_offset, out, workspace, clamp_limits, x_scale,
                       w1_scale, fc2_scale, w2_scale):
    """check_moe_forward_out's checks (moe_checks.cpp)."""
    _check(x.dim() == 2, f"{op}: x must be a 2-D [num_tokens, hidden] tensor, got shape {list(x.shape)}")
    _check(x.dtype in (torch.bfloat16, torch.float16), f"{op}: x must be bfloat16 or float16, got {x.dtype}")
    tokens, hidden = x.shape
    _check(ids.dim() == 2 and ids.shape[0] == tokens and ids.shape[1] >= 1,
           f"{op}: token_selected_experts must be [num_tokens = {tokens}, top_k >= 1], got {list(ids.shape)}")
    _check(ids.dtype == torch.int32, f"{op}: token_selected_experts must be int32, got {ids.dtype}")
    _check(scales.shape == ids.shape and scales.dtype == torch.float32,
           f"{op}: token_final_scales must be float32 {list(ids.shape)}, got {scales.dtype} {list(scales.shape)}")
    _check(w1.dim() == 3 and w1.shape[0] >= 1 and w1.shape[1] % 2 == 0 and w1.shape[1] >= 2 and w1.shape[2] == hidden,
           f"{op}: w1 must be [E_local >= 1, 2I, hidden = {hidden}] with 2I even, got {list(w1.shape)}")
    num_local, inter = w1.shape[0], w1.shape[1] // 2
    _check(list(w2.shape) == [num_local, hidden, inter],
           f"{op}: w2 must be [E_local, hidden, I] = {[num_local, hidden, inter]}, got {list(w2.shape)}")
    _check(w2.dtype == w1.dtype, f"{op}: w2 must have w1's dtype {w1.dtype}, got {w2.dtype}")
    _check(local_expert_offset >= 0, f"{op}: local_expert_offset must be >= 0, got {local_expert_offset}")
    _check(w1.dtype == x.dtype or (x.dtype == torch.bfloat16 and w1.dtype == torch.float8_e4m3fn),
           f"{op}: w1 must have x's dtype {x.dtype} (or be float8_e4m3fn with bfloat16 x), got {w1.dtype}")
    _check_moe_gemm_input(x, x_scale, w1, w1_scale, "x", "w1", op)
    _check_moe_gemm_input(x, fc2_scale, w2, w2_scale, "fc2_scale's activations", "w2", op)
    if clamp_limits is not None:
        _check(clamp_limits.dim() == 1 and clamp_limits.shape[0] == num_local and clamp_limits.dtype == torch.float32,
               f"{op}: clamp_limits must be float32 [E_local] = [{num_local}], got {clamp_limits.dtype} "
               f"{list(clamp_limits.shape)}")
    _check(list(out.shape) == [tokens, hidden] and out.dtype == x.dtype,
           f"{op}: out must be [num_tokens, hidden] = {[tokens, hidden]} of x's dtype {x.dtype}, got "
           f"{list(out.shape)} {out.dtype}")
    need = _moe_forward_workspace_bytes(tokens * ids.shape[1], hidden, inter)
    _check(workspace.dtype == torch.uint8 and workspace.dim() == 1 and
           (workspace.numel() == 0 or workspace.numel() >= need),
           f"{op}: workspace must be a uint8 tensor of 0 or at least {need} bytes, got {workspace.dtype} "
           f"{list(workspace.shape)}")
    return ids.shape[1], num_local


@register_fake("cake::moe_forward_out")
def _moe_forward_out_fake(x, token_selected_experts, token_final_scales, w1, w2, local_expert_offset, out,
                          workspace, enable_pdl=True, clamp_limits=None, x_scale=None, w1_scale=None, fc2_scale=None,
                          w2_scale=None, expected_routes=-1, w1_gate_up=False):
    _check_moe_forward("cake::moe_forward_out", x, token_selected_experts, token_final_scales, w1, w2,
                       local_expert_offset, out, workspace, clamp_limits, x_scale, w1_scale, fc2_scale, w2_scale)
    _check_expected_routes(expected_routes, "cake::moe_forward_out")


@register_fake("cake::moe_forward_from_logits_out")
def _moe_forward_from_logits_out_fake(x, router_logits, w1, w2, local_expert_offset, token_selected_experts,
                                      token_final_scales, out, workspace, enable_pdl=True, clamp_limits=None,
                                      x_scale=None, w1_scale=None, fc2_scale=None, w2_scale=None):
    op = "cake::moe_forward_from_logits_out"
    top_k, num_local = _check_moe_forward(op, x, token_selected_experts, token_final_scales, w1, w2,
                                          local_expert_offset, out, workspace, clamp_limits, x_scale, w1_scale,
                                          fc2_scale, w2_scale)
    _check(router_logits.dim() == 2 and router_logits.shape[0] == x.shape[0],
           f"{op}: router_logits must be [num_tokens = {x.shape[0]}, num_experts], got shape "
           f"{list(router_logits.shape)}")
    _check(router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16),
           f"{op}: router_logits must be float32, bfloat16 or float16, got {router_logits.dtype}")
    num_experts = router_logits.shape[1]
    _check(1 <= top_k <= num_experts, f"{op}: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    _check(local_expert_offset + num_local <= num_experts,
           f"{op}: the shard [local_expert_offset, local_expert_offset + num_local_experts) = "
           f"[{local_expert_offset}, {local_expert_offset + num_local}) must lie within [0, num_experts={num_experts})")
