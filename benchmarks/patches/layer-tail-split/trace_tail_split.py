"""Diagnostic (modules TA / TB: main / 0001 with globaltimer stamps, branches trace-a / trace-b of session 44, diffs
in 0002-trace-stamps-*.patch): per-CTA stamps of the layer kernel's plain launch at T=1, written at the end of the
workspace's slice-sum region. Eager, no PDL. Stamps in us from the earliest entry."""
import torch

import cake_ops
from cake_ops import stepfun_moe as sm
from bench_stepfun_moe import AMPLITUDE, LIMIT, random_weights

NAMES = {0: "entry", 1: "routes", 8: "ph1_u0_start", 9: "ph1_u0_end", 10: "ph1_u1_start", 11: "ph1_u1_end",
         2: "ph1_end", 3: "sync1", 7: "tail_stored", 12: "ph2_u0_start", 13: "ph2_u0_end", 14: "ph2_u1_start",
         15: "ph2_u1_end", 4: "ph2_end", 5: "sync2", 6: "end"}


def trace(name, e, k, h, inter, family):
    torch.manual_seed(0)
    w1, w2 = random_weights(e, h, inter, "cuda")
    weights = sm.prepare_weights(w1, w2, LIMIT, family=family)
    x = (AMPLITUDE * torch.randn(1, h, device="cuda")).bfloat16()
    routed = sm.routing(torch.randn(1, e, device="cuda"), top_k=k, num_experts=e)
    out = torch.empty_like(x)
    ws = torch.zeros(cake_ops._C.moe_forward_workspace_size(k, h, inter), dtype=torch.uint8, device="cuda")
    fp8 = family == "fp8"
    q = (weights.gemm1_clamp_limit, weights.fc1_input_scale if fp8 else None, weights.w1_scale,
         weights.fc2_input_scale if fp8 else None, weights.w2_scale)
    for _ in range(30):
        torch.ops.cake.moe_forward_out(x, routed.expert_ids, routed.expert_weights, weights.w1, weights.w2, 0, out, ws,
                                       False, *q)
    torch.cuda.synchronize()
    grid = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    t = ws[ws.numel() - grid * 16 * 8:].view(torch.int64).view(grid, 16).cpu().double()
    base = t[:, 0][t[:, 0] > 0].min()
    print(f"== {name} {family}: {int((t[:, 0] > 0).sum())} CTAs, scales {'static' if q[1] is not None else 'dynamic'}")
    for i, label in NAMES.items():
        col = t[:, i]
        col = col[col >= base]
        if col.numel() == 0:
            continue
        rel = (col - base) / 1e3
        print(f"  {label:14} n {col.numel():4d}  min {rel.min():7.2f}  med {rel.median():7.2f}  max {rel.max():7.2f} us")


if __name__ == "__main__":
    for family in ("bf16", "fp8"):
        trace("stepfun_issue", 64, 8, 4096, 1536, family)
        trace("step35_flash", 288, 8, 4096, 1280, family)
