"""Diagnostic (patches/layer-trace-s36 only): per-CTA globaltimer stamps of the layer kernel at T=1 (non-spread
instantiation), written into the workspace's slice-sum region. Eager, no PDL. Stamps in us from the earliest entry.
`run_layer` and `print_stamps` serve session 44's trace too (patches/layer-tail-split/trace_tail_split.py)."""
import torch

import cake_ops
from cake_ops import stepfun_moe as sm
from bench_stepfun_moe import AMPLITUDE, LIMIT, random_weights

NAMES = {0: "entry", 1: "routes", 2: "ph1_end", 3: "sync1", 4: "ph2_end", 5: "sync2", 6: "end",
         7: "ph1_scale", 8: "ph1_u0_start", 9: "ph1_u0_end", 10: "ph1_u1_start", 11: "ph2_scale",
         12: "ph2_u0_start", 13: "ph2_u0_end", 14: "ph2_u1_start", 15: "ph2_u1_end"}
ORDER = [0, 1, 7, 8, 9, 10, 2, 3, 11, 12, 13, 14, 15, 4, 5, 6]


def run_layer(e, k, h, inter, family):
    """The StepFun layer at T=1 (seed 0) run 30 times on a zeroed workspace: (workspace, dynamic scales?)."""
    torch.manual_seed(0)
    w1, w2 = random_weights(e, h, inter, "cuda")
    weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
    x = (AMPLITUDE * torch.randn(1, h, device="cuda")).bfloat16()
    routed = sm.routing(torch.randn(1, e, device="cuda"), top_k=k, num_experts=e)
    ids, scales = routed.expert_ids, routed.expert_weights
    out = torch.empty_like(x)
    ws = torch.zeros(cake_ops._C.moe_forward_workspace_size(k, h, inter), dtype=torch.uint8, device="cuda")
    fp8 = family == "fp8"
    q = (weights.gemm1_clamp_limit, weights.fc1_input_scale if fp8 else None, weights.w1_scale,
         weights.fc2_input_scale if fp8 else None, weights.w2_scale)
    for _ in range(30):
        torch.ops.cake.moe_forward_out(x, ids, scales, weights.w1, weights.w2, 0, out, ws, False, *q)
    torch.cuda.synchronize()
    return ws, q[1] is None


def print_stamps(title, t, names, order):
    """t [CTAs, 16] int64 globaltimer stamps (0: not written): each slot's min / median / max from the first entry."""
    t = t.cpu().double()
    t = t[t[:, 0] > 0]
    base = t[:, 0].min()
    print(f"== {title}: {t.shape[0]} CTAs")
    for i in order:
        col = t[:, i]
        col = col[col >= base]
        if col.numel() == 0:
            continue
        rel = (col - base) / 1e3
        print(f"  {names[i]:14} n {col.numel():4d}  min {rel.min():7.2f}  med {rel.median():7.2f}  max {rel.max():7.2f} us")


def trace(name, e, k, h, inter, family):
    ws, dynamic = run_layer(e, k, h, inter, family)
    off = 2 * k * (inter + h) + 4 * 256
    t = ws[off:off + 264 * 16 * 8].view(torch.int64).view(264, 16)
    print_stamps(f"{name} {family}, scales {'dynamic' if dynamic else 'static'}", t, NAMES, ORDER)


if __name__ == "__main__":
    trace("stepfun_issue", 64, 8, 4096, 1536, "bf16")
    trace("stepfun_issue", 64, 8, 4096, 1536, "fp8")
    trace("step35_flash", 288, 8, 4096, 1280, "bf16")
    trace("step35_flash", 288, 8, 4096, 1280, "fp8")
