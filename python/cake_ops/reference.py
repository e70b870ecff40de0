"""Plain-PyTorch float64 references of the ops, for tests and docs (slow, exact)."""
import torch


def group_bounds(offs: torch.Tensor, num_groups: int) -> list:
    """[0, end_0, ..., end_{E-1}] from offs [E] or m_indptr [E + 1]."""
    ends = offs.tolist()
    if len(ends) == num_groups + 1:
        ends = ends[1:]
    return [0] + ends


def grouped_gemm_fwd(x, w, offs):
    b = group_bounds(offs, w.shape[0])
    y = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e in range(w.shape[0]):
        y[b[e]:b[e + 1]] = x[b[e]:b[e + 1]].double() @ w[e].double().T
    return y


def grouped_gemm_dgrad(grad_out, w, offs):
    b = group_bounds(offs, w.shape[0])
    dx = torch.zeros(grad_out.shape[0], w.shape[2], dtype=torch.float64, device=w.device)
    for e in range(w.shape[0]):
        dx[b[e]:b[e + 1]] = grad_out[b[e]:b[e + 1]].double() @ w[e].double()
    return dx


def grouped_gemm_wgrad(grad_out, x, offs, num_groups):
    b = group_bounds(offs, num_groups)
    dw = torch.zeros(num_groups, grad_out.shape[1], x.shape[1], dtype=torch.float64, device=x.device)
    for e in range(num_groups):
        dw[e] = grad_out[b[e]:b[e + 1]].double().T @ x[b[e]:b[e + 1]].double()
    return dw


def quantize_fp8(x, scale=None):
    """Per-tensor e4m3 quantize-dequantize in float32: (e4m3(clamp(x / s, -448, 448)) * s, s), s =
    ``scale`` or max(|x|) / 448."""
    x = x.float()
    if scale is None:
        scale = max(float(x.abs().max()) if x.numel() else 0.0, 1e-12) / 448.0
    q = (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.float() * scale, scale


def moe_forward(x, token_selected_experts, token_final_scales, w1_gate_up, w2, num_local_experts=None,
                local_expert_offset=0, limit=None, fp8_activations=False):
    """float32 MoE: out[t] = sum_j scale[t, j] * ffn(x[t]; e[t, j]) over the routes whose expert is
    in this shard, with ffn(x; e) = act(x @ w1_gate[e].T, x @ w1_up[e].T) @ w2[e].T. w1_gate_up is
    gate-first [E_local, 2I, H]; act is SwiGLU silu(g) * u, or with ``limit`` (per expert, [E_local])
    SwiGLUStep min(silu(g), L) * clamp(u, -L, L). ``fp8_activations``: GEMM2's input is
    quantize-dequantized per tensor (``quantize_fp8``, dynamic scale over every kept route; a number:
    that static scale), as the fp8 pipelines do."""
    e_local = w1_gate_up.shape[0] if num_local_experts is None else num_local_experts
    inter = w1_gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    local = token_selected_experts.long() - local_expert_offset
    routes = []
    for e in range(e_local):
        tokens, slots = (local == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].float() @ w1_gate_up[e].float().T
        gate, up = h[:, :inter], h[:, inter:]
        act = torch.nn.functional.silu(gate)
        if limit is not None:
            lim = float(limit[e])
            act = act.clamp(max=lim) * up.clamp(-lim, lim)
        else:
            act = act * up
        routes.append((e, tokens, slots, act))
    if fp8_activations is not False and routes:
        static = None if fp8_activations is True else float(fp8_activations)
        acts, _ = quantize_fp8(torch.cat([r[3] for r in routes]), static)
        sizes = [r[3].shape[0] for r in routes]
        routes = [(e, tokens, slots, act) for (e, tokens, slots, _), act in zip(routes, acts.split(sizes))]
    for e, tokens, slots, act in routes:
        y = act @ w2[e].float().T
        out.index_add_(0, tokens, y * token_final_scales[tokens, slots].float()[:, None])
    return out
