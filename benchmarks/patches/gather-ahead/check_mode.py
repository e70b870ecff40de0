"""One deterministic fused_moe_bf16 forward (Qwen3-30B and Qwen3-235B shapes, T=4096) and a checksum of its output
bits: the gather-ahead switch-off experiment's modes (CAKE_GEMM1_GATHER_AHEAD, read once per process) must all
print mode 0's checksums (the gather kernel and the plain tile). The deterministic finalize, because the fused
one's atomics add in any order; both paths share GEMM1, which is what the modes change."""
import torch

from bench_fused_moe import MODELS, routing
from bench_grouped_gemm import seed_case
from cake_ops.fused_moe import fused_moe_bf16
from sweep_moe_gemm import model_weights

for name in ("qwen3_30b", "qwen3_235b"):
    e, k, h, inter, e_local, offset = MODELS[name]
    w1, w2 = model_weights(name)
    seed_case(name, 4096)
    x = torch.randn(4096, h, device="cuda").bfloat16()
    ids, scales = routing(4096, e, k, "cuda")
    out = fused_moe_bf16(x, ids, scales, w1, w2, e, k, e_local, offset, use_fused_finalize=False)
    bits = out.view(torch.int16).to(torch.int64).flatten()
    weights = torch.arange(1, bits.numel() + 1, device="cuda")
    print(f"{name}: checksum {int((bits * weights % 1000003).sum())} finite {bool(out.isfinite().all())}", flush=True)
    del w1, w2
