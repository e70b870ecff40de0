"""One fused_moe_bf16 forward (Qwen3-30B and Qwen3-235B shapes, T=4096, seed 0) and a checksum of its output
bits: the gather-ahead switch-off experiment's modes (CAKE_GEMM1_GATHER_AHEAD, read once per process) must all
print the same checksums as mode 0 (the gather kernel and the plain tile)."""
import torch

from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import seed_case
from cake_ops.fused_moe import fused_moe_bf16, interleave_up_gate_sm90

for name in ("qwen3_30b", "qwen3_235b"):
    e, k, h, inter, e_local, offset = MODELS[name]
    seed_case(name, 4096)
    w1 = interleave_up_gate_sm90((torch.randn(e_local, 2 * inter, h, device="cuda") / h**0.5).bfloat16())
    w2 = (torch.randn(e_local, h, inter, device="cuda") / inter**0.5).bfloat16()
    x = torch.randn(4096, h, device="cuda").bfloat16()
    ids, scales = routing(4096, e, k, "cuda")
    for fused in (False, True):  # the deterministic path is bitwise; the fused one's atomics are not
        out = fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=fused)
        bits = out.view(torch.int16).to(torch.int64)
        print(f"{name} fused={fused}: checksum {int((bits * torch.arange(1, bits.numel() + 1, device='cuda').view_as(bits) % 1000003).sum())}"
              f" finite {bool(out.isfinite().all())}", flush=True)
    del w1, w2
