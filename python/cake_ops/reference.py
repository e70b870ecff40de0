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
